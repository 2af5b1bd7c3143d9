"""The KV cache written in place against concatenated: a lone decoder's passes on the embedded model with
``CachedLM``'s block layers (``BlockLayer``, ``engine.decoding.proposers.block_layer_class``: each pass's keys and
values copied after the cached ones in a preallocated block) against transformers' ``DynamicLayer.update`` (every
pass concatenates each layer's whole cache with its new entries: 60 copies a pass, each as long as the context).

Per context length (a prompt of about that many tokens, then ``--max-new`` greedy tokens): plain decoding and the
default draft head (its default γ on this machine), each with the layers writing in place and concatenating,
alternating A B B A ``--reps`` times; decode tokens/s (the decoder's rounds after its prefill), medians. Both ways
must give the same tokens (checked).

Usage (an idle machine): ``flock -x /tmp/speedup-cpu.lock .venv/bin/python benchmarks/bench_kv_block.py``
writes benchmarks/results/kv_block_<machine>.json and .md (``--out NAME`` for another name).
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

RESULTS = ROOT / "benchmarks" / "results"
TOPIC = ("Here are my notes on how a bicycle's gears work, the chain, the derailleur, the cassette and the "
         "chainrings, and why a lower gear makes hills easier. ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="40,400", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3, help="A B B A pairs")
    ap.add_argument("--out", default=None, help="results name (default kv_block_<machine>)")
    args = ap.parse_args()

    from benchmarks.machine import machine_line, machine_meta, machine_slug
    from engine.decoding import proposers
    from engine.decoding.drafts import make_proposer
    from engine.decoding.models import EMBEDDED_HEAD, load_model
    from engine.decoding.speculative import SpeculativeDecoder, encode_prompt
    from engine.explain.analytic import default_gamma_here

    t = load_model("embedded")
    head = make_proposer(EMBEDDED_HEAD, t)
    gamma = default_gamma_here(EMBEDDED_HEAD)[0]
    layer = proposers.block_layer_class()
    rows, runs = [], []
    for ctx in (int(c) for c in args.contexts.split(",")):
        ids = encode_prompt(t.tokenizer, (TOPIC * (ctx // 20 + 1)))
        ids = ids[-ctx:] if len(ids) > ctx else ids
        rates: dict[tuple[str, bool], list[float]] = {}
        tokens: dict[tuple[str, bool], list[int]] = {}
        for rep in range(2 * args.reps):
            for in_place in ((True, False) if rep % 2 == 0 else (False, True)):
                layer.IN_PLACE = in_place
                for kind, prop in (("plain", None), ("draft head", head)):
                    d = SpeculativeDecoder(t, prop, ids, gamma=gamma, max_new_tokens=args.max_new, stop_on_eos=False)
                    d.prefill()
                    t0 = time.perf_counter()
                    r = d.run()
                    rates.setdefault((kind, in_place), []).append(len(r.token_ids) / (time.perf_counter() - t0))
                    tokens[(kind, in_place)] = r.token_ids
        layer.IN_PLACE = True
        for kind in ("plain", "draft head"):
            a = statistics.median(rates[(kind, True)])
            b = statistics.median(rates[(kind, False)])
            rows.append({"context": len(ids), "method": kind, "in_place_tokens_per_s": a, "concatenated_tokens_per_s": b,
                         "ratio": a / b, "same_tokens": tokens[(kind, True)] == tokens[(kind, False)]})
            runs.append({"context": len(ids), "method": kind, "in_place": rates[(kind, True)],
                         "concatenated": rates[(kind, False)]})
            print(f"context {len(ids)}, {kind}: in place {a:.1f} tok/s, concatenated {b:.1f} ({a / b:.3f}×)", flush=True)
    meta = {**machine_meta(t), "date": time.strftime("%Y-%m-%d %H:%M"), "reps": args.reps, "max_new": args.max_new,
            "gamma": gamma, "command": " ".join(["benchmarks/bench_kv_block.py", *sys.argv[1:]])}
    name = args.out or f"kv_block_{machine_slug()}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2))
    md = [f"# The KV cache written in place against concatenated ({meta['cpu']}, {meta['date']})", "",
          f"`{meta['command']}`: {args.max_new} greedy tokens after each prompt, A B B A × {args.reps}, decode "
          f"tokens/s (after the prefill), medians; the draft head at γ {gamma}.", "", machine_line(meta), "",
          "| context (tokens) | method | in place tok/s | concatenated tok/s | in place ÷ concatenated | same tokens |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['context']} | {r['method']} | {r['in_place_tokens_per_s']:.1f} | "
                  f"{r['concatenated_tokens_per_s']:.1f} | {r['ratio']:.3f}× | {'yes' if r['same_tokens'] else 'NO'} |")
    (RESULTS / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
