"""Prefix caching: simulator cost per page rerun, and the real prefill time saved on the embedded model.

1. ``simulate_texts`` for each preset (what one rerun of the page computes), median ms.
2. ``measure_prefix_reuse`` on the embedded model for request 1 → request 2 of each preset (and the
   timestamp preset with the timestamp moved to the end): TTFT full vs with reuse, decode ms/token with
   both caches, max |Δ logits|, and the simulator's linear estimate with the measured ms/token.

Usage: .venv/bin/python benchmarks/bench_prefix_cache.py [--device cuda] [--repeats 7]
Writes benchmarks/results/prefix_cache[_<device>].json and .md.
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

from engine.decoding.models import load_model, load_tokenizer  # noqa: E402
from engine.explain.prefix_cache import (  # noqa: E402
    PRESETS,
    estimate_ttft_ms,
    join_requests,
    measure_prefix_reuse,
    preset_requests,
    simulate_texts,
    tokenize_requests,
)

OUT = ROOT / "benchmarks" / "results"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads (0 = torch's default); 1 is steadier on a shared, loaded CPU")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    res: dict = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                             "load_avg_1min": os.getloadavg()[0], "device": args.device,
                             "torch_threads": args.threads or "default"}}
    tok = load_tokenizer("embedded")
    sim_ms = {}
    for name in PRESETS:
        text = join_requests(preset_requests(name))
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            simulate_texts(text, tok, 16, 64, 2, 0.5)
            times.append((time.perf_counter() - t0) * 1e3)
        sim_ms[name] = round(statistics.median(times), 2)
    res["simulate_texts_median_ms"] = sim_ms

    lm = load_model("embedded", device=args.device, dtype="fp32")
    pairs = {name: preset_requests(name) for name in PRESETS if name != "timestamp"}
    pairs["timestamp (at the end)"] = preset_requests("timestamp", timestamp_first=False)
    rows = {}
    for name, texts in pairs.items():
        a, b = tokenize_requests(texts[:2], lm.tokenizer)
        m = measure_prefix_reuse(lm, a, b, block_size=16, repeats=args.repeats, decode_tokens=args.decode_tokens)
        est_full, est_reuse = estimate_ttft_ms(m.prompt_tokens, m.reused_tokens, m.ms_per_prefill_token)
        rows[name] = {
            "prompt_tokens": m.prompt_tokens, "reused_tokens": m.reused_tokens,
            "ttft_full_ms": round(m.ttft_full_ms, 2), "ttft_reuse_ms": round(m.ttft_reuse_ms, 2),
            "speedup": round(m.speedup, 2), "copy_ms": round(m.copy_ms, 2),
            "estimate_reuse_ms": round(est_reuse, 2),
            "decode_full_ms_per_token": round(m.decode_full_ms_per_token, 2),
            "decode_reuse_ms_per_token": round(m.decode_reuse_ms_per_token, 2),
            "max_abs_logit_diff": m.max_abs_logit_diff, "same_first_token": m.same_first_token,
            "same_decoded_tokens": m.same_decoded_tokens,
            "ttft_full_samples_ms": [round(x, 2) for x in m.ttft_full_samples_ms],
            "ttft_reuse_samples_ms": [round(x, 2) for x in m.ttft_reuse_samples_ms],
        }
        print(name, rows[name], flush=True)
    res["real_model"] = {"repeats": args.repeats, "decode_tokens": args.decode_tokens, "dtype": "float32",
                         "pairs": rows}

    OUT.mkdir(parents=True, exist_ok=True)
    stem = "prefix_cache" if args.device == "cpu" else f"prefix_cache_{args.device.split(':')[0]}"
    (OUT / f"{stem}.json").write_text(json.dumps(res, indent=2))
    res["machine"]["load_avg_1min_end"] = os.getloadavg()[0]
    lines = [f"# Prefix caching ({args.device}, {res['machine']['cpus']} CPUs, torch threads "
             f"{res['machine']['torch_threads']}, 1-min load {res['machine']['load_avg_1min']:.1f} at start, "
             f"{res['machine']['load_avg_1min_end']:.1f} at end)",
             "", "Page rerun: `simulate_texts` median ms per preset: "
             + ", ".join(f"{k} {v}" for k, v in sim_ms.items()), "",
             f"Request 1 → request 2 of each preset, embedded SmolLM2-135M fp32, block 16, medians of "
             f"{args.repeats} alternating runs; decode over {args.decode_tokens} tokens.", "",
             "| pair | tokens | reused | TTFT full ms | TTFT reuse ms | speedup | linear estimate ms | "
             "decode ms/tok full / reuse | max abs Δ logits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k, r in rows.items():
        lines.append(f"| {k} | {r['prompt_tokens']} | {r['reused_tokens']} | {r['ttft_full_ms']} | "
                     f"{r['ttft_reuse_ms']} | {r['speedup']}× | {r['estimate_reuse_ms']} | "
                     f"{r['decode_full_ms_per_token']} / {r['decode_reuse_ms_per_token']} | "
                     f"{r['max_abs_logit_diff']:.1e} |")
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
