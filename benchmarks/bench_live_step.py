"""Live page: time from clicking "Step one round" to the round being drawn, and the app's memory.

Starts ``streamlit run app/main.py`` headless, opens /live on the embedded model with prompt lookup
(code-edit preset, γ = 4, greedy), clicks Step N times in headless Chromium and measures per click:
- ``to_round_ms``: click → the round's summary line ("Round i: …") is on the page (the step is done and
  its animation starts; the verdict frame follows within ANIM_BUDGET_S = 0.4 s);
- ``to_page_ms``: click → the whole page is redrawn (the round inspector "Round i in detail" is shown);
- ``engine_ms``: the round's draft + verify time reported by the engine.
Also records the Streamlit process's resident memory (RSS) with the model loaded, the load average
(other jobs on a shared machine inflate every time) and torch's thread count.

Usage: ``.venv/bin/python benchmarks/bench_live_step.py [--clicks 6]``; writes
benchmarks/results/live_step.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.conftest import _free_port, wait_idle  # noqa: E402  (the browser tests' own helpers)

RESULTS = ROOT / "benchmarks" / "results"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
QUERY = "lv_draft=ngram&lv_preset=code&lv_gamma=4&lv_temp=0&lv_max_new=64&lv_seed=0&lv_speed=fast"


def _rss_mb(pid: int) -> float:
    import psutil

    p = psutil.Process(pid)
    return sum(x.memory_info().rss for x in [p, *p.children(recursive=True)]) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clicks", type=int, default=6)
    args = ap.parse_args()
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "app" / "main.py"), "--server.headless", "true",
         "--server.port", str(port), "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(180):
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                time.sleep(0.5)
        rss_idle = _rss_mb(proc.pid)
        from playwright.sync_api import sync_playwright

        clicks = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            t0 = time.perf_counter()
            page.goto(f"{url}/live?{QUERY}")
            page.get_by_text("No round yet.").wait_for(timeout=300_000)
            wait_idle(page, timeout_ms=180_000)
            first_load_s = time.perf_counter() - t0
            rss_loaded = _rss_mb(proc.pid)
            for i in range(1, args.clicks + 1):
                t0 = time.perf_counter()
                page.get_by_role("button", name=re.compile(r"^Step one round")).click()
                page.get_by_text(f"Round {i}:").first.wait_for(timeout=120_000)
                t_round = time.perf_counter() - t0
                page.get_by_text(f"Round {i} in detail").first.wait_for(timeout=120_000)
                t_page = time.perf_counter() - t0
                wait_idle(page, timeout_ms=180_000)
                summary = page.get_by_text(f"Round {i}:").first.inner_text()
                m = re.search(r"Draft ([\d.]+) ms, verify ([\d.]+) ms \((\d+) tokens", summary)
                clicks.append({"round": i, "to_round_ms": round(t_round * 1000, 1),
                               "to_page_ms": round(t_page * 1000, 1),
                               "engine_ms": round(float(m.group(1)) + float(m.group(2)), 1) if m else None,
                               "tokens_in_pass": int(m.group(3)) if m else None})
                if m:  # what the page adds on top of the engine's round (rerun, animation, drawing)
                    clicks[-1]["page_overhead_ms"] = round(clicks[-1]["to_round_ms"] - clicks[-1]["engine_ms"], 1)
            rss_after = _rss_mb(proc.pid)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    import torch

    later = clicks[1:] or clicks
    out = {
        "setup": f"embedded SmolLM2-135M fp32 CPU, prompt lookup, code preset, γ=4, greedy; {QUERY}",
        "clicks": clicks,
        "median_to_round_ms_after_first": statistics.median(c["to_round_ms"] for c in later),
        "median_to_page_ms_after_first": statistics.median(c["to_page_ms"] for c in later),
        "median_page_overhead_ms_after_first": statistics.median(c.get("page_overhead_ms", 0) for c in later),
        "first_click_note": "round 1 includes the prompt's prefill",
        "first_page_load_s": round(first_load_s, 1),
        "rss_mb_server_idle": round(rss_idle, 1),
        "rss_mb_model_loaded": round(rss_loaded, 1),
        "rss_mb_after_steps": round(rss_after, 1),
        "load_average_1_5_15": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "goal_ms": 1500,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "live_step.json").write_text(json.dumps(out, indent=2))
    lines = ["# Live page: click Step → round drawn (embedded model, prompt lookup)", "",
             f"Setup: {out['setup']}. Load average during the run: {out['load_average_1_5_15']} on "
             f"{out['cpu_count']} CPUs (shared machine).", "",
             "| round | click → round line (ms) | click → page redrawn (ms) | engine draft+verify (ms) | page overhead (ms) | tokens in pass |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {c['round']} | {c['to_round_ms']} | {c['to_page_ms']} | {c['engine_ms']} | {c.get('page_overhead_ms')} | "
              f"{c['tokens_in_pass']} |" for c in clicks]
    lines += ["", f"Median after the first click: {out['median_to_round_ms_after_first']} ms to the round line, "
              f"{out['median_to_page_ms_after_first']} ms to the full page (goal 1500 ms); the page itself adds "
              f"{out['median_page_overhead_ms_after_first']} ms (median) to the engine's round "
              "(round 1 also includes the prompt's prefill).",
              f"Memory (RSS of the Streamlit process): {out['rss_mb_server_idle']} MB idle, "
              f"{out['rss_mb_model_loaded']} MB with the model loaded, {out['rss_mb_after_steps']} MB after the steps."]
    (RESULTS / "live_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
