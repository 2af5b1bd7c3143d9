"""Would ``torch.compile`` make the engine's target pass pay on this CPU? (The
only part of a prompt-lookup round left to speed up is the target pass, which transformers runs too.)

Compiles the embedded target's decoder with ``torch.compile(dynamic=True)`` (the LM head stays eager
and reads the last n hidden states, as ``CachedLM`` does with ``keep_hidden``) and measures:
- the time to compile, call by call, for the three graphs a run needs (prompt into an empty cache;
  several tokens after a cache; one token after a cache). Pass ``--cold`` to use a fresh inductor
  cache folder (a first run on a machine); otherwise the on-disk cache of earlier runs is used;
- the target pass over n = 1, 5, 9 new tokens after a 57-token cached prefix, eager and compiled
  alternately (median of ``--reps``), and the largest logit difference between the two;
- the break-even: how many target passes repay the compile time at the measured saving per pass.

Usage: ``.venv/bin/python benchmarks/bench_compile.py [--reps 12] [--threads 2] [--cold]``; writes
benchmarks/results/compile.json and .md. Takes ~4 min cold on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PREFIX = list(range(1000, 1057))  # 57 token ids: a short chat prompt's length
SIZES = (1, 5, 9)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="compile into a fresh, empty inductor cache")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile"))
    args = ap.parse_args()
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    import torch
    from transformers import DynamicCache

    from engine.decoding.models import load_model

    torch.set_num_threads(args.threads)
    target = load_model("embedded")
    model = target.model
    head = model.get_output_embeddings()
    compiled = torch.compile(model.get_decoder(), dynamic=True)

    def eager(ids, cache, n):
        return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=n).logits[0]

    def comp(ids, cache, n):
        h = compiled(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
        return head(h[:, -n:])[0]

    compile_s = {}
    with torch.inference_mode():
        cache = DynamicCache()
        for label, ids in [("prompt, empty cache", PREFIX), ("5 tokens after a cache", [5] * 5),
                           ("1 token after a cache", [7])]:
            t0 = time.perf_counter()
            comp(torch.tensor([ids]), cache, 1)
            compile_s[label] = time.perf_counter() - t0
            print(f"first call, {label}: {compile_s[label]:.1f} s", flush=True)

    def one_pass(fn, n):
        cache = DynamicCache()
        with torch.inference_mode():
            fn(torch.tensor([PREFIX]), cache, 1)
            t0 = time.perf_counter()
            out = fn(torch.tensor([list(range(2000, 2000 + n))]), cache, n)
            return (time.perf_counter() - t0) * 1000, out

    rows = {}
    for n in SIZES:
        times = {"eager": [], "compiled": []}
        diff = 0.0
        for _ in range(args.reps):  # alternate, so machine noise hits both alike
            te, le = one_pass(eager, n)
            tc, lc = one_pass(comp, n)
            times["eager"].append(te)
            times["compiled"].append(tc)
            diff = max(diff, float((le - lc).abs().max()))
        e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
        rows[n] = {"eager_ms": e, "compiled_ms": c, "ratio": e / c, "saved_ms": e - c, "max_logit_diff": diff}
        print(f"{n} tokens: eager {e:.1f} ms, compiled {c:.1f} ms", flush=True)

    total_compile = sum(compile_s.values())
    saved = statistics.median(r["saved_ms"] for r in rows.values())
    breakeven = total_compile * 1000 / saved if saved > 0 else None
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "cold": args.cold, "reps": args.reps,
            "command": " ".join(sys.argv)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "compile_s": compile_s, "passes": rows, "breakeven_passes": breakeven}, indent=2))
    lines = [f"# torch.compile on the embedded target ({meta['date']})", "",
             f"fp32, CPU, {meta['threads']} threads, torch {meta['torch']}, transformers {meta['transformers']}, "
             f"{'cold' if args.cold else 'warm (on-disk)'} inductor cache, median of {args.reps} alternating reps "
             f"after a {len(PREFIX)}-token cached prefix. `{meta['command']}`", "",
             "| tokens in the pass | eager ms | compiled ms | eager ÷ compiled | max logit diff |",
             "|---|---|---|---|---|"]
    lines += [f"| {n} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | {r['ratio']:.2f} | {r['max_logit_diff']:.1e} |"
              for n, r in rows.items()]
    lines += ["", "| first call (compiles) | s |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in compile_s.items()]
    lines += ["", f"Compile time {total_compile:.0f} s; median saving {saved:.1f} ms per pass; break-even after "
              f"{'never' if breakeven is None else f'{breakeven:,.0f}'} target passes."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
