"""Rerun time of the what-if page after moving a slider (goal: < 100 ms).

Two measurements:
1. engine: the calls one rerun makes (analytic_view, simulate_rounds at 100 rounds, try_it_exercises,
   batch_speedup_curve); the cached toy run is excluded (st.cache_data: it only reruns when a toy
   widget changes, timed separately below).
2. page: AppTest full reruns of pages/whatif.py after setting the α slider (includes Streamlit's script
   run and building/serialising every plotly figure; excludes the browser's drawing).

Usage: .venv/bin/python benchmarks/bench_whatif_rerun.py
Writes benchmarks/results/whatif_rerun.json and .md.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.explain.analytic import analytic_view, batch_speedup_curve, simulate_rounds, try_it_exercises  # noqa: E402
from engine.explain.toy import run_toy_rounds  # noqa: E402

OUT = ROOT / "benchmarks" / "results"


def _median_ms(fn, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), max(times)


def engine_rerun(alpha: float) -> None:
    analytic_view(alpha, 4, 0.05, 0.05)
    sim = simulate_rounds(alpha, 4, 100, 0)
    try_it_exercises(sim.mean, sim.n)
    batch_speedup_curve(alpha, 4, 0.05, 7.0, 2.0, 3350.0, 989.0, 1024)


def main() -> None:
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                     "load_avg_1min": os.getloadavg()[0]}
    alphas = iter([0.5 + 0.01 * i for i in range(1000)])
    med, worst = _median_ms(lambda: engine_rerun(next(alphas)), 50)
    results["engine_rerun_ms"] = {"median": round(med, 2), "max": round(worst, 2), "repeats": 50}

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "pages" / "whatif.py"), default_timeout=120)
    at.query_params["wi_steps"] = "100"
    at.run()                                       # first run: fills the toy cache (10 000 rounds)
    assert not at.exception, at.exception
    values = iter([0.5 + 0.01 * i for i in range(100)])

    def move_slider() -> None:
        at.slider(key="wi_alpha").set_value(round(next(values), 2)).run()
        assert not at.exception

    med, worst = _median_ms(move_slider, 20)
    results["apptest_rerun_ms"] = {"median": round(med, 1), "max": round(worst, 1), "repeats": 20}

    # baseline: AppTest rerun of a trivial page with one slider (the harness's own overhead)
    base = AppTest.from_string("import streamlit as st\nst.slider('x', 0.0, 1.0, key='x')\nst.write(st.session_state.x)\n",
                               default_timeout=60).run()
    bvals = iter([0.01 * i for i in range(100)])
    med, worst = _median_ms(lambda: base.slider(key="x").set_value(round(next(bvals), 2)).run(), 20)
    results["apptest_trivial_page_rerun_ms"] = {"median": round(med, 1), "max": round(worst, 1), "repeats": 20}

    # the toy check when a toy widget changes (not cached): 2 000 and 10 000 rounds
    for n in (2000, 10000):
        med, worst = _median_ms(lambda: run_toy_rounds(n), 3)
        results[f"toy_run_{n}_ms"] = {"median": round(med, 1), "max": round(worst, 1), "repeats": 3}
    results["goal_ms"] = 100
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "whatif_rerun.json").write_text(json.dumps(results, indent=2))
    md = ["# What-if page rerun time", "", f"Machine: {results['machine']}, 1-min load average "
          f"{results['load_avg_1min']:.2f} (other jobs share the CPU).", "",
          "| measurement | median ms | max ms |", "|---|---|---|"]
    for k, v in results.items():
        if isinstance(v, dict):
            md.append(f"| {k} | {v['median']} | {v['max']} |")
    md += ["", "Goal: < 100 ms for a rerun after moving a slider (engine + script run)."]
    (OUT / "whatif_rerun.md").write_text("\n".join(md) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
