"""What batch invariance costs in the room's shared pass: the decode attention on this project's kernel
(``engine/decoding/compute/invariant_attention.cpp``) against the per-row PyTorch SDPA fallback (a call per row,
laid out as its lone pass), both exact by construction (``engine/decoding/compute/invariant.py``,
``invariant_attention``).

K readers of the Live page's default settings (the trained head, the chat preset, temperatures alternating 0 and
0.8, reader i seeded i) decode together in one in-process ``Room``; each variant runs ``--reps`` times in
alternating order (A B B A …). Per run: the median full pass (every reader fed), its target forward and its
batched drafting (ms), tokens/s, and whether every reader's tokens equal the same reader decoded alone (the
attention of each variant). The room's invariance self-check (``invariance.invariance_check``) is printed too.

Usage (an idle machine): ``flock -x /tmp/speedup-cpu.lock .venv/bin/python benchmarks/bench_invariant.py``
(``--readers 16 --max-new 48 --reps 2``) writes benchmarks/results/invariant_<cpu>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
VARIANTS = ("kernel", "sdpa")


def _in_thread(fn):
    """Run torch work in a thread that ends (see bench_room: a live thread's parallel ops slow every other
    thread's under libgomp)."""
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("v", fn()))
    th.start()
    th.join()
    return out["v"]


def _set_variant(name: str, kernel_op) -> None:
    from engine.decoding import compute

    compute.extension._STREAM["attention"] = kernel_op if name == "kernel" else None


def run_room(target, k: int, max_new: int) -> dict:
    """K readers together in a fresh room: the median full pass and its parts, tokens/s, the readers' tokens."""
    from engine.decoding.drafts import make_proposer
    from engine.decoding.models import EMBEDDED_HEAD
    from engine.decoding.sampling import SamplingConfig
    from engine.decoding.scheduler import Room
    from engine.decoding.speculative import SpeculativeDecoder, encode_prompt
    from engine.explain.analytic import default_gamma_here
    from engine.explain.presets import preset_text

    ids = encode_prompt(target.tokenizer, preset_text("chat"))
    gamma = default_gamma_here(EMBEDDED_HEAD)[0]

    def decoders():
        return [SpeculativeDecoder(target, make_proposer(EMBEDDED_HEAD, target), ids, gamma=gamma,
                                   sampling=SamplingConfig(temperature=0.0 if i % 2 == 0 else 0.8), seed=i,
                                   max_new_tokens=max_new) for i in range(k)]

    alone = _in_thread(lambda: [d.run().token_ids for d in decoders()])
    room = Room(target, no_draft_above=None, warm_up=True)
    try:
        decs = _in_thread(decoders)
        ths = [threading.Thread(target=lambda d=d: room.prefill(d)) for d in decs]
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=900)
        t0 = time.perf_counter()
        got: dict[int, list[int]] = {}
        ths = [threading.Thread(target=lambda i=i, d=d: got.__setitem__(i, room.run(d).token_ids))
               for i, d in enumerate(decs)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=900)
        elapsed = time.perf_counter() - t0
        full = [p for p in room.passes if p.rows == k and p.fed_rows == k]
        med = (lambda xs: statistics.median(xs) if xs else None)
        return {"elapsed_s": elapsed, "tokens_per_s": sum(len(d.new_ids) for d in decs) / elapsed,
                "full_passes": len(full), "pass_ms": med([p.ms for p in full]),
                "target_ms": med([p.target_ms for p in full]), "draft_ms": med([p.draft_ms for p in full]),
                "equal_to_alone": sum(got.get(i) == alone[i] for i in range(k))}
    finally:
        room.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None, help="results name (default invariant_<cpu>)")
    args = ap.parse_args()

    import torch

    from engine.decoding import compute
    from engine.decoding.models import EMBEDDED, load_model
    from benchmarks.machine import machine_slug
    from engine.decoding.invariance import invariance_check

    target = _in_thread(lambda: load_model(EMBEDDED))
    kernel_op = compute.extension._STREAM.get("attention")
    if kernel_op is None:
        sys.exit(f"error: the streaming kernel's attention is not built here ({compute.stream_problem()})")
    check = _in_thread(lambda: invariance_check(target))
    print(f"self-check: {check.label()}")
    order = [VARIANTS[[0, 1, 1, 0][i % 4]] for i in range(2 * args.reps)]  # A B B A …
    runs = []
    for name in order:
        _set_variant(name, kernel_op)
        r = _in_thread(lambda: run_room(target, args.readers, args.max_new))
        r["variant"] = name
        runs.append(r)
        print(f"{name:7s} pass {r['pass_ms']:.1f} ms (target {r['target_ms']:.1f}, draft {r['draft_ms']:.1f}), "
              f"{r['tokens_per_s']:.1f} tok/s, {r['equal_to_alone']}/{args.readers} equal to alone", flush=True)
    _set_variant("kernel", kernel_op)
    summary = {}
    for name in VARIANTS:
        mine = [r for r in runs if r["variant"] == name]
        summary[name] = {key: statistics.median(r[key] for r in mine)
                         for key in ("pass_ms", "target_ms", "draft_ms", "tokens_per_s")}
        summary[name]["equal_to_alone"] = min(r["equal_to_alone"] for r in mine)
    head = {"cpu": compute.cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "readers": args.readers, "max_new": args.max_new,
            "reps": args.reps, "self_check": check.to_dict()}
    name = args.out or f"invariant_{machine_slug()}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"settings": head, "runs": runs, "summary": summary}, indent=2))
    k, s = summary["kernel"], summary["sdpa"]
    md = [f"# Batch-invariant attention in the room's pass ({head['cpu']}, {head['threads']} threads, {head['date']})",
          "", f"`benchmarks/bench_invariant.py --readers {args.readers} --max-new {args.max_new} --reps {args.reps}`; "
          f"{args.readers} readers of the Live page's default settings in one in-process room, variants alternating; "
          "medians of the full passes (every reader fed).", "",
          f"Self-check at the room's start: {check.label()}", "",
          "| attention | full pass ms | target forward ms | batched drafting ms | tok/s | texts equal to alone |",
          "|---|---|---|---|---|---|"]
    for label, x in (("this project's kernel (`invariant_attention.cpp`)", k), ("a PyTorch SDPA call per row", s)):
        md.append(f"| {label} | {x['pass_ms']:.1f} | {x['target_ms']:.1f} | {x['draft_ms']:.1f} | "
                  f"{x['tokens_per_s']:.1f} | {x['equal_to_alone']}/{args.readers} |")
    md += ["", f"Kernel ÷ per-row SDPA, full pass: {k['pass_ms'] / s['pass_ms']:.3f}."]
    (RESULTS / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
