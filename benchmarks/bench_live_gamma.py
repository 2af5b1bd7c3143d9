"""Live's Run baseline for the shipped draft head at several γ: which γ this machine's first run should use.

Runs what the Live page's Run baseline runs, without a browser: the embedded target's room
(``engine.decoding.scheduler.room_for``), the chat preset, greedy, seed 0, 64 new tokens, and
``engine.decoding.measure.measure_speedup_ab`` with 3 speculative and 3 plain runs alternating (A B B A A B),
the speedup being the ratio of their median ms per token. Each γ in ``--gammas`` is measured ``--repeats`` times, in
a shuffled order per repeat (a busy moment hits no single γ), after one warm-up run. Beside each: the γ that
``engine.explain.analytic.default_gamma_here`` chooses from this machine's stored pass-cost curve.

    .venv/bin/python benchmarks/bench_live_gamma.py [--gammas 1,2,3,4] [--repeats 2] [--out PATH]

Writes benchmarks/results/live_gamma.json and .md (``--out`` for others; shipped results name their machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import machine_line, machine_meta  # noqa: E402
from engine.decoding.drafts import make_proposer  # noqa: E402
from engine.decoding.measure import measure_speedup_ab  # noqa: E402
from engine.decoding.models import EMBEDDED_HEAD, load_model  # noqa: E402
from engine.decoding.sampling import SamplingConfig  # noqa: E402
from engine.decoding.scheduler import room_for  # noqa: E402
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt  # noqa: E402
from engine.explain.analytic import default_gamma_here  # noqa: E402
from engine.explain.presets import preset_text  # noqa: E402

PRESET, MAX_NEW, REPS = "chat", 64, 3  # Live's defaults for the head (app.live_view.default_preset, lv_max_new)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gammas", default="1,2,3,4")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="order of the γ within each repeat")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "live_gamma"))
    args = ap.parse_args(argv)
    gammas = [int(g) for g in args.gammas.split(",")]
    target = load_model("embedded")
    room = room_for(target)
    meta = machine_meta(target)
    ids = encode_prompt(target.tokenizer, preset_text(PRESET))

    def decoder(gamma: int, base: bool = False):
        prop = None if base else make_proposer(EMBEDDED_HEAD, target, length="fixed")
        return room.bind(SpeculativeDecoder(target, prop, ids, gamma=gamma, sampling=SamplingConfig(), seed=0,
                                            max_new_tokens=MAX_NEW))

    decoder(gammas[0]).run()  # warm-up
    rng = random.Random(args.seed)
    rows = []
    for rep in range(args.repeats):
        order = gammas[:]
        rng.shuffle(order)
        for g in order:
            ab = measure_speedup_ab(lambda: decoder(g), lambda: decoder(g, True), reps=REPS)
            st = ab.spec_stats
            sp = statistics.median(ab.base_ms_per_token) / statistics.median(ab.spec_ms_per_token)
            rows.append({"gamma": g, "repeat": rep, "speedup": round(sp, 3),
                         "alpha": None if st.acceptance_rate is None else round(st.acceptance_rate, 3),
                         "tokens_per_pass": round(st.tokens_per_target_pass, 3),
                         "c": None if st.draft_cost_ratio is None else round(st.draft_cost_ratio, 3),
                         "spec_ms_per_token": [round(x, 2) for x in ab.spec_ms_per_token],
                         "base_ms_per_token": [round(x, 2) for x in ab.base_ms_per_token]})
            print(json.dumps(rows[-1]), flush=True)
    chosen, why = default_gamma_here(EMBEDDED_HEAD)
    meta["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    out = {"meta": {**meta, "date": time.strftime("%Y-%m-%d %H:%M"), "preset": PRESET, "max_new_tokens": MAX_NEW,
                    "ab_reps": REPS, "command": "benchmarks/bench_live_gamma.py " + " ".join(argv or sys.argv[1:])},
           "default_gamma": chosen, "default_gamma_why": why, "rows": rows}
    path = Path(args.out)
    path.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# Live's Run baseline, draft head by γ ({out['meta']['date']})", "",
             f"`{out['meta']['command']}`: the embedded target's room, chat preset, greedy, {MAX_NEW} new tokens, "
             f"{REPS} + {REPS} alternating runs per measurement (median ms per token).", "", machine_line(meta), "",
             f"Default γ chosen here from the stored pass-cost curve: **{chosen}** ({why}).", "",
             "| γ | speedups (each repeat) | median | α̂ | tokens per pass | c |", "|---:|---|---:|---:|---:|---:|"]
    for g in gammas:
        rs = [r for r in rows if r["gamma"] == g]
        lines.append(f"| {g} | {', '.join('%.2f×' % r['speedup'] for r in rs)} | "
                     f"{statistics.median(r['speedup'] for r in rs):.2f}× | {rs[0]['alpha']} | "
                     f"{rs[0]['tokens_per_pass']:.2f} | {rs[0]['c']} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
