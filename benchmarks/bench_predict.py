"""Predicted vs measured speedup, per draft kind and prompt: the Live → What-if path, end to end.

For each draft kind and prompt preset (engine/explain/presets.py), exactly what the Live page's Run
baseline and What-if's "My measured numbers" do: greedy, ``--max-new-tokens`` (96) new tokens, an untimed
run first (the Live page's own run; it gives the baseline's token count), then
``engine.decoding.measure.measure_speedup_ab`` with ``--reps`` (3) runs of each kind, alternating A B B A A B,
then ``measured_run`` (with the median run's rounds) → ``compare_with_measured`` (today's constant-γ,
constant-α prediction) and ``predict_from_run`` (the steps: the run's draft lengths, α̂ by position, prefill
and bookkeeping). Reports each step's prediction, the measured speedup and the error, plus what tells how
noisy the machine was (slowest ÷ fastest run of a kind) and an accounting check (tokens per round the run
got against E from α̂ by position).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_predict.py [--kinds embedded-head,ngram,...]
        [--prompts chat,code] [--reps 3] [--max-new-tokens 96] [--threads 2] [--out predict] [--append]

Writes benchmarks/results/<out>.json and <out>.md (default predict).
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
from engine.decoding.measure import measure_speedup_ab, measured_run  # noqa: E402
from engine.decoding.models import EMBEDDED_DRAFT, load_model  # noqa: E402
from engine.decoding.drafts import make_proposer  # noqa: E402
from engine.decoding.sampling import SamplingConfig  # noqa: E402
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt  # noqa: E402
from engine.explain.analytic import compare_with_measured, predict_from_run  # noqa: E402
from engine.explain.presets import PROMPT_PRESETS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
# γ per kind: the Live page's defaults (engine.decoding.models.default_gamma: 2 for the head, else 4),
# except prompt lookup at 8, a long reach for code edits (its adaptive length rarely reaches 8)
GAMMAS = {"embedded-head": 2, "embedded-draft": 4, "ngram": 8}
DEFAULT_KINDS = "embedded-head,embedded-draft,ngram,early-exit:8"


def run_one(target, draft_lm, kind: str, preset: str, gamma: int, reps: int, max_new: int) -> dict:
    ids = encode_prompt(target.tokenizer, PROMPT_PRESETS[preset].text)
    greedy = SamplingConfig()

    def proposer():
        return make_proposer(kind, target, draft_lm if kind == EMBEDDED_DRAFT else None)

    def make_spec():
        return SpeculativeDecoder(target, proposer(), ids, gamma=gamma, sampling=greedy, seed=0,
                                  max_new_tokens=max_new)

    live = make_spec()  # the Live page's own run: the baseline generates as many tokens
    live.run()
    n_new = max(len(live.new_ids), 1)

    def make_base():
        return SpeculativeDecoder(target, None, ids, gamma=gamma, sampling=greedy, seed=0, max_new_tokens=n_new)

    t0 = time.perf_counter()
    ab = measure_speedup_ab(make_spec, make_base, reps=reps)
    wall = time.perf_counter() - t0
    rec = measured_run(ab.spec_stats, gamma, ab.speedup, ab.base_stats, rounds=ab.spec_rounds)
    mc = compare_with_measured(rec)
    pred = predict_from_run(rec)
    st = ab.spec_stats
    emitted = sum(len(r.emitted_ids) for r in ab.spec_rounds)
    return {
        "kind": kind, "prompt": preset, "gamma": gamma, "prompt_tokens": len(ids), "new_tokens": st.new_tokens,
        "identical": ab.spec_ids == ab.base_ids, "alpha": mc.alpha, "c": mc.c,
        "alpha_by_position": rec.acceptance_by_position, "draft_length_counts": rec.draft_length_counts,
        "verify_tokens_counts": rec.verify_tokens_counts, "verify_ms_by_tokens": rec.verify_ms_by_tokens,
        "prefill_ms": rec.prefill_ms, "base_prefill_ms": rec.base_prefill_ms, "draft_prefill_ms": rec.draft_prefill_ms,
        "overhead_ms_per_round": rec.overhead_ms_per_round, "base_overhead_ms_per_round": rec.base_overhead_ms_per_round,
        "t1_ms": None if pred is None else pred.t1_ms,
        "tokens_per_round_actual": emitted / len(ab.spec_rounds),
        "predicted_constant": mc.predicted_curve,
        "steps": [] if pred is None else [vars(s) for s in pred.steps],
        "predicted_from_run": None if pred is None else pred.steps[-1].speedup,
        "measured": ab.speedup,
        "error_constant": None if mc.predicted_curve is None else mc.predicted_curve / ab.speedup - 1,
        "error_from_run": None if pred is None else pred.steps[-1].speedup / ab.speedup - 1,
        "summary": None if pred is None else pred.summary,
        "spec_ms_per_token": ab.spec_ms_per_token, "base_ms_per_token": ab.base_ms_per_token,
        "spread": ab.spread, "wall_s": wall,
    }


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1%}"


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def markdown(res: dict) -> str:
    lines = ["# Predicted vs measured speedup (Live → What-if)", "",
             f"Command: `{res['command']}`", "",
             *([machine_line(res["machine_meta"]), ""] if "machine_meta" in res else []),
             f"Machine: {res['machine']}; torch threads {res['threads']}; load average at start "
             f"{res['load_start']}, at end {res['load_end']}. Greedy, {res['max_new_tokens']} new tokens, "
             f"{res['reps']} runs of each kind (A B B A A B), medians; prefill included on both sides.", "",
             "| draft | prompt | γ | α̂ | c | predicted, constant γ/α | lengths | + α̂ by position | "
             "from the run (+ prefill, bookkeeping) | measured | error constant | error from run | spread |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        st = {s["key"]: s["speedup"] for s in r["steps"]}
        lines.append(f"| {r['kind']} | {r['prompt']} | {r['gamma']} | {r['alpha']:.3f} | {r['c']:.3f} | "
                     f"{_x(r['predicted_constant'])} | {_x(st.get('lengths'))} | {_x(st.get('positions'))} | "
                     f"{_x(r['predicted_from_run'])} | {_x(r['measured'])} | {_pct(r['error_constant'])} | "
                     f"**{_pct(r['error_from_run'])}** | {r['spread']:.2f} |")
    lines += ["", "Spread: slowest ÷ fastest run of one kind (ms per token); 1.00 is a quiet machine, above "
              "1.5 the Live page warns that the speedup is unsure.", "", "## Per run", ""]
    for r in res["rows"]:
        lines += [f"**{r['kind']}, {r['prompt']}** (γ {r['gamma']}, prompt {r['prompt_tokens']} tokens, "
                  f"{r['new_tokens']} new, identical to plain: {r['identical']}): draft lengths "
                  f"{r['draft_length_counts']}, tokens fed {r['verify_tokens_counts']}, α̂ by position "
                  f"{[round(a, 2) for a in r['alpha_by_position']]}; tokens per round: run "
                  f"{r['tokens_per_round_actual']:.3f}, E by position "
                  f"{next((s['tokens_per_round'] for s in r['steps'] if s['key'] == 'positions'), float('nan')):.3f}; "
                  f"t(1) {r['t1_ms'] or float('nan'):.1f} ms, verify curve "
                  f"{ {k: round(v, 1) for k, v in r['verify_ms_by_tokens'].items()} } ms; prefill {r['prefill_ms']:.0f} "
                  f"ms (draft's {r['draft_prefill_ms']:.0f}), baseline prefill {r['base_prefill_ms'] or 0:.0f} ms; "
                  f"bookkeeping {r['overhead_ms_per_round']:.2f} ms/round (baseline "
                  f"{r['base_overhead_ms_per_round'] or 0:.2f}); ms/token spec "
                  f"{[round(x, 1) for x in r['spec_ms_per_token']]}, base "
                  f"{[round(x, 1) for x in r['base_ms_per_token']]}.", "", f"> {r['summary']}", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=DEFAULT_KINDS)
    ap.add_argument("--prompts", default="chat,code")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--gamma", type=int, default=None, help="one γ for every kind (default: per kind)")
    ap.add_argument("--out", default="predict")
    ap.add_argument("--append", action="store_true", help="keep the rows already in <out>.json (a run in parts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model("embedded", device="cpu")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    draft_lm = load_model(EMBEDDED_DRAFT, device="cpu") if EMBEDDED_DRAFT in kinds else None
    res = {"command": "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "?") + " .venv/bin/python "
           + " ".join(["benchmarks/bench_predict.py", *sys.argv[1:]]),
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "threads": args.threads, "reps": args.reps, "max_new_tokens": args.max_new_tokens,
           "load_start": round(os.getloadavg()[0], 1), "rows": [], "machine_meta": machine_meta(target)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.append and (RESULTS / f"{args.out}.json").exists():
        old = json.loads((RESULTS / f"{args.out}.json").read_text())
        res["rows"] = old["rows"]
        res["command"] = old["command"] + " ; then " + res["command"]
        res["load_start"] = f"{old['load_start']} (first part), {res['load_start']}"
    for kind in kinds:
        for preset in [p.strip() for p in args.prompts.split(",") if p.strip()]:
            gamma = args.gamma or GAMMAS.get(kind, 4)
            row = run_one(target, draft_lm, kind, preset, gamma, args.reps, args.max_new_tokens)
            res["rows"].append(row)
            print(f"{kind:15s} {preset:8s} γ {gamma}: constant {_x(row['predicted_constant'])}, from the run "
                  f"{_x(row['predicted_from_run'])}, measured {_x(row['measured'])} "
                  f"({_pct(row['error_from_run'])}; constant {_pct(row['error_constant'])}), spread "
                  f"{row['spread']:.2f}, {row['wall_s']:.0f} s", flush=True)
            res["load_end"] = round(os.getloadavg()[0], 1)
            (RESULTS / f"{args.out}.json").write_text(json.dumps(res, indent=1, default=str))
            (RESULTS / f"{args.out}.md").write_text(markdown(res))


if __name__ == "__main__":
    main()
