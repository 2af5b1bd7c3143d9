"""KV-cache page costs and this machine's measured figures.

1. engine: ``kv_report`` (everything one rerun of the KV-cache page computes) for each preset, median ms.
2. ``measure_this_machine``: its wall time (goal < 2 s) and the bandwidth / matmul figures it reports.
3. ``real_kv_check`` on the embedded model: wall time and whether the real cache equals the calculator.

Usage: .venv/bin/python benchmarks/bench_kv_size.py
Writes benchmarks/results/kv_size.json and .md.
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

from engine.decoding.models import load_model  # noqa: E402
from engine.explain.kv_size import MODEL_PRESETS, kv_report, measure_this_machine, real_kv_check  # noqa: E402

OUT = ROOT / "benchmarks" / "results"


def main() -> None:
    res: dict = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                             "load_avg_1min": os.getloadavg()[0]}}
    rows = {}
    for name, spec in MODEL_PRESETS.items():
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            kv_report(spec, 8192, 8, gpu="H100 SXM")
            times.append((time.perf_counter() - t0) * 1e3)
        rows[name] = round(statistics.median(times), 3)
    res["kv_report_median_ms"] = rows

    t0 = time.perf_counter()
    hw = measure_this_machine()
    res["measure_this_machine"] = {"wall_s": round(time.perf_counter() - t0, 3), "name": hw.name,
                                   "bandwidth_GB_s": round(hw.bandwidth / 1e9, 2),
                                   "matmul_GFLOP_s": round(hw.peak_flops / 1e9, 2),
                                   "memory_GiB": round(hw.memory_bytes / 2**30, 2), "how": hw.source}

    lm = load_model("embedded", device="cpu")
    checks = []
    for n in (64, 512):
        t0 = time.perf_counter()
        chk = real_kv_check(lm, n, 4)
        checks.append({"tokens": n, "wall_s": round(time.perf_counter() - t0, 3),
                       "measured_bytes": chk.measured_bytes, "calculator_bytes": chk.predicted_bytes,
                       "agree": chk.agrees})
    res["real_kv_check"] = checks

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "kv_size.json").write_text(json.dumps(res, indent=2))
    m = res["measure_this_machine"]
    lines = ["# KV-cache page benchmark", "",
             f"Machine: {res['machine']['platform']}, {res['machine']['cpus']} CPUs, "
             f"1-min load {res['machine']['load_avg_1min']:.1f} (shared with other jobs).", "",
             "| preset | kv_report median ms |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows.items()]
    lines += ["", f"measure_this_machine: {m['wall_s']} s; bandwidth {m['bandwidth_GB_s']} GB/s, "
              f"matmul {m['matmul_GFLOP_s']} GFLOP/s, memory {m['memory_GiB']} GiB ({m['how']}).", "",
              "| real check tokens | wall s | real cache bytes | calculator bytes | agree |", "|---|---|---|---|---|"]
    lines += [f"| {c['tokens']} | {c['wall_s']} | {c['measured_bytes']} | {int(c['calculator_bytes'])} | "
              f"{c['agree']} |" for c in checks]
    (OUT / "kv_size.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
