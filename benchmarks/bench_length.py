"""Fixed γ against the adaptive draft length (and the combined draft) against plain decoding, on held-out prompts.

Twelve prompts written for this benchmark (no training set here holds them): six everyday questions and six that
copy their context (code edits, quoting, reformatting), where prompt lookup can help. For each prompt, the methods
alternate (order rotated each rep: A B C D, then D C B A, …), greedy (and with ``--temperature``, sampled with one
seed for all methods); per method the median ms per generated token over ``--reps`` runs, the speedup = plain's
median ÷ the method's, and whether the text equals plain decoding's (greedy: it must).

Methods: ``plain``; ``head-fixed`` (the shipped head, a fixed γ = this machine's default, ``default_gamma_here``);
``head-adaptive`` (the head, each round 0..6 tokens by ``engine.decoding.draft_length``); ``auto-adaptive``
(``embedded-auto``: prompt lookup or the head per round).

    .venv/bin/python benchmarks/bench_length.py [--reps 2] [--max-new-tokens 64] [--temperature 0.7]

Writes benchmarks/results/length_<machine>.json and .md (``--out`` for another stem).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.machine import machine_line, machine_meta, machine_slug  # noqa: E402
from engine.decoding.draft_length import ADAPTIVE_GAMMA_MAX, choice_summary  # noqa: E402
from engine.decoding.drafts import EMBEDDED_AUTO, make_proposer  # noqa: E402
from engine.decoding.models import EMBEDDED_HEAD, load_model  # noqa: E402
from engine.decoding.sampling import SamplingConfig  # noqa: E402
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt  # noqa: E402
from engine.explain.analytic import default_gamma_here  # noqa: E402

PROMPTS = [
    ("chat", "What should I pack for a two-day hike in autumn?"),
    ("chat", "Why do onions make people cry when they are cut?"),
    ("chat", "Give me three tips for writing a clear email to a busy manager."),
    ("chat", "How does a bicycle stay upright when it is moving?"),
    ("chat", "Explain the difference between weather and climate to a ten-year-old."),
    ("chat", "What are the pros and cons of working from home?"),
    ("copy", "Rename the function total to sum_prices in this code:\n\ndef total(prices):\n    result = 0\n"
             "    for p in prices:\n        result += p\n    return result\n\nprint(total([1, 2, 3]))"),
    ("copy", "Add type hints to this Python function:\n\ndef greet(name, times):\n    for i in range(times):\n"
             "        print('Hello, ' + name)\n    return len(name) * times"),
    ("copy", "Convert this list to a numbered list: apples, bananas, cherries, dates, elderberries, figs, grapes."),
    ("copy", "Fix the spelling in this sentence and repeat it: The quick brwon fox jumpd over the lazzy dog "
             "near the rivr bank."),
    ("copy", "Rewrite this JSON with the key 'name' renamed to 'title': {\"name\": \"Dune\", \"year\": 1965, "
             "\"author\": \"Frank Herbert\", \"pages\": 412}"),
    ("copy", "Translate these variable names from camelCase to snake_case: userName, totalCount, isActive, "
             "maxRetryLimit, lastLoginDate."),
]


def method_decoder(target, method: str, ids, sampling, seed, max_new, gamma_fixed):
    if method == "plain":
        return SpeculativeDecoder(target, None, ids, sampling=sampling, seed=seed, max_new_tokens=max_new)
    if method == "head-fixed":
        return SpeculativeDecoder(target, make_proposer(EMBEDDED_HEAD, target, length="fixed"), ids, gamma=gamma_fixed,
                                  sampling=sampling, seed=seed, max_new_tokens=max_new)
    spec = EMBEDDED_HEAD if method == "head-adaptive" else EMBEDDED_AUTO
    return SpeculativeDecoder(target, make_proposer(spec, target, length="adaptive"), ids, gamma=ADAPTIVE_GAMMA_MAX,
                              sampling=sampling, seed=seed, max_new_tokens=max_new)


def run_one(target, method, ids, sampling, seed, max_new, gamma_fixed) -> dict:
    dec = method_decoder(target, method, ids, sampling, seed, max_new, gamma_fixed)
    t0 = time.perf_counter()
    res = dec.run()
    ms = (time.perf_counter() - t0) * 1000
    n = max(len(res.token_ids), 1)
    s = res.stats
    summ = choice_summary(res.rounds)
    return {"ms_per_token": ms / n, "tokens": res.token_ids, "alpha": s.acceptance_rate,
            "drafted_per_round": s.drafted / max(s.rounds, 1), "tokens_per_pass": s.tokens_per_target_pass,
            "plain_rounds": (summ or {}).get("plain"), "by_source": (summ or {}).get("by_source")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = load_model("embedded", device="cpu")
    gamma_fixed = default_gamma_here(EMBEDDED_HEAD)[0]
    sampling = SamplingConfig(temperature=args.temperature)
    methods = ["plain", "head-fixed", "head-adaptive", "auto-adaptive"]
    meta = machine_meta(target)
    rows = []
    # warm-up: one short run of each method
    warm = encode_prompt(target.tokenizer, "Hello there.")
    for m in methods:
        run_one(target, m, warm, sampling, args.seed, 8, gamma_fixed)
    for pi, (kind, prompt) in enumerate(PROMPTS[:args.prompts]):
        ids = encode_prompt(target.tokenizer, prompt)
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for rep in range(args.reps):
            order = methods[pi % len(methods):] + methods[:pi % len(methods)]
            if rep % 2:
                order = order[::-1]
            for m in order:
                runs[m].append(run_one(target, m, ids, sampling, args.seed, args.max_new_tokens, gamma_fixed))
        plain_ms = statistics.median(r["ms_per_token"] for r in runs["plain"])
        row = {"prompt": prompt, "kind": kind, "plain_ms_per_token": plain_ms}
        for m in methods[1:]:
            med = statistics.median(r["ms_per_token"] for r in runs[m])
            first = runs[m][0]
            row[m] = {"ms_per_token": med, "speedup": plain_ms / med,
                      "identical": first["tokens"] == runs["plain"][0]["tokens"], "alpha": first["alpha"],
                      "drafted_per_round": first["drafted_per_round"], "tokens_per_pass": first["tokens_per_pass"],
                      "plain_rounds": first["plain_rounds"], "by_source": first["by_source"]}
        rows.append(row)
        print(f"{pi + 1:2d} {kind:4s} plain {plain_ms:5.2f} ms/tok  " + "  ".join(
            f"{m} {row[m]['speedup']:.2f}×{'' if row[m]['identical'] else ' (text differs)'}" for m in methods[1:]),
            flush=True)
    meta["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    summary = {}
    for m in methods[1:]:
        sp = [r[m]["speedup"] for r in rows]
        summary[m] = {"median": statistics.median(sp), "min": min(sp), "max": max(sp),
                      "median_chat": statistics.median(r[m]["speedup"] for r in rows if r["kind"] == "chat"),
                      "median_copy": statistics.median(r[m]["speedup"] for r in rows if r["kind"] == "copy"),
                      "below_0.98": sum(s < 0.98 for s in sp), "identical": sum(r[m]["identical"] for r in rows)}
    cmd = (f".venv/bin/python benchmarks/bench_length.py --reps {args.reps} --max-new-tokens {args.max_new_tokens}"
           + (f" --temperature {args.temperature}" if args.temperature else ""))
    stem = args.out or str(ROOT / "benchmarks" / "results" /
                           (f"length_{machine_slug()}" + (f"_t{args.temperature:g}" if args.temperature else "")))
    out = {"meta": {**meta, "date": time.strftime("%Y-%m-%d %H:%M"), "command": cmd, "gamma_fixed": gamma_fixed,
                    "gamma_cap": ADAPTIVE_GAMMA_MAX, "temperature": args.temperature, "reps": args.reps,
                    "max_new_tokens": args.max_new_tokens},
           "summary": summary, "rows": rows}
    Path(stem + ".json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    lines = [f"# Draft length: fixed γ against adaptive, against plain decoding ({'greedy' if not args.temperature else f'T = {args.temperature:g}'})",
             "", machine_line(meta), "", f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}). Twelve prompts of this "
             "benchmark's own (six everyday questions, six that copy their context); per prompt the methods "
             "alternate, order rotated each rep; speedup = plain's median ms per token ÷ the method's.", "",
             f"head-fixed: the shipped head at γ = {gamma_fixed} (this machine's default); head-adaptive: the head, "
             f"each round 0..{ADAPTIVE_GAMMA_MAX} tokens (engine/decoding/draft_length.py); auto-adaptive: prompt "
             "lookup or the head per round (engine/decoding/combined.py).", "",
             "| method | median | min | max | chat median | copy median | prompts < 0.98× | same text as plain |",
             "|---|---|---|---|---|---|---|---|"]
    for m, s in summary.items():
        lines.append(f"| {m} | **{s['median']:.2f}×** | {s['min']:.2f}× | {s['max']:.2f}× | {s['median_chat']:.2f}× | "
                     f"{s['median_copy']:.2f}× | {s['below_0.98']} | {s['identical']}/{len(rows)} |")
    lines += ["", "| # | kind | plain ms/token | " + " | ".join(f"{m} (α̂, drafted/round)" for m in methods[1:]) + " |",
              "|---|---|---|" + "---|" * (len(methods) - 1)]
    for i, r in enumerate(rows):
        cells = []
        for m in methods[1:]:
            x = r[m]
            a = "–" if x["alpha"] is None else f"{x['alpha']:.2f}"
            cells.append(f"{x['speedup']:.2f}× ({a}, {x['drafted_per_round']:.2f})")
        lines.append(f"| {i + 1} | {r['kind']} | {r['plain_ms_per_token']:.2f} | " + " | ".join(cells) + " |")
    Path(stem + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-(len(rows) + 2 + len(summary) + 4):]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
