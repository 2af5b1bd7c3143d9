"""The block drafter (assets/smollm2-block, DFlash-style) against the EAGLE-style head, Medusa heads and plain
decoding, on held-out prompts; and what one block pass costs on this machine.

Held-out prompts come from ``engine.training.draft_data.build_prompts(n, "heldout")`` (topics never used in
training). Every method runs through the engine (``SpeculativeDecoder``), method after method on each prompt, in
one process:

- plain decoding;
- the block drafter as a chain, blocks of ``--blocks`` (γ = B − 1), and at its default block on this machine;
- the block drafter with the confidence cut (``--cut``: the chain stops at the first slot whose top probability is
  below it; DSpark's idea with the drafter's own confidence, see engine/decoding/block_drafter.py);
- the block drafter as a static token tree (``--block-tree`` nodes, depth = the default γ);
- the EAGLE-style head, chain at its default γ on this machine; Medusa heads with their static tree.

Per method: tokens/s (total tokens ÷ total wall time, prefill included), × plain, accepted draft tokens per
target pass, tokens per target pass, tokens fed per pass, acceptance by depth, draft ms per round and (greedy)
whether the output equals plain decoding's. Then the block pass: one drafter round (one new context entry + a
block of B) against one target decode step, medians (``engine.training.train_block.block_pass_ms``).

    .venv/bin/python benchmarks/bench_block.py [--prompts 6] [--max-new-tokens 64] [--threads 2] [--blocks 4,8,16]

Writes benchmarks/results/block.json and block.md (``--out PATH`` for others). What-if's sequential-vs-parallel tab
reads the shipped ``benchmarks/results/block_amd-epyc.json`` (written with ``--out benchmarks/results/block_amd-epyc``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.bench_medusa import depth_acceptance  # noqa: E402
from benchmarks.machine import machine_line, machine_meta  # noqa: E402
from engine.decoding.drafts import make_proposer  # noqa: E402
from engine.decoding.models import EMBEDDED, EMBEDDED_BLOCK, EMBEDDED_HEAD, EMBEDDED_MEDUSA, load_model  # noqa: E402
from engine.decoding.sampling import SamplingConfig  # noqa: E402
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt  # noqa: E402
from engine.explain.analytic import default_gamma_here  # noqa: E402
from engine.training.draft_data import build_prompts  # noqa: E402
from engine.training.train_block import block_pass_ms  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "block"


def plan(target, blocks: list[int], cut: float, block_tree: int) -> list[dict]:
    """Every method: name, kind (plain / block / head / medusa), draft spec, γ, tree size, confidence cut."""
    g_block = default_gamma_here(EMBEDDED_BLOCK, EMBEDDED)[0]
    g_head = default_gamma_here(EMBEDDED_HEAD, EMBEDDED)[0]
    medusa = make_proposer(EMBEDDED_MEDUSA, target)
    out = [{"name": "plain", "kind": "plain", "spec": None, "gamma": 1, "tree": 0, "cut": 0.0}]
    for b in sorted(set(blocks) | {g_block + 1}):
        tag = " (default here)" if b == g_block + 1 else ""
        out.append({"name": f"block chain B = {b}{tag}", "kind": "block", "spec": EMBEDDED_BLOCK, "gamma": b - 1,
                    "tree": 0, "cut": 0.0})
    if cut > 0:
        b = max(blocks)
        out.append({"name": f"block chain B = {b}, confidence cut {cut:g}", "kind": "block-cut", "spec": EMBEDDED_BLOCK,
                    "gamma": b - 1, "tree": 0, "cut": cut})
    if block_tree:
        out.append({"name": f"block tree ({block_tree} nodes, depth ≤ {g_block})", "kind": "block-tree",
                    "spec": EMBEDDED_BLOCK, "gamma": g_block, "tree": block_tree, "cut": 0.0})
    out.append({"name": f"EAGLE-style head chain (γ = {g_head})", "kind": "head", "spec": EMBEDDED_HEAD,
                "gamma": g_head, "tree": 0, "cut": 0.0})
    out.append({"name": f"Medusa heads, static tree ({medusa.tree_size} nodes)", "kind": "medusa",
                "spec": EMBEDDED_MEDUSA, "gamma": medusa.heads.n_heads, "tree": medusa.tree_size, "cut": 0.0})
    return out


def run(target, prompts: list[str], max_new: int, cfg: SamplingConfig, methods: list[dict]) -> list[dict]:
    rows = {m["name"]: {**{k: m[k] for k in ("kind", "gamma", "tree", "cut")}, "ms": 0.0, "draft_ms": 0.0,
                        "tokens": 0, "passes": 0, "accepted": 0, "identical": True, "rounds": []} for m in methods}
    for i, p in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, p)
        base = None
        for m in methods:
            prop = make_proposer(m["spec"], target) if m["spec"] else None
            if m["cut"]:
                prop.confidence_threshold = m["cut"]
            t0 = time.perf_counter()
            res = SpeculativeDecoder(target, prop, ids, gamma=m["gamma"], sampling=cfg, max_new_tokens=max_new,
                                     tree=m["tree"]).run()
            r = rows[m["name"]]
            r["ms"] += (time.perf_counter() - t0) * 1e3
            r["tokens"] += len(res.token_ids)
            r["passes"] += res.stats.rounds
            r["accepted"] += sum(x.n_accepted for x in res.rounds)
            r["draft_ms"] += sum(x.draft_ms for x in res.rounds)
            r["rounds"] += res.rounds
            base = res.token_ids if base is None else base
            r["identical"] &= res.token_ids == base
        print(f"[bench] prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    base_tps = rows["plain"]["tokens"] / rows["plain"]["ms"] * 1e3
    out = []
    for name, r in rows.items():
        rounds = r.pop("rounds")
        row = {"draft": name, **{k: r[k] for k in ("kind", "gamma", "tree", "cut")},
               "tokens_per_s": round(r["tokens"] / r["ms"] * 1e3, 2),
               "speedup": round(r["tokens"] / r["ms"] * 1e3 / base_tps, 3),
               "accepted_per_pass": round(r["accepted"] / max(r["passes"], 1), 3),
               "tokens_per_pass": round(r["tokens"] / max(r["passes"], 1), 3),
               "fed_per_pass": round(sum(x.tokens_verified for x in rounds) / max(len(rounds), 1), 2),
               "draft_ms_per_round": round(r["draft_ms"] / max(len(rounds), 1), 2),
               "acceptance_by_depth": depth_acceptance(rounds, max(r["gamma"], 1)) if r["kind"] != "plain" else [],
               "ms": round(r["ms"])}
        if cfg.greedy:
            row["identical"] = r["identical"]
        if r["kind"] == "plain":
            row["gamma"] = 0
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--blocks", default="4,8,16", help="block sizes of the chain rows")
    ap.add_argument("--cut", type=float, default=0.3, help="confidence cut of the cut row (0: no such row)")
    ap.add_argument("--block-tree", type=int, default=8, help="nodes of the block tree row (0: none)")
    ap.add_argument("--pass-reps", type=int, default=9, help="timed repetitions of each block pass")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    blocks = [int(b) for b in args.blocks.split(",") if b.strip()]
    target = load_model("embedded", device="cpu")
    block = make_proposer(EMBEDDED_BLOCK, target)
    methods = plan(target, blocks, args.cut, args.block_tree)
    prompts = [p["prompt"] for p in build_prompts(args.prompts, "heldout", seed=0)]
    cfg = SamplingConfig(temperature=args.temperature)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, **machine_meta(target)}
    sizes = sorted({2, 4, 8, 12, 16} & set(range(2, block.max_block + 1)) | set(blocks))
    cost = block_pass_ms(target, block.drafter, sizes, reps=args.pass_reps)
    rows = run(target, prompts, args.max_new_tokens, cfg, methods)
    cost2 = block_pass_ms(target, block.drafter, sizes, reps=args.pass_reps)  # again after: a busy spell shows
    meta["load_avg_1min_end"] = round(__import__("os").getloadavg()[0], 2)
    step = (cost["target_step_ms"] + cost2["target_step_ms"]) / 2
    passes = [{"block": b, "ms": round((cost["block_ms"][b] + cost2["block_ms"][b]) / 2, 3),
               "ratio": round((cost["block_ms"][b] + cost2["block_ms"][b]) / 2 / step, 4)} for b in sizes]
    res = {"machine": {"cpu": meta["cpu"], "threads": meta["threads"], "compute": meta["compute"],
                       "torch": meta["torch"]},
           "meta": meta, "command": meta["command"], "target_step_ms": round(step, 3), "block_pass": passes,
           "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    rule = "greedy" if cfg.greedy else f"T = {args.temperature:g}, lossless chain/tree rules"
    lines = [f"# Block drafter (DFlash-style) vs the EAGLE-style head vs Medusa heads vs plain ({meta['date']})", "",
             machine_line(meta), "",
             f"Embedded SmolLM2-135M-Instruct (fp32), {len(prompts)} held-out prompts × ≤ {args.max_new_tokens} new "
             f"tokens, {rule}; methods run one after another on each prompt in one process. `{meta['command']}`.", "",
             "## One block pass against one target step", "",
             f"Target decode step (1 token after 128 cached): **{step:.1f} ms**. A drafter round = one new context "
             "entry plus the block, one pass (medians, measured before and after the runs below, averaged).", "",
             "| block B | drafter pass (ms) | ÷ target step |", "|---|---|---|"]
    lines += [f"| {p['block']} | {p['ms']:.2f} | {p['ratio']:.3f} |" for p in passes]
    lines += ["", "## Decoding", "",
              "| method | tokens/s | × plain | accepted draft tokens / pass | tokens / pass | tokens fed / pass | "
              "draft ms / round | acceptance by depth | identical to plain |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        by = ", ".join("—" if d["rate"] is None else f"{d['rate']:.2f}" for d in r["acceptance_by_depth"][:8])
        ident = {True: "yes", False: "no"}.get(r.get("identical"), "—")
        lines.append(f"| {r['draft']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['accepted_per_pass']:.2f} | "
                     f"{r['tokens_per_pass']:.2f} | {r['fed_per_pass']} | {r['draft_ms_per_round']:.1f} | {by or '—'} | "
                     f"{ident} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
