"""The compute path on this machine: PyTorch's default (MKL), oneDNN and the streaming kernel, side by side in one
process.

Measures, alternating the paths rep by rep (``engine/decoding/compute/apply.py``'s ``apply_path``):
1. the LM head product (49152 × 576) for 1, 2, 3, 8 and 16 rows;
2. a whole target pass over n = 1, 2, 3, 4, 9, 16 new tokens after 100 cached tokens, and a 9-node token
   tree's verify pass (tree attention mask, ``engine.decoding.attention``);
3. plain greedy decoding (this engine, 64 new tokens) in tokens/s, and as a share of the machine's read
   bandwidth: the bytes a step reads × tokens/s ÷ the bandwidth of reading 1 GiB of fp32 (``torch.sum``, best of
   5); the bytes are the fp32 parameters, less what exact compact copies save on the stream path;
   transformers' own ``generate`` beside it on the same path.

    python benchmarks/bench_compute.py [--reps 7] [--threads N] [--out PATH_WITHOUT_SUFFIX]

Writes benchmarks/results/compute.json and compute.md (``--out`` for others; the shipped results name their machine,
``compute_amd-epyc``, ``compute_xeon``). Run it with nothing else running.
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
import torch.nn.functional as F  # noqa: E402

from benchmarks.machine import machine_line, machine_meta  # noqa: E402
from engine.decoding import compute  # noqa: E402
from engine.decoding.attention import fed_visibility, model_mask, tree_visibility  # noqa: E402
from engine.decoding.models import load_model  # noqa: E402
from engine.decoding.speculative import encode_prompt, generate  # noqa: E402

PATHS = tuple(p for p in compute.PATHS if p != "stream" or compute.stream_kernel() is not None)
NAMES = {"default": "default (MKL)", "onednn": "oneDNN", "stream": "stream"}
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 4, 5]  # 9 nodes, depth 4, as an EAGLE-2 tree of branching 2


def read_bandwidth_gbs(reps: int = 5) -> float:
    """GB/s of a 1 GiB fp32 ``torch.sum`` (best of ``reps``)."""
    x = torch.ones(256 * 1024 * 1024)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


@torch.inference_mode()
def lm_head_ms(target, rows=(1, 2, 3, 8, 16), reps: int = 7) -> dict:
    w = target.model.get_output_embeddings().weight.detach()
    op = compute.onednn._ONEDNN_OP
    stream = compute.stream_kernel()
    out = {p: {r: [] for r in rows} for p in PATHS}
    for rep in range(reps + 1):
        for p in (PATHS if rep % 2 else PATHS[::-1]):
            for r in rows:
                x = torch.randn(1, r, w.shape[1])
                t0 = time.perf_counter()
                if p == "default":
                    F.linear(x, w)
                elif p == "stream":
                    stream(x[0], w, None)
                else:
                    op(x, w, None, "none", [], "")
                if rep:
                    out[p][r].append((time.perf_counter() - t0) * 1e3)
    return {p: {r: round(statistics.median(v), 3) for r, v in d.items()} for p, d in out.items()}


@torch.inference_mode()
def pass_ms(target, sizes=(1, 2, 3, 4, 9, 16), reps: int = 7, context: int = 100) -> dict:
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (1, context + max(sizes)), generator=g)
    out = {p: {**{n: [] for n in sizes}, "tree9": []} for p in PATHS}
    vis = tree_visibility(TREE_PARENTS)
    depth = [1, 2, 2, 3, 3, 3, 4, 4, 4]
    caches = {}
    for p in PATHS:
        compute.apply_path(target.model, p)
        caches[p] = DynamicCache()
        target.model(input_ids=ids[:, :context], cache=caches[p], use_cache=True, logits_to_keep=1)
    for rep in range(reps + 1):
        for p in (PATHS if rep % 2 else PATHS[::-1]):
            compute.apply_path(target.model, p)
            cache = caches[p]
            for n in sizes:
                t0 = time.perf_counter()
                target.model(input_ids=ids[:, context:context + n], cache=cache, use_cache=True, logits_to_keep=n)
                dt = (time.perf_counter() - t0) * 1e3
                cache.crop(-n)
                if rep:
                    out[p][n].append(dt)
            t0 = time.perf_counter()  # the tree's verify pass: mask and position ids built as the engine does
            mask = model_mask(fed_visibility(vis, torch.ones(1, context, dtype=torch.bool)), target.model)
            pos = torch.tensor([[context - 1 + d for d in depth]])
            target.model(input_ids=ids[:, context:context + 9], cache=cache, use_cache=True, logits_to_keep=9,
                         attention_mask=mask, position_ids=pos)
            dt = (time.perf_counter() - t0) * 1e3
            cache.crop(-9)
            if rep:
                out[p]["tree9"].append(dt)
    return {p: {str(k): round(statistics.median(v), 2) for k, v in d.items()} for p, d in out.items()}


def decode_tps(target, prompt: str, n: int, reps: int) -> dict:
    """Plain greedy decoding on each path, alternating, by this engine and by transformers' ``generate``; on
    the fast paths also this engine with transformers' own decoder layers instead of the lean ones
    (``compute.lean._lean_layers``: what the lean layers buy). Tokens/s counts the whole run (prefill included)
    and, for this engine, the decode steps alone: (n − 1) tokens ÷ (total − prefill) time, each step reading
    every weight once."""
    ids = encode_prompt(target.tokenizer, prompt)
    kinds = [(p, "engine") for p in PATHS] + [(p, "engine, transformers' layers") for p in PATHS if p != "default"]
    kinds += [(p, "transformers") for p in PATHS]
    out = {f"{p} {kind}": [] for p, kind in kinds}
    steps = {f"{p} {kind}": [] for p, kind in kinds if kind != "transformers"}
    texts = {}
    for rep in range(reps + 1):
        for p, kind in (kinds if rep % 2 else kinds[::-1]):
            key = f"{p} {kind}"
            compute.apply_path(target.model, p)
            if kind == "transformers":
                with torch.inference_mode():
                    x = torch.tensor([ids])
                    t0 = time.perf_counter()
                    o = target.model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                              pad_token_id=target.tokenizer.pad_token_id)
                    dt = time.perf_counter() - t0
                if rep:
                    out[key].append(n / dt)
                texts[key] = o[0, len(ids):].tolist()
                continue
            if kind != "engine":
                compute.lean._lean_layers(target.model, on=False)
            res = generate(target, None, ids, max_new_tokens=n, stop_on_eos=False)
            if rep:
                out[key].append(res.stats.tokens_per_s)
                steps[key].append((n - 1) / ((res.stats.total_ms - res.stats.prefill_ms) / 1000))
            texts[key] = res.token_ids
    ref = texts["default engine"]
    return {k: {"tokens_per_s": round(statistics.median(v), 2),
                "decode_steps_tokens_per_s": round(statistics.median(steps[k]), 2) if k in steps else None,
                "identical_to_default_engine": texts[k] == ref} for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compute"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if compute.onednn._ONEDNN_OP is None:
        print("this PyTorch build has no oneDNN linear op: nothing to compare", file=sys.stderr)
        return 2
    target = load_model("embedded", device="cpu")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), **machine_meta(target)}
    chosen = target.compute.path
    params = sum(p.numel() * p.element_size() for p in target.model.parameters())
    # bytes a decode step reads per path: the stream path reads a weight's exact compact copy instead of its fp32
    # values where it has one (compute.compact_weight: the embedded model's LM head as int8 blocks)
    forms = {id(f): (w, f) for m in compute.apply._linears(target.model)
             for w in (m.weight, m.__dict__.get("_fused_weight")) if w is not None
             for f in [w.__dict__.get(compute.COMPACT_ATTR)] if f is not None}
    saved = sum(w.numel() * w.element_size() - f.nbytes for w, f in forms.values())
    read_bytes = {p: params - (saved if p == "stream" else 0) for p in PATHS}
    bw = read_bandwidth_gbs()
    res = {"meta": meta, "param_bytes": params, "read_bytes_per_token": read_bytes, "read_bandwidth_gbs": round(bw, 2),
           "lm_head_ms": lm_head_ms(target, reps=args.reps), "pass_ms": pass_ms(target, reps=args.reps),
           "decode": decode_tps(target, "Explain in a few sentences why the sky is blue.", args.max_new_tokens,
                                max(2, args.reps // 2))}
    compute.apply_path(target.model, chosen)
    for k, d in res["decode"].items():
        nbytes = read_bytes.get(k.split()[0], params)
        d["share_of_read_bandwidth"] = round(nbytes * d["tokens_per_s"] / (bw * 1e9), 3)
        if d["decode_steps_tokens_per_s"] is not None:
            d["decode_steps_share_of_read_bandwidth"] = round(nbytes * d["decode_steps_tokens_per_s"] / (bw * 1e9), 3)
    meta["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    pm, lh = res["pass_ms"], res["lm_head_ms"]
    cols = " | ".join(NAMES[p] for p in PATHS)
    sep = "|---" * (len(PATHS) + 1) + "|"
    lines = [f"# Compute path: {', '.join(NAMES[p] for p in PATHS)} linears ({meta['date']})", "",
             machine_line(meta), f"`{meta['command']}`; medians of {args.reps} alternating reps. "
             f"Read bandwidth (1 GiB fp32 sum, best of 5): {bw:.1f} GB/s; parameters {params / 1e6:.0f} MB (fp32); "
             f"bytes a decode step reads: {read_bytes['stream'] / 1e6:.0f} MB on the stream path (exact compact copies "
             f"of {len(forms)} weight(s), `compute.compact_weight`), {params / 1e6:.0f} MB on the others. A share of "
             "the read bandwidth is those bytes × tokens/s ÷ the sum's bandwidth.", "",
             f"Chosen on this machine: {chosen} ({target.compute.reason}).", "",
             "## The LM head product (49152 × 576), ms", "", f"| rows | {cols} |", sep]
    lines += [f"| {r} | " + " | ".join(f"{lh[p][r]:.2f}" for p in PATHS) + " |" for r in lh["default"]]
    lines += ["", "## A target pass after 100 cached tokens, ms (× one token)", "",
              f"| tokens in the pass | {cols} |", sep]
    for k in pm["default"]:
        label = "9-node tree (tree mask)" if k == "tree9" else k
        lines.append(f"| {label} | " + " | ".join(f"{pm[p][k]:.1f} ({pm[p][k] / pm[p]['1']:.2f}×)" for p in PATHS)
                     + " |")
    lines += ["", f"## Plain greedy decoding, {args.max_new_tokens} new tokens", "",
              "Whole run: new tokens ÷ wall time, prefill included. Decode steps: (n − 1) ÷ (wall − prefill), "
              "each step reading every weight once. \"transformers' layers\": this engine with transformers' own "
              "decoder-layer forward instead of the lean one (`compute.lean._lean_forward`).", "",
              "| path, decoder | tokens/s | share of read bandwidth | decode steps: tokens/s | share | "
              "same tokens as default engine |", "|---|---|---|---|---|---|"]

    def _steps(d):
        if d["decode_steps_tokens_per_s"] is None:
            return "– | –"
        return f"{d['decode_steps_tokens_per_s']:.1f} | {d['decode_steps_share_of_read_bandwidth']:.0%}"

    lines += [f"| {k} | {d['tokens_per_s']:.1f} | {d['share_of_read_bandwidth']:.0%} | {_steps(d)} | "
              f"{'yes' if d['identical_to_default_engine'] else 'no'} |" for k, d in res["decode"].items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
