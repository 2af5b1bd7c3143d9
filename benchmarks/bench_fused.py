"""The fused decode pass against the lean layers: plain decoding and the default draft head on the embedded model, with
every decode pass on the fused C++ layer and the direct loop (``compute.lean.fused_decode``, ``fused_layer.cpp``)
against the same passes through transformers' ``LlamaModel.forward`` and the lean decoder layers (``_lean_forward``:
PyTorch operations around the same products).

Per prompt: ``--max-new`` greedy tokens, the two ways alternating A B B A ``--reps`` times in one process; decode
tokens/s (the rounds after the prefill) and the time of one target pass of 1 and 3 tokens after the prompt (medians of
30, alternating), medians. The fused layer's values are within fp32 rounding of the lean layers', so the texts may part
at a near tie: the table says whether they did.

Usage (an idle machine): ``flock -x /tmp/speedup-cpu.lock .venv/bin/python benchmarks/bench_fused.py``
writes benchmarks/results/fused_<machine>.json and .md (``--out NAME`` for another name).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = {
    "chat": "Explain in a few sentences why the sky is blue.",
    "how-to": "How do I keep basil alive on a windowsill? Give three tips.",
    "code edit": ("Add type hints to this Python function and return the full code:\n\n"
                  "def scale(points, factor):\n    result = []\n    for x, y in points:\n"
                  "        result.append((x * factor, y * factor))\n    return result\n"),
}


@contextlib.contextmanager
def lean_layers_only():
    """Decode passes through ``LlamaModel.forward`` and the lean layers, not the fused layer."""
    from engine.decoding.compute import extension, lean

    saved = extension._STREAM.get("fused_layer"), lean.DIRECT_MODEL
    extension._STREAM["fused_layer"], lean.DIRECT_MODEL = None, False
    try:
        yield
    finally:
        extension._STREAM["fused_layer"], lean.DIRECT_MODEL = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="A B B A pairs")
    ap.add_argument("--out", default=None, help="results name (default fused_<machine>)")
    args = ap.parse_args()

    import torch

    from benchmarks.machine import machine_line, machine_meta, machine_slug
    from engine.decoding.drafts import make_proposer
    from engine.decoding.models import EMBEDDED_HEAD, load_model
    from engine.decoding.proposers import CachedLM
    from engine.decoding.speculative import SpeculativeDecoder, encode_prompt
    from engine.explain.analytic import default_gamma_here

    t = load_model("embedded")
    head = make_proposer(EMBEDDED_HEAD, t)
    gamma = default_gamma_here(EMBEDDED_HEAD)[0]
    ways = {"fused": contextlib.nullcontext, "lean layers": lean_layers_only}
    rows, runs = [], []
    for name, prompt in PROMPTS.items():
        ids = encode_prompt(t.tokenizer, prompt)
        rates: dict[tuple[str, str], list[float]] = {}
        tokens: dict[tuple[str, str], list[int]] = {}
        for rep in range(2 * args.reps):
            for way in (list(ways) if rep % 2 == 0 else list(ways)[::-1]):
                with ways[way]():
                    for kind, prop in (("plain", None), ("draft head", head)):
                        d = SpeculativeDecoder(t, prop, ids, gamma=gamma, max_new_tokens=args.max_new,
                                               stop_on_eos=False)
                        d.prefill()
                        t0 = time.perf_counter()
                        r = d.run()
                        rates.setdefault((kind, way), []).append(len(r.token_ids) / (time.perf_counter() - t0))
                        tokens[(kind, way)] = r.token_ids
        passes: dict[tuple[int, str], list[float]] = {}
        with torch.inference_mode():
            lm = CachedLM(t.model, t.device)
            lm.logits_for(list(ids))
            for i in range(60):
                way = list(ways)[i % 2]
                with ways[way]():
                    for k in (1, 3):
                        seq = list(ids) + [100 + j for j in range(k)]
                        t0 = time.perf_counter()
                        lm.logits_for(seq, n_logits=k)
                        passes.setdefault((k, way), []).append(time.perf_counter() - t0)
                        lm.crop(len(ids))
        for kind in ("plain", "draft head"):
            a, b = statistics.median(rates[(kind, "fused")]), statistics.median(rates[(kind, "lean layers")])
            rows.append({"prompt": name, "method": kind, "fused_tokens_per_s": a, "lean_tokens_per_s": b,
                         "ratio": a / b, "same_tokens": tokens[(kind, "fused")] == tokens[(kind, "lean layers")]})
            runs.append({"prompt": name, "method": kind, "fused": rates[(kind, "fused")],
                         "lean": rates[(kind, "lean layers")]})
            print(f"{name}, {kind}: fused {a:.1f} tok/s, lean layers {b:.1f} ({a / b:.2f}×)", flush=True)
        for k in (1, 3):
            a, b = (statistics.median(passes[(k, w)]) * 1e3 for w in ways)
            rows.append({"prompt": name, "method": f"one {k}-token pass (ms)", "fused_ms": a, "lean_ms": b,
                         "ratio": b / a})
            print(f"{name}, {k}-token pass: fused {a:.2f} ms, lean layers {b:.2f} ms", flush=True)
    meta = {**machine_meta(t), "date": time.strftime("%Y-%m-%d %H:%M"), "reps": args.reps, "max_new": args.max_new,
            "gamma": gamma, "command": " ".join(["benchmarks/bench_fused.py", *sys.argv[1:]])}
    import os

    meta["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    name = args.out or f"fused_{machine_slug()}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2))
    md = [f"# The fused decode pass against the lean layers ({meta['cpu']}, {meta['date']})", "",
          f"`{meta['command']}`: {args.max_new} greedy tokens after each prompt, A B B A × {args.reps}, decode "
          f"tokens/s (after the prefill), medians; the draft head at γ {gamma}. Passes: one target pass after the "
          "prompt, medians of 30 alternating.", "", machine_line(meta), "",
          "| prompt | method | fused | lean layers | fused ÷ lean | same tokens |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "fused_ms" in r:
            md.append(f"| {r['prompt']} | {r['method']} | {r['fused_ms']:.2f} ms | {r['lean_ms']:.2f} ms | "
                      f"{r['ratio']:.2f}× faster | — |")
        else:
            md.append(f"| {r['prompt']} | {r['method']} | {r['fused_tokens_per_s']:.1f} tok/s | "
                      f"{r['lean_tokens_per_s']:.1f} tok/s | {r['ratio']:.2f}× | "
                      f"{'yes' if r['same_tokens'] else 'no (a near tie)'} |")
    (RESULTS / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
