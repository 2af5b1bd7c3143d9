"""Token trees vs chains on the embedded model: the draft head (EAGLE-2 dynamic tree) and prompt lookup.

Prompts: held-out chat prompts (``engine.training.draft_data.build_prompts(n, "heldout")``, topics never used
to train the head) and the Live page's presets (``engine.explain.presets``: chat, code edit, summary). Greedy,
so every output must equal plain decoding's. Per prompt the methods run one after another in one process
(plain, then each variant, in a fixed order), so slow phases of a busy machine hit all of them; totals per
method:

- accepted per round: mean accepted draft tokens per target pass (the accepted path's length for a tree);
- tokens per pass: new tokens ÷ target passes (``RunStats.tokens_per_target_pass``);
- tokens/s: new tokens ÷ wall time, summed over prompts; speedup = plain's ms per token ÷ the method's;
- draft ms per round and nodes per round (a tree's cost on the draft side);
- verify ms by tokens fed: one target pass over n = 1, 2, 4, 8, 16, 32 tokens after a cached context of 100,
  as a chain (causal) and as a binary-ish tree (``tree_verify_pass``: each node over its context and ancestors), sizes
  interleaved, medians.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tree.py [--prompts 6] [--max-new-tokens 64]
        [--threads 1] [--quick]   (2 threads on a loaded 2-core machine were ~20× slower)

Writes benchmarks/results/tree.json and tree.md (``--out`` for others; the shipped results name their machine,
``tree_amd-epyc``, ``tree_xeon``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.machine import machine_line, machine_meta  # noqa: E402
from engine.decoding.models import load_model  # noqa: E402
from engine.decoding.proposers import CachedLM  # noqa: E402
from engine.decoding.drafts import make_proposer  # noqa: E402
from engine.decoding.speculative import encode_prompt, generate  # noqa: E402
from engine.decoding.tree import TokenTree, tree_verify_pass  # noqa: E402
from engine.explain.presets import PROMPT_PRESETS  # noqa: E402
from engine.training.draft_data import build_prompts  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "tree"

# (name, draft spec, γ = chain length or tree depth, tree nodes (0 = chain), branching)
VARIANTS = [
    ("head chain γ=2", "embedded-head", 2, 0, None),
    ("head chain γ=3", "embedded-head", 3, 0, None),
    ("head tree N=3 d=2 k=2", "embedded-head", 2, 3, 2),
    ("head tree N=4 d=3 k=2", "embedded-head", 3, 4, 2),
    ("head tree N=8 d=4 k=2", "embedded-head", 4, 8, 2),
    ("head tree N=16 d=5 k=4", "embedded-head", 5, 16, 4),
    ("lookup chain γ=4", "ngram", 4, 0, None),
    ("lookup tree N=8 d=4 k=2", "ngram", 4, 8, 2),
    ("lookup tree N=16 d=4 k=4", "ngram", 4, 16, 4),
]


def binaryish_parents(n: int) -> list[int]:
    """A complete binary tree of n nodes with two roots (0 and 1): node i ≥ 2 has parent (i − 2) // 2."""
    return [-1 if i < 2 else (i - 2) // 2 for i in range(n)]


@torch.inference_mode()
def verify_costs(target, sizes=(1, 2, 4, 8, 16, 32), reps: int = 5, context: int = 100) -> dict:
    """Median ms of one target pass over n new tokens after a cached context of ``context`` tokens: as a
    chain (plain causal pass, ``CachedLM.logits_for``) and as a tree (``tree_verify_pass``),
    n + 1 tokens fed either way (the last context token plus n), sizes and kinds interleaved."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (context + max(sizes),), generator=g).tolist()
    times = {(kind, n): [] for n in sizes for kind in ("chain", "tree")}
    lm = CachedLM(target.model, target.device)
    lm.logits_for(ids[:context - 1], 1)
    for _ in range(reps):
        for n in sizes:
            for kind in ("chain", "tree"):
                lm.crop(context - 1)  # the cached context, the same for every pass
                t0 = time.perf_counter()
                if kind == "chain":
                    lm.logits_for(ids[:context + n], n + 1)
                else:
                    tree = TokenTree(ids[context:context + n], binaryish_parents(n), torch.zeros(n, 1))
                    tree_verify_pass(lm, ids[:context], tree)
                times[(kind, n)].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    one = med[("chain", 1)]
    return {"context": context, "reps": reps,
            "rows": [{"tokens_fed": n + 1, "nodes": n, "chain_ms": round(med[("chain", n)], 2),
                      "tree_ms": round(med[("tree", n)], 2),
                      "tree_ratio_to_one_draft_token": round(med[("tree", n)] / one, 3)} for n in sizes]}


def run(target, prompts: list[tuple[str, str]], max_new: int, variants) -> dict:
    rows = {"plain": {"ms": 0.0, "tokens": 0, "passes": 0}}
    for name, *_ in variants:
        rows[name] = {"ms": 0.0, "tokens": 0, "passes": 0, "rounds": 0, "accepted": 0, "judged": 0, "draft_ms": 0.0,
                      "nodes": 0, "identical": True}
    for i, (label, text) in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, text)
        t0 = time.perf_counter()
        base = generate(target, None, ids, max_new_tokens=max_new)
        rows["plain"]["ms"] += (time.perf_counter() - t0) * 1e3
        rows["plain"]["tokens"] += len(base.token_ids)
        rows["plain"]["passes"] += base.stats.target_passes
        for name, spec, gamma, tree, branching in variants:
            r = rows[name]
            prop = make_proposer(spec, target)
            if branching:
                prop.set_branching(branching)
            t0 = time.perf_counter()
            res = generate(target, prop, ids, gamma=gamma, max_new_tokens=max_new, tree=tree)
            r["ms"] += (time.perf_counter() - t0) * 1e3
            s = res.stats
            r["tokens"] += s.new_tokens
            r["passes"] += s.target_passes
            r["rounds"] += s.rounds
            r["accepted"] += s.accepted
            r["judged"] += s.judged
            r["draft_ms"] += sum(x.draft_ms for x in res.rounds)
            r["nodes"] += sum(len(x.tree.nodes) if x.tree else x.n_drafted for x in res.rounds)
            r["identical"] &= res.token_ids == base.token_ids
        print(f"  prompt {i + 1}/{len(prompts)} ({label})", file=sys.stderr, flush=True)
    plain_ms_tok = rows["plain"]["ms"] / rows["plain"]["tokens"]
    for name, r in rows.items():
        r["tokens_per_s"] = round(r["tokens"] / (r["ms"] / 1e3), 2)
        r["tokens_per_pass"] = round(r["tokens"] / r["passes"], 3)
        r["speedup"] = round(plain_ms_tok / (r["ms"] / r["tokens"]), 3)
        if name != "plain":
            r["accepted_per_round"] = round(r["accepted"] / r["rounds"], 3)
            r["alpha"] = round(r["accepted"] / r["judged"], 3) if r["judged"] else None
            r["draft_ms_per_round"] = round(r["draft_ms"] / r["rounds"], 2)
            r["nodes_per_round"] = round(r["nodes"] / r["rounds"], 2)
    return rows


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# Token trees vs chains (embedded SmolLM2-135M, greedy, CPU)\n",
             f"Command: `{m['command']}`  ",
             (machine_line(m["machine_meta"]) + "  ") if "machine_meta" in m else "",
             f"Machine: {m['machine']}, torch threads {m['threads']}; load average at start {m['load_start']}, "
             f"at end {m['load_end']}" + (" (above 2: other jobs ran at the same time, so the timings are noisy; "
                                          "the counts — accepted, tokens per pass, identical — are not)"
                                          if max(float(m['load_start']), float(m['load_end'])) > 2 else "") + ".  ",
             f"Prompts: {m['n_prompts']} ({', '.join(m['prompt_labels'])}), up to {m['max_new_tokens']} new tokens "
             f"each, {m.get('reps', 1)} time(s) over; methods one after another per prompt.\n",
             "| method | accepted per round | tokens per pass | α̂ (per depth) | nodes per round | draft ms per round | "
             "tokens/s | speedup vs plain | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["rows"].items():
        if name == "plain":
            lines.append(f"| plain | — | {r['tokens_per_pass']:.2f} | — | — | — | {r['tokens_per_s']:.1f} | 1.00× | — |")
        else:
            a = "—" if r["alpha"] is None else f"{r['alpha']:.3f}"
            lines.append(f"| {name} | {r['accepted_per_round']:.2f} | {r['tokens_per_pass']:.2f} | {a} | "
                         f"{r['nodes_per_round']:.1f} | {r['draft_ms_per_round']:.1f} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup']:.2f}× | {'yes' if r['identical'] else 'NO'} |")
    v = res["verify"]
    lines += ["", f"Verify pass ms by tokens fed (context {v['context']} cached, medians of {v['reps']}, chain = "
              "causal pass, tree = the same tokens, each node seeing its context and ancestors: `tree.tree_verify_pass`):\n",
              "| tokens fed | draft nodes | chain ms | tree ms | tree ÷ (pass over 2 tokens: chain γ=1) |",
              "|---|---|---|---|---|"]
    for r in v["rows"]:
        lines.append(f"| {r['tokens_fed']} | {r['nodes']} | {r['chain_ms']:.1f} | {r['tree_ms']:.1f} | "
                     f"{r['tree_ratio_to_one_draft_token']:.2f} |")
    lines += ["", "## Reading", "", res.get("reading", "(see the report)"), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6, help="held-out chat prompts (plus the 3 Live presets)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--quick", action="store_true", help="fewer variants (for a smoke test)")
    ap.add_argument("--variants", default="", help="only these methods, by name, comma-separated "
                    "(e.g. 'head chain γ=2,head tree N=3 d=2 k=2'); plain always runs")
    ap.add_argument("--reps", type=int, default=1, help="run the prompts this many times (every method per prompt "
                    "each time, so a slow phase of the machine hits all methods); totals over all reps")
    ap.add_argument("--reading", default="", help="the conclusion to write into the markdown")
    ap.add_argument("--out", default=str(OUT), help="result path without suffix (.json and .md are written)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model("embedded", device="cpu")
    prompts = [(f"held-out {p['category']}", p["prompt"]) for p in build_prompts(args.prompts, "heldout", seed=0)]
    prompts += [(f"preset {k}", p.text) for k, p in PROMPT_PRESETS.items()]
    variants = VARIANTS[::3] if args.quick else VARIANTS
    if args.variants:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [n for n in names if n not in {v[0] for v in VARIANTS}]
        if unknown:
            ap.error(f"unknown variant(s) {unknown}; known: {[v[0] for v in VARIANTS]}")
        variants = [v for v in VARIANTS if v[0] in names]
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    load_start = round(os.getloadavg()[0], 1)
    # warm-up (first calls allocate)
    generate(target, make_proposer("embedded-head", target), encode_prompt(target.tokenizer, "Hi"), gamma=3,
             max_new_tokens=8, tree=8)
    verify = verify_costs(target)
    rows = run(target, prompts * args.reps, args.max_new_tokens, variants)
    res = {"meta": {"command": " ".join(["OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "?"),
                                         ".venv/bin/python"] + sys.argv),
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "threads": args.threads,
                    "load_start": load_start, "load_end": round(os.getloadavg()[0], 1),
                    "n_prompts": len(prompts), "prompt_labels": [p[0] for p in prompts], "reps": args.reps,
                    "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
                    "machine_meta": machine_meta(target)},
           "rows": rows, "verify": verify, "reading": args.reading}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
