"""The int8 arithmetic against the fp32 arithmetic (``engine.decoding.compute.arithmetic``), side by side in one
process: the embedded model loaded twice, once each way, every measurement alternating between the two.

Measured:
- this CPU's arithmetic ceilings (``arithmetic_peak``: register-only int8 vpdpbusd and fp32 FMA loops, 2 threads);
- a target pass over k = 1, 2, 3, 4, 5, 8, 12, 16, 24 new tokens after 100 cached tokens (as the engine times its
  pass-cost curve, ``measure_pass_cost``: batch-invariant passes, sizes interleaved), medians of --reps, and t(k)/t(1);
- the prefill of a ~150-token prompt (the code-edit prompt with its code quoted three times), medians;
- plain greedy decoding, 64 new tokens, on three everyday prompts: decode tokens/s (the decoder's rounds after its
  prefill), medians;
- prompt lookup (γ 4) against plain decoding on two code edits, each arithmetic on its own (decode tokens/s and whole
  requests), alternating spec/plain;
- what the int8 arithmetic changes (``engine.decoding.agreement.compare_arithmetic``) on 12 prompts no draft here
  was trained on: identical greedy texts, first divergence, top-1 agreement by position, mean KL.

Usage (an idle machine): ``flock -x /tmp/speedup-cpu.lock .venv/bin/python benchmarks/bench_int8.py --reps 9``
writes benchmarks/results/int8_<machine>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.machine import machine_line, machine_meta, machine_slug  # noqa: E402
from engine.decoding import compute  # noqa: E402
from engine.decoding.agreement import compare_arithmetic  # noqa: E402
from engine.decoding.drafts import make_proposer  # noqa: E402
from engine.decoding.models import load_model  # noqa: E402
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SIZES = (1, 2, 3, 4, 5, 8, 12, 16, 24)
EVERYDAY = ("Explain why the sky is blue to a ten-year-old.", "Write three tips for a good night's sleep.",
            "What is the difference between a list and a tuple in Python?")
CODE_EDITS = {
    "docstring": ("Add a docstring to this function. Return the whole function.\n\n"
                  "def mean(values):\n    if not values:\n        raise ValueError('empty')\n"
                  "    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"),
    "type hints": ("Add type hints to this Python function and return the full code:\n\n"
                   "def scale(points, factor):\n    result = []\n    for x, y in points:\n"
                   "        result.append((x * factor, y * factor))\n    return result\n"),
}
HELD_OUT = ("Describe how a bicycle gear system works.", "Give me a short recipe for tomato soup.",
            "What causes ocean tides?", "Summarize the plot of Romeo and Juliet in three sentences.",
            "How do vaccines train the immune system?", "Write a haiku about autumn rain.",
            "What is a binary search and when should I use it?", "List four uses of baking soda at home.",
            "Why do leaves change color in the fall?", "Explain compound interest with an example.",
            "What are the main differences between HTTP and HTTPS?", "How should I prepare for a job interview?")


def pass_times(models: dict, reps: int) -> dict:
    from transformers import DynamicCache

    ids = torch.randint(100, 40000, (1, 100 + max(SIZES)), generator=torch.Generator().manual_seed(0))
    times = {a: {n: [] for n in SIZES} for a in models}
    caches = {}
    with torch.inference_mode():
        for a, t in models.items():
            c = DynamicCache()
            t.model(input_ids=ids[:, :100], cache=c, use_cache=True, logits_to_keep=1)
            caches[a] = c
        for rep in range(reps + 1):  # rep 0 warms up
            for n in (SIZES if rep % 2 else SIZES[::-1]):
                for a in (list(models) if rep % 2 else list(models)[::-1]):
                    t0 = time.perf_counter()
                    with compute.batch_invariant():
                        models[a].model(input_ids=ids[:, 100:100 + n], cache=caches[a], use_cache=True,
                                        logits_to_keep=n)
                    dt = (time.perf_counter() - t0) * 1e3
                    caches[a].crop(-n)
                    if rep:
                        times[a][n].append(dt)
    out = {}
    for a, by_n in times.items():
        med = {n: statistics.median(v) for n, v in by_n.items()}
        out[a] = {"ms": {str(n): round(v, 3) for n, v in med.items()},
                  "ratio": {str(n): round(v / med[1], 3) for n, v in med.items()}}
    return out


def prefill_times(models: dict, reps: int) -> dict:
    tok = next(iter(models.values())).tokenizer
    code = CODE_EDITS["docstring"].split("\n\n", 1)[1]
    prompt = encode_prompt(tok, "Compare these three copies of a function and say whether they differ:\n\n"
                           + code + "\n" + code + "\n" + code)
    times = {a: [] for a in models}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for a in (list(models) if rep % 2 else list(models)[::-1]):
                t0 = time.perf_counter()
                models[a].model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
                if rep:
                    times[a].append((time.perf_counter() - t0) * 1e3)
    return {"tokens": len(prompt), **{a: round(statistics.median(v), 2) for a, v in times.items()}}


def decode_rate(target, proposer, ids, gamma: int = 4, max_new: int = 64) -> tuple[float, float, list[int]]:
    """(decode tokens/s after the prefill, whole-request tokens/s, the new ids) of one greedy run."""
    t0 = time.perf_counter()
    dec = SpeculativeDecoder(target, proposer, ids, gamma=gamma, max_new_tokens=max_new)
    dec.prefill()
    t1 = time.perf_counter()
    dec.run()
    t2 = time.perf_counter()
    n = len(dec.new_ids)
    return n / (t2 - t1), n / (t2 - t0), list(dec.new_ids)


def plain_rates(models: dict, reps: int) -> dict:
    tok = next(iter(models.values())).tokenizer
    out = {a: {} for a in models}
    for p in EVERYDAY:
        ids = encode_prompt(tok, p)
        got = {a: [] for a in models}
        for rep in range(reps):
            for a in (list(models) if rep % 2 else list(models)[::-1]):
                got[a].append(decode_rate(models[a], None, ids)[0])
        for a in models:
            out[a][p] = round(statistics.median(got[a]), 1)
    return {a: {"per_prompt": v, "median": round(statistics.median(v.values()), 1)} for a, v in out.items()}


def lookup_speedups(models: dict, reps: int) -> dict:
    tok = next(iter(models.values())).tokenizer
    out = {}
    for a, target in models.items():
        proposer = make_proposer("ngram", target)
        rows = {}
        for name, p in CODE_EDITS.items():
            ids = encode_prompt(tok, p)
            spec, base, spec_req, base_req = [], [], [], []
            same = True
            for rep in range(reps):
                order = ("spec", "plain") if rep % 2 == 0 else ("plain", "spec")
                for which in order:
                    d, w, new = decode_rate(target, proposer if which == "spec" else None, ids, gamma=4, max_new=96)
                    (spec if which == "spec" else base).append(d)
                    (spec_req if which == "spec" else base_req).append(w)
                    if which == "spec":
                        spec_ids = new
                    else:
                        base_ids = new
                same = same and spec_ids == base_ids
            rows[name] = {"spec_decode_tok_s": round(statistics.median(spec), 1),
                          "plain_decode_tok_s": round(statistics.median(base), 1),
                          "decode_speedup": round(statistics.median(spec) / statistics.median(base), 3),
                          "request_speedup": round(statistics.median(spec_req) / statistics.median(base_req), 3),
                          "identical": same}
        out[a] = rows
    return out


LLAMA_TOKENS = (1, 2, 3, 4, 8, 16)


def llama_passes() -> dict:
    """llama.cpp's passes on this machine, measured by its own ``llama-bench`` (built beside llama-server:
    ``cmake --build <build> --target llama-bench llama-quantize``): ms for a pass over k tokens (``pp k``: k ÷ its
    tokens/s) and a decode step (``tg``), 100 cached tokens, 2 threads, 5 reps, for the shipped Q4_1 GGUF and the same
    model requantized to Q4_0 (its repacked int8 gemm). {} when llama-bench is not built here."""
    import subprocess
    import tempfile

    from engine.decoding.models import embedded_gguf_path
    from engine.serving import llamacpp

    binary = llamacpp.built_binary().parent
    bench, quant = binary / "llama-bench", binary / "llama-quantize"
    if not bench.exists() or not quant.exists():
        return {}
    gguf = embedded_gguf_path()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        q40 = Path(tmp) / "q4_0.gguf"
        subprocess.run([str(quant), "--allow-requantize", str(gguf), str(q40), "Q4_0"], check=True,
                       capture_output=True)
        for name, model in (("Q4_1 (shipped)", gguf), ("Q4_0 (requantized)", q40)):
            got = subprocess.run([str(bench), "-m", str(model), "-p", ",".join(map(str, LLAMA_TOKENS)), "-n", "64",
                                  "-d", "100", "-t", str(torch.get_num_threads()), "-r", "5", "-o", "json"],
                                 check=True, capture_output=True, text=True)
            rows = json.loads(got.stdout)
            ms = {}
            for r in rows:
                if r.get("n_gen"):
                    ms["tg"] = round(1e3 / r["avg_ts"], 3)
                else:
                    ms[str(r["n_prompt"])] = round(1e3 * r["n_prompt"] / r["avg_ts"], 3)
            out[name] = ms
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / f"int8_{machine_slug()}"))
    ap.add_argument("--parts", default="peaks,passes,llama,prefill,plain,lookup,agreement",
                    help="what to measure (the rest is kept from the result file at --out, when there is one)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    models = {a: load_model("embedded", arithmetic=a) for a in ("int8", "fp32")}
    meta = machine_meta(models["int8"])
    meta["fp32_weights"] = models["fp32"].compute.formats_label()
    compute.stream_kernel()
    peak = compute.extension._STREAM["int8"]["peak"]
    out = Path(args.out)
    res = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    res.update({"meta": meta, "impl": compute.extension._STREAM["int8"]["impl"]()})
    if "peaks" in parts:
        res["peaks_gmac_s"] = {k: round(peak(k, 1.0) / 1e9, 1) for k in ("int8", "fp32")}
        print("peaks", res["peaks_gmac_s"], flush=True)
    if "passes" in parts:
        res["passes"] = pass_times(models, args.reps)
        print("passes", json.dumps(res["passes"]), flush=True)
    if "prefill" in parts:
        res["prefill_ms"] = prefill_times(models, max(3, args.reps // 2))
        print("prefill", res["prefill_ms"], flush=True)
    if "plain" in parts:
        res["plain_decode_tok_s"] = plain_rates(models, max(3, args.reps // 3))
        print("plain", res["plain_decode_tok_s"], flush=True)
    if "lookup" in parts:
        res["prompt_lookup"] = lookup_speedups(models, max(3, args.reps // 3))
        print("lookup", res["prompt_lookup"], flush=True)
    if "llama" in parts:
        res["llama_bench_ms"] = llama_passes()
        print("llama", res["llama_bench_ms"], flush=True)
    if "agreement" in parts:
        tok = models["fp32"].tokenizer
        agreement = compare_arithmetic(models["int8"], models["fp32"],
                                       [encode_prompt(tok, p) for p in HELD_OUT[:args.prompts]],
                                       max_new_tokens=args.max_new_tokens)
        res["agreement"] = agreement.to_dict()
        print("agreement", agreement.summary(), flush=True)
    res["meta"]["load_avg_1min_end"] = round(__import__("os").getloadavg()[0], 2)
    res.pop("command", None)
    cmd = "flock -x /tmp/speedup-cpu.lock .venv/bin/python benchmarks/bench_int8.py " + " ".join(sys.argv[1:])
    res["commands"] = [c for c in res.get("commands", []) if "--parts" in c and c != cmd] + [cmd]
    res["date"] = time.strftime("%Y-%m-%d %H:%M")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(markdown(res))
    print(out.with_suffix(".md").read_text())
    return 0


def markdown(r: dict) -> str:
    p = r["passes"]
    lines = [f"# The int8 arithmetic against the fp32 arithmetic ({r['date']})", "", machine_line(r["meta"]), "",
             "Commands: " + "; ".join(f"`{c}`" for c in r.get("commands", [])), "",
             f"int8 products on this build: **{r['impl']}**. This CPU's ceilings (register-only loops, "
             f"{r['meta']['threads']} threads): int8 {r['peaks_gmac_s']['int8']:.0f} G multiply-adds/s, fp32 "
             f"{r['peaks_gmac_s']['fp32']:.0f} G/s ({r['peaks_gmac_s']['int8'] / r['peaks_gmac_s']['fp32']:.1f}×).", "",
             "## A target pass over k new tokens (100 cached), medians, ms and × a 1-token pass", "",
             "| k | " + " | ".join(str(n) for n in SIZES) + " |", "|---|" + "---|" * len(SIZES)]
    for a in ("int8", "fp32"):
        lines.append(f"| {a} ms | " + " | ".join(f"{p[a]['ms'][str(n)]:.2f}" for n in SIZES) + " |")
        lines.append(f"| {a} × t(1) | " + " | ".join(f"{p[a]['ratio'][str(n)]:.2f}" for n in SIZES) + " |")
    lb = r.get("llama_bench_ms") or {}
    if lb:
        lines += ["", "llama.cpp on the same machine, in the same run (`llama-bench -p 1,2,3,4,8,16 -n 64 -d 100 -r 5`), "
                  "ms for a pass over k tokens (tg: a decode step):", "",
                  "| llama.cpp | tg | " + " | ".join(str(k) for k in LLAMA_TOKENS) + " |",
                  "|---|---|" + "---|" * len(LLAMA_TOKENS)]
        for name, ms in lb.items():
            lines.append(f"| {name} | {ms.get('tg', float('nan')):.2f} | "
                         + " | ".join(f"{ms.get(str(k), float('nan')):.2f}" for k in LLAMA_TOKENS) + " |")
    pf = r["prefill_ms"]
    lines += ["", f"Prefill of a {pf['tokens']}-token prompt: int8 **{pf['int8']:.0f} ms**, fp32 {pf['fp32']:.0f} ms "
              f"({pf['fp32'] / pf['int8']:.2f}× faster).", "",
              "## Plain greedy decoding, decode tokens/s (64 new tokens), medians", "",
              "| prompt | int8 | fp32 |", "|---|---|---|"]
    pr = r["plain_decode_tok_s"]
    for prompt in pr["int8"]["per_prompt"]:
        lines.append(f"| {prompt} | {pr['int8']['per_prompt'][prompt]} | {pr['fp32']['per_prompt'][prompt]} |")
    lines.append(f"| **median** | **{pr['int8']['median']}** | {pr['fp32']['median']} |")
    lines += ["", "## Prompt lookup (γ 4) against plain decoding on code edits, 96 new tokens", "",
              "| arithmetic | prompt | decode speedup | whole-request speedup | spec / plain decode tok/s | identical |",
              "|---|---|---|---|---|---|"]
    for a, rows in r["prompt_lookup"].items():
        for name, v in rows.items():
            lines.append(f"| {a} | {name} | **{v['decode_speedup']:.2f}×** | {v['request_speedup']:.2f}× | "
                         f"{v['spec_decode_tok_s']} / {v['plain_decode_tok_s']} | {v['identical']} |")
    g = r["agreement"]
    lines += ["", "## What the int8 arithmetic changes (against the fp32 arithmetic, greedy, "
              f"{g['max_new_tokens']} new tokens, {g['prompts']} held-out prompts)", "",
              f"- identical greedy texts: **{g['identical_texts']} of {g['prompts']}**; first divergence (token index) "
              f"per prompt: {', '.join('—' if d is None else str(d) for d in g['first_divergence'])}",
              f"- top-1 next-token agreement (teacher-forced on the fp32 text): **{100 * g['top1']:.2f} %** of "
              f"{g['positions']} positions; by position: "
              + ", ".join(f"{k}: {100 * v:.1f} %" for k, v in g["top1_by_position"].items()),
              f"- KL(p_fp32 ‖ p_int8): mean **{g['mean_kl']:.4f}** nats, largest {g['max_kl']:.3f}", "",
              "Speculative decoding is lossless on either arithmetic (greedy speculative text = plain text on the same "
              "arithmetic, checked above for prompt lookup); the differences here are the arithmetic's, as "
              "llama.cpp's own Q8 activations give."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
