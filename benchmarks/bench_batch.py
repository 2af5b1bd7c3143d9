"""The batch sweep on the embedded model: total generated tokens/s of plain and speculative batched decoding
against batch size, the target pass time against tokens in the pass, and the measured crossover batch.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_batch.py --batches 1,2,4,8,16,32 --reps 2

Writes benchmarks/results/batch.json and batch.md (``--out NAME`` for others; the shipped results name their machine,
``batch_amd-epyc``, ``batch_xeon``). Every cell is
``engine.decoding.batch.batch_sweep``: for each batch B the first B of its 32 prompts are decoded together
(greedy, one target pass per round); below B = ``--min-prompts`` (default 8) a run decodes the first 8 prompts
in groups of B one after another, so B = 1 is not one prompt's luck; the methods alternate between repetitions (A B C, C B A), and the
medians are compared. The machine's bandwidth and FLOP/s (``measure_machine``) are measured before and
after, so the roofline model of this machine can be drawn next to the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.machine import machine_line, machine_meta  # noqa: E402
from engine.decoding.batch import SWEEP_PROMPTS, batch_sweep, measure_machine, parse_batches  # noqa: E402
from engine.decoding.models import load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--methods", default="plain,ngram,embedded-head")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--min-prompts", type=int, default=8,
                    help="prompts each cell covers at least (groups of B one after another below B = this)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="batch")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every row generates exactly --max-new-tokens (EOS ignored, as vLLM's ignore_eos): the "
                         "batch keeps its size to the end")
    args = ap.parse_args()
    batches = parse_batches(args.batches)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    target = load_model("embedded", device=args.device)
    load_before = os.getloadavg()
    peaks_before = measure_machine(args.device)
    t0 = time.perf_counter()

    def progress(done, total, label, _sweep):
        print(f"[{done}/{total}] {label}  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    sweep = batch_sweep(target, SWEEP_PROMPTS, batches=batches, methods=methods, max_new_tokens=args.max_new_tokens,
                        reps=args.reps, on_progress=progress, stop_on_eos=not args.ignore_eos,
                        min_prompts=args.min_prompts)
    peaks_after = measure_machine(args.device)
    load_after = os.getloadavg()
    peaks = {"bandwidth_gbs": statistics.median([peaks_before.bandwidth_gbs, peaks_after.bandwidth_gbs]),
             "peak_tflops": statistics.median([peaks_before.peak_tflops, peaks_after.peak_tflops]),
             "before": peaks_before.__dict__, "after": peaks_after.__dict__}
    cmd = "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "(unset)") + " .venv/bin/python " + " ".join(
        [str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute() else sys.argv[0], *sys.argv[1:]])
    out = {"command": cmd, "sweep": sweep.to_dict(), "machine": peaks, "machine_meta": machine_meta(target), "torch_threads": torch.get_num_threads(),
           "load_average_before": load_before, "load_average_after": load_after,
           "spread": {f"{c.method}@{c.batch}": (max(c.runs_tokens_per_s) / min(c.runs_tokens_per_s)
                                                 if min(c.runs_tokens_per_s) > 0 else None) for c in sweep.cells}}
    res = ROOT / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / f"{args.out}.json").write_text(json.dumps(out, indent=1) + "\n")
    spreads = [v for v in out["spread"].values() if v]
    lines = [
        "# Batch sweep: plain vs speculative batched decoding (embedded SmolLM2-135M, fp32, greedy)", "",
        f"Command: `{cmd}`  ",
        machine_line(out["machine_meta"]) + "  ",
        f"{sweep.max_new_tokens} new tokens per row ({'EOS ignored: every row generates them all' if args.ignore_eos else 'rows stop at EOS too'}), "
        + (f"below B = {sweep.min_prompts} a run decodes the first {sweep.min_prompts} prompts in groups of B, "
           if sweep.min_prompts > 1 else "") + f"{sweep.reps} alternating runs per cell "
        f"(median), torch threads {sweep.threads}, {sweep.elapsed_s:.0f} s in all. Load average before/after: "
        f"{load_before[0]:.1f} / {load_after[0]:.1f} on 2 cores (" + (
            "above 2: other jobs ran meanwhile, the timings are noisy; " if max(load_before[0], load_after[0]) > 2
            else "") + (f"a cell's slowest ÷ fastest run: up to {max(spreads):.2f}×)." if sweep.reps > 1 and spreads
                         else "one run per cell, so no spread was measured)."), "",
        f"Measured machine: {peaks['bandwidth_gbs']:.1f} GB/s copy bandwidth, {peaks['peak_tflops'] * 1000:.1f} "
        f"GFLOP/s fp32 matmul (median of before and after).", "",
        "Total generated tokens/s (all rows) and each speculative method's ratio to plain decoding; pass tokens = "
        "the median tokens per target pass, B·(γ + 1) while every row drafts γ (padding included):", "",
        sweep.markdown(), "",
        "## Target pass time against tokens in the pass (all methods)", "",
        "| tokens in the pass | median ms | passes |", "|---|---|---|",
        *[f"| {n} | {ms:.1f} | {k} |" for n, ms, k in sweep.pass_curve()], "",
        "The draft head's steps run batched: one head call per draft step for all rows that share the head (`FeatureHeadProposer.propose_many`); that call still grows with B.",
    ]
    (res / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
