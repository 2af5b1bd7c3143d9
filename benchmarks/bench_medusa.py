"""Medusa heads (assets/smollm2-medusa) against the EAGLE-style head and plain decoding, on held-out prompts.

Held-out prompts come from ``engine.training.draft_data.build_prompts(n, "heldout")`` (topics never used in
training). Every method runs through the engine (``SpeculativeDecoder``), alternating method by method on
each prompt, in one process:

- plain decoding;
- Medusa heads, chain (``--tree 0``: each head's top-1, γ = K);
- Medusa heads, the shipped static tree (γ = K) and, with ``--medusa-trees``, trees of other sizes;
- the EAGLE-style head, chain at its default γ, and as a tree (EAGLE-2 dynamic tree, ``--head-tree`` nodes)
  when the engine's head can draft trees.

Per method: tokens/s (total tokens ÷ total wall time, prefill included), mean accepted draft tokens per
target pass, tokens per target pass, acceptance by depth (= per head for Medusa: P(depth d accepted | the
path down to d − 1 accepted and the draft reached depth d)), and (greedy) whether the output equals plain
decoding's.

    .venv/bin/python benchmarks/bench_medusa.py [--prompts 6] [--max-new-tokens 64] [--threads 2]
        [--temperature 0] [--medusa-trees 3,8]

Writes benchmarks/results/medusa.json and medusa.md (``--out PATH`` for others; the shipped results name their
machine, ``medusa_amd-epyc``, ``medusa_xeon``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.decoding.models import EMBEDDED_HEAD, EMBEDDED_HEAD_GAMMA, EMBEDDED_MEDUSA, load_model  # noqa: E402
from engine.decoding.drafts import make_proposer  # noqa: E402
from engine.decoding.sampling import SamplingConfig  # noqa: E402
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt  # noqa: E402
from engine.training.draft_data import build_prompts  # noqa: E402
from benchmarks.bench_head import cpu_model  # noqa: E402
from benchmarks.machine import machine_line, machine_meta  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "medusa"


def depth_acceptance(rounds, max_depth: int) -> list[dict]:
    """Acceptance by draft depth d = 1..max_depth over rounds: judged = rounds whose accepted path reached
    d − 1 and whose draft had a node at depth d; accepted = those whose path reached d."""
    out = []
    for d in range(1, max_depth + 1):
        judged = accepted = 0
        for r in rounds:
            depth = max((n.depth for n in r.tree.nodes), default=0) if r.tree is not None else len(r.drafted)
            if depth >= d and r.n_accepted >= d - 1:
                judged += 1
                accepted += r.n_accepted >= d
        out.append({"depth": d, "accepted": accepted, "judged": judged,
                    "rate": round(accepted / judged, 4) if judged else None})
    return out


def methods(target, k_heads: int, medusa_tree: int, extra_trees: list[int], head_tree: int) -> list[tuple]:
    """(name, draft spec, γ, tree size) of every method."""
    out = [("plain", None, 1, 0), (f"Medusa chain (γ = {k_heads})", EMBEDDED_MEDUSA, k_heads, 0)]
    if medusa_tree:
        out.append((f"Medusa tree, shipped ({medusa_tree} nodes)", EMBEDDED_MEDUSA, k_heads, medusa_tree))
    out += [(f"Medusa tree, {n} nodes", EMBEDDED_MEDUSA, k_heads, n) for n in extra_trees if n != medusa_tree]
    out.append((f"EAGLE-style head chain (γ = {EMBEDDED_HEAD_GAMMA})", EMBEDDED_HEAD, EMBEDDED_HEAD_GAMMA, 0))
    if head_tree and callable(getattr(make_proposer(EMBEDDED_HEAD, target), "propose_tree", None)):
        out.append((f"EAGLE-style head tree ({head_tree} nodes, depth ≤ 3)", EMBEDDED_HEAD, 3, head_tree))
    return out


def run(target, prompts: list[str], max_new: int, cfg: SamplingConfig, plan: list[tuple], seed: int = 0) -> dict:
    rows = {name: {"ms": 0.0, "tokens": 0, "passes": 0, "accepted": 0, "drafted": 0, "identical": True,
                   "rounds": []} for name, *_ in plan}
    for i, p in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, p)
        base = None
        for name, spec, gamma, tree in plan:
            prop = make_proposer(spec, target) if spec else None
            t0 = time.perf_counter()
            dec = SpeculativeDecoder(target, prop, ids, gamma=gamma, sampling=cfg, seed=seed, max_new_tokens=max_new,
                                     tree=tree)
            res = dec.run()
            ms = (time.perf_counter() - t0) * 1e3
            r = rows[name]
            r["ms"] += ms
            r["tokens"] += len(res.token_ids)
            r["passes"] += res.stats.rounds
            r["accepted"] += sum(x.n_accepted for x in res.rounds)
            r["drafted"] += res.stats.drafted
            r["rounds"] += res.rounds
            if base is None:
                base = res.token_ids
            r["identical"] &= res.token_ids == base
        print(f"[bench] prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    base_tps = rows["plain"]["tokens"] / rows["plain"]["ms"] * 1e3
    depth = max(g for _, _, g, _ in plan)
    for name, r in rows.items():
        rounds = r.pop("rounds")
        r["tokens_per_s"] = round(r["tokens"] / r["ms"] * 1e3, 2)
        r["speedup_vs_plain"] = round(r["tokens_per_s"] / base_tps, 3)
        r["accepted_per_pass"] = round(r["accepted"] / max(r["passes"], 1), 3)
        r["tokens_per_pass"] = round(r["tokens"] / max(r["passes"], 1), 3)
        if name != "plain":
            r["acceptance_by_depth"] = depth_acceptance(rounds, depth)
            r["verify_tokens_per_pass"] = round(sum(x.tokens_verified for x in rounds) / max(len(rounds), 1), 2)
        if not cfg.greedy:
            r.pop("identical")
        r["ms"] = round(r["ms"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--medusa-trees", default="", help="comma-separated extra Medusa tree sizes")
    ap.add_argument("--head-tree", type=int, default=6, help="nodes of the EAGLE-style head's tree (0: no tree)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model("embedded", device="cpu")
    medusa = make_proposer(EMBEDDED_MEDUSA, target)
    k = medusa.heads.n_heads
    extra = [int(x) for x in args.medusa_trees.split(",") if x.strip()]
    plan = methods(target, k, medusa.tree_size, extra, args.head_tree)
    prompts = [p["prompt"] for p in build_prompts(args.prompts, "heldout", seed=0)]
    cfg = SamplingConfig(temperature=args.temperature)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "platform": platform.platform(),
            "cpu": cpu_model(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "load_avg_1min_start": os.getloadavg()[0],
            "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "medusa_choices": medusa.choices, "plan": [list(p) for p in plan]}
    meta.update(machine_meta(target))
    res = {"meta": meta, "rows": run(target, prompts, args.max_new_tokens, cfg, plan)}
    meta["load_avg_1min_end"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    rule = "greedy" if cfg.greedy else f"T = {args.temperature:g}, lossless tree/chain rules"
    lines = [f"# Medusa heads vs the EAGLE-style head vs plain decoding ({meta['date']})", "", machine_line(meta), "",
             f"Embedded SmolLM2-135M-Instruct (fp32, {meta['cpu']}, {meta['threads']} threads), {len(prompts)} held-out prompts × "
             f"≤ {args.max_new_tokens} new tokens, {rule}; methods alternate on each prompt in one process. "
             f"`{meta['command']}`. Load average (1 min) {meta['load_avg_1min_start']:.1f} at the start, "
             f"{meta['load_avg_1min_end']:.1f} at the end (a shared 2-core machine: tokens/s are noisy; the counts "
             "are not).", "",
             f"Shipped Medusa tree (`medusa_choices`): `{medusa.choices}`.", "",
             "| method | tokens/s | × plain | accepted draft tokens / pass | tokens / pass | tokens fed / pass | "
             "acceptance by depth (head 1, 2, …) | identical to plain |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in res["rows"].items():
        by = ", ".join("—" if d["rate"] is None else f"{d['rate']:.2f}" for d in r.get("acceptance_by_depth", []))
        ident = {True: "yes", False: "no"}.get(r.get("identical"), "—")
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f} | {r['accepted_per_pass']:.2f} | "
                     f"{r['tokens_per_pass']:.2f} | {r.get('verify_tokens_per_pass', 1)} | {by or '—'} | {ident} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
