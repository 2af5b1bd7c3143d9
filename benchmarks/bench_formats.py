"""What the bytes of the weights cost: the embedded model with its layers read as their GGUF blocks (Q4_1, exactly
the fp32 values: ``engine.decoding.compute.formats.compact_weight``) against every weight read as fp32, the same
streaming kernel, the same outputs.

Each format runs in its own process (``SPEEDUP_LAB_WEIGHTS=blocks`` / ``fp32``), in alternating order (A B B A …,
``--reps`` pairs). Per run: the bytes a decode step reads (``compute.weight_formats``); target passes over k = 1,
2, 3, 4, 8 new tokens after 100 cached tokens, timed as the engine times its pass-cost curve
(``engine.decoding.pass_cost.measure_pass_cost``: sizes interleaved, fastest of 9 reps, non-decreasing), and
t(k)/t(1); across runs the median; plain greedy decoding and the shipped
draft head at this machine's default γ, 64 new tokens on 3 prompts no draft was trained on (median tokens/s); and
whether both formats gave the same tokens. Every plain token is checked equal across formats (the same bits).

Usage (an idle machine): ``flock -x /tmp/speedup-cpu.lock .venv/bin/python benchmarks/bench_formats.py --reps 2``
writes benchmarks/results/formats_<cpu>.json and .md (``--out NAME`` for another name).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = ("Explain why the sky is blue to a ten-year-old.", "Write three tips for a good night's sleep.",
           "What is the difference between a list and a tuple in Python?")
PASS_TOKENS = (1, 2, 3, 4, 8)


def one_run(max_new: int) -> dict:
    """This process's format: bytes, pass times, plain and head tokens/s, the tokens."""
    from engine.decoding import compute
    from engine.decoding.drafts import make_proposer
    from engine.decoding.models import EMBEDDED_HEAD, load_model
    from engine.decoding.pass_cost import measure_pass_cost
    from engine.decoding.speculative import SpeculativeDecoder, encode_prompt
    from engine.explain.analytic import default_gamma_here

    t = load_model("embedded")
    fmt = compute.weight_formats(t.model)
    gamma = default_gamma_here(EMBEDDED_HEAD)[0]
    # the engine's own curve measurement (sizes interleaved rep by rep, the fastest rep of each size, made
    # non-decreasing: engine.decoding.pass_cost), so the page draws the curve the engine prices rounds with
    curve = measure_pass_cost(t, sizes=PASS_TOKENS, reps=9)
    pass_ms = {k: curve.ms[k] for k in PASS_TOKENS}
    out = {"weights": compute.weight_format(), "bytes": fmt, "label": t.compute.formats_label(), "gamma": gamma,
           "pass_ms": pass_ms, "tokens": {}}
    rates = {"plain": [], "head": []}
    head = make_proposer(EMBEDDED_HEAD, t)
    for i, p in enumerate(PROMPTS):  # plain and the head alternate prompt by prompt, so a slow moment hits both
        for kind in (("plain", "head") if i % 2 == 0 else ("head", "plain")):
            d = SpeculativeDecoder(t, None if kind == "plain" else head, encode_prompt(t.tokenizer, p), gamma=gamma,
                                   max_new_tokens=max_new)
            d.prefill()
            t0 = time.perf_counter()
            r = d.run()
            rates[kind].append(len(r.token_ids) / (time.perf_counter() - t0))
            out["tokens"].setdefault(kind, []).append(r.token_ids)
    for kind, v in rates.items():
        out[f"{kind}_tokens_per_s"] = statistics.median(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="pairs of runs (default 2)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", default=None, help="results name (default formats_<cpu>)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one run of this process's format
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args.max_new)))
        return
    from benchmarks.machine import machine_meta, machine_slug
    from engine.decoding import compute

    order = [("blocks", "fp32", "fp32", "blocks")[i % 4] for i in range(2 * args.reps)]
    runs = []
    for fmt in order:
        env = {**os.environ, compute.WEIGHT_FORMAT_ENV: fmt}
        res = subprocess.run([sys.executable, __file__, "--one", "--max-new", str(args.max_new)], env=env,
                             capture_output=True, text=True, check=True, cwd=ROOT)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        runs.append(r)
        print(f"{fmt:6s} {r['bytes']['read_bytes'] / 1e6:.0f} MB/token, plain {r['plain_tokens_per_s']:.1f} tok/s, "
              f"head {r['head_tokens_per_s']:.1f}, t(3)/t(1) {r['pass_ms']['3'] / r['pass_ms']['1']:.2f}", flush=True)
    same = all(r["tokens"]["plain"] == runs[0]["tokens"]["plain"] for r in runs)
    summary = {}
    for fmt in ("blocks", "fp32"):
        mine = [r for r in runs if r["weights"] == fmt]
        summary[fmt] = {"read_mb": mine[0]["bytes"]["read_bytes"] / 1e6, "label": mine[0]["label"],
                        "gamma": mine[0]["gamma"],
                        "plain_tokens_per_s": statistics.median(r["plain_tokens_per_s"] for r in mine),
                        "head_tokens_per_s": statistics.median(r["head_tokens_per_s"] for r in mine),
                        "pass_ms": {k: statistics.median(r["pass_ms"][str(k)] for r in mine) for k in PASS_TOKENS}}
    meta = {**machine_meta(), "date": time.strftime("%Y-%m-%d %H:%M"), "reps": args.reps, "max_new": args.max_new,
            "plain_tokens_identical": same}
    name = args.out or f"formats_{machine_slug()}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": [
        {k: v for k, v in r.items() if k != "tokens"} for r in runs]}, indent=2))
    b, f = summary["blocks"], summary["fp32"]
    md = [f"# Weight formats: the embedded model's GGUF blocks against fp32 ({meta.get('cpu', '')}, {meta['date']})", "",
          f"`benchmarks/bench_formats.py --reps {args.reps} --max-new {args.max_new}`: each format in its own process "
          f"(`SPEEDUP_LAB_WEIGHTS`), alternating; medians. Plain greedy tokens identical across formats: "
          f"{'yes' if same else 'NO'}.", "",
          "| weights | MB read a token | plain tok/s | draft head tok/s (γ) | head ÷ plain | "
          + " | ".join(f"t({k})/t(1)" for k in PASS_TOKENS[1:]) + " | t(1) ms |",
          "|---|---|---|---|---|" + "---|" * (len(PASS_TOKENS) - 1) + "---|"]
    for label, x in (("GGUF blocks (Q4_1 layers, Q8_0 head), exact", b), ("fp32", f)):
        pm = x["pass_ms"]
        md.append(f"| {label} | {x['read_mb']:.0f} | {x['plain_tokens_per_s']:.1f} | {x['head_tokens_per_s']:.1f} "
                  f"({x['gamma']}) | {x['head_tokens_per_s'] / x['plain_tokens_per_s']:.2f} | "
                  + " | ".join(f"{pm[k] / pm[1]:.2f}" for k in PASS_TOKENS[1:]) + f" | {pm[1]:.1f} |")
    md += ["", f"Blocks ÷ fp32: plain {b['plain_tokens_per_s'] / f['plain_tokens_per_s']:.2f}×, draft head "
           f"{b['head_tokens_per_s'] / f['head_tokens_per_s']:.2f}×. Fewer bytes make a 1-token pass cheaper, so a "
           "pass over several tokens costs relatively more (the kernel's work per weight, rebuilding it from its "
           "block, is shared by the rows): speculation's share of the gain shrinks as the weights get cheaper."]
    (RESULTS / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
