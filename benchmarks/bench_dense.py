"""Released fp32 weights against kept ones: what letting the embedded model's fp32 layers go costs and saves.

The embedded model loads with its layers' fp32 storage released (``compute.dense.release_linear``: the streaming kernel
reads their exact GGUF Q4_1 forms at every row count, a prefill too). Kept: the same model with the fp32 weights back
(``compute.dense.restore_dense``): a prefill of more rows than the kernel's limit runs oneDNN on packed fp32 copies.

Per prompt length (``--lengths``): the prefill's time (one forward over the prompt, as a reader's first token waits
for) and plain decoding's tokens/s after it (``--max-new`` greedy tokens), the two ways alternating A B B A ``--reps``
times in one process, medians. Memory: a fresh process per way loads the model, prefills the longest prompt and
decodes; its peak and final RSS (VmHWM, VmRSS). Kept there means loaded without releasing (``use_path`` without
``release``), as every load was before.

Usage (an idle machine): ``flock -x /tmp/speedup-cpu.lock .venv/bin/python benchmarks/bench_dense.py``
writes benchmarks/results/dense_<machine>.json and .md (``--out NAME`` for another name).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
TEXT = ("Speculative decoding lets a small draft propose several tokens that the target model then checks in one "
        "pass, keeping exactly the tokens it would have produced itself. ") * 8

_MEMORY = """
import json, sys, torch
sys.path.insert(0, {root!r})
import engine.decoding.models as models
from engine.decoding.speculative import SpeculativeDecoder
if {kept!r}:  # the load as it was before weights were released: every fp32 weight kept from the start
    use_path = models.use_path
    models.use_path = lambda modules, choice, release=False: use_path(modules, choice)
t = models.load_model("embedded")
ids = t.tokenizer({text!r})["input_ids"][:{length}]
d = SpeculativeDecoder(t, None, ids, max_new_tokens={max_new}, stop_on_eos=False)
d.run()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({{k: int(status[k].split()[0]) // 1024 for k in ("VmHWM", "VmRSS")}}))
"""


def memory(kept: bool, length: int, max_new: int) -> dict:
    """Peak and final RSS (MB) of a fresh process that loads the model (fp32 weights ``kept`` or released), prefills
    ``length`` tokens and decodes ``max_new``."""
    code = _MEMORY.format(root=str(ROOT), kept=kept, text=TEXT, length=length, max_new=max_new)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="40,135", help="prompt lengths in tokens (default 40,135)")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3, help="A B B A pairs")
    ap.add_argument("--out", default=None, help="results name (default dense_<machine>)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    import torch

    from benchmarks.machine import machine_line, machine_meta, machine_slug
    from engine.decoding.compute import dense
    from engine.decoding.models import load_model
    from engine.decoding.speculative import SpeculativeDecoder

    ways = {"released": load_model("embedded"), "kept": load_model("embedded")}
    dense.restore_dense(ways["kept"].model)
    rows = []
    for length in lengths:
        ids = ways["released"].tokenizer(TEXT)["input_ids"][:length]
        prefill: dict[str, list[float]] = {w: [] for w in ways}
        decode: dict[str, list[float]] = {w: [] for w in ways}
        texts: dict[str, list[int]] = {}
        for rep in range(2 * args.reps):
            for way in (list(ways) if rep % 2 == 0 else list(ways)[::-1]):
                t = ways[way]
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    t.model(torch.tensor([ids]), logits_to_keep=1)
                    prefill[way].append((time.perf_counter() - t0) * 1e3)
                d = SpeculativeDecoder(t, None, ids, max_new_tokens=args.max_new, stop_on_eos=False)
                d.prefill()
                t0 = time.perf_counter()
                r = d.run()
                decode[way].append(len(r.token_ids) / (time.perf_counter() - t0))
                texts[way] = r.token_ids
        row = {"prompt_tokens": len(ids), **{f"{w}_prefill_ms": statistics.median(prefill[w]) for w in ways},
               **{f"{w}_decode_tokens_per_s": statistics.median(decode[w]) for w in ways},
               "same_tokens": texts["released"] == texts["kept"], "runs": {"prefill": prefill, "decode": decode}}
        rows.append(row)
        print(f"{len(ids)} tokens: prefill released {row['released_prefill_ms']:.0f} ms, kept "
              f"{row['kept_prefill_ms']:.0f} ms; decode {row['released_decode_tokens_per_s']:.1f} vs "
              f"{row['kept_decode_tokens_per_s']:.1f} tok/s", flush=True)
    meta = {**machine_meta(ways["released"]), "date": time.strftime("%Y-%m-%d %H:%M"), "reps": args.reps,
            "max_new": args.max_new, "released_bytes": ways["released"].compute.released_bytes,
            "command": " ".join(["benchmarks/bench_dense.py", *sys.argv[1:]])}
    del ways
    mem = {w: memory(w == "kept", max(lengths), args.max_new) for w in ("released", "kept")}
    meta["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    name = args.out or f"dense_{machine_slug()}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "memory": mem}, indent=2))
    md = [f"# Released fp32 weights against kept ones ({meta['cpu']}, {meta['date']})", "",
          f"`{meta['command']}`: the embedded model with its layers' fp32 storage released "
          f"({meta['released_bytes'] / 1e6:.0f} MB; every product of those layers on the streaming kernel's Q4_1 "
          "reads) against the same model with it kept (a prefill of more rows than the kernel's limit on oneDNN's "
          f"packed fp32 copies). A B B A × {args.reps} in one process, medians: the prefill (one forward over the "
          f"prompt) and plain decoding's tokens/s over {args.max_new} greedy tokens after it.", "",
          machine_line(meta), "",
          "| prompt tokens | prefill released | prefill kept | released ÷ kept | decode released | decode kept | "
          "same tokens |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['prompt_tokens']} | {r['released_prefill_ms']:.0f} ms | {r['kept_prefill_ms']:.0f} ms | "
                  f"{r['released_prefill_ms'] / r['kept_prefill_ms']:.2f}× the time | "
                  f"{r['released_decode_tokens_per_s']:.1f} tok/s | {r['kept_decode_tokens_per_s']:.1f} tok/s | "
                  f"{'yes' if r['same_tokens'] else 'no (a near tie in the prefill)'} |")
    md += ["", f"Memory, a fresh process per way (load, a {max(lengths)}-token prefill, {args.max_new} tokens):", "",
           "| way | peak RSS MB | RSS after MB |", "|---|---|---|"]
    md += [f"| {w} | {m['VmHWM']} | {m['VmRSS']} |" for w, m in mem.items()]
    (RESULTS / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
