"""Speculative decoding speed on the embedded target, side by side in one process.

For each prompt and method, runs are alternated (A, B, C, ... then again) so machine noise hits every
method alike; we report median tokens/s over repetitions, ratios to plain decoding, and whether each
greedy output is identical to plain decoding's.

Methods: our plain decoding (baseline through the same KV-cache code), transformers' plain greedy
``generate``, our engine with each proposer, and transformers' own assisted generation
(``assistant_model``), prompt lookup (``prompt_lookup_num_tokens``) and early exit
(``assistant_early_exit``) at the same γ with a constant schedule.

    python benchmarks/bench_speculative.py [--reps 3] [--max-new-tokens 96] [--gamma 4] [--threads N]
        [--device cpu|cuda] [--dtype fp32|bf16|fp16] [--split] [--out PATH_WITHOUT_SUFFIX]

``--split`` times every top-level forward call of the target and draft models (hooks) and reports
each method's time outside them.

Writes benchmarks/results/speculative.json and speculative.md (or ``--out`` + .json / .md; the shipped results name
their machine, ``speculative_amd-epyc``, ``speculative_h200``).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.machine import machine_line, machine_meta  # noqa: E402
from engine.decoding.models import EMBEDDED_DRAFT, EMBEDDED_DRAFT_DIR, EMBEDDED_HEAD_DIR, load_model  # noqa: E402
from engine.decoding.proposers import PromptLookupProposer  # noqa: E402
from engine.decoding.drafts import make_proposer  # noqa: E402
from engine.decoding.speculative import encode_prompt, generate  # noqa: E402

PROMPTS = {
    "chat": "Explain in a few sentences why the sky is blue.",
    # the embedded model answers this one in prose (no code to copy): kept as the hard case
    "code-edit (rename)": ("Rename the variable `total` to `acc` in this function and return the code:\n\n"
                           "def sum_list(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
                           "    return total\n"),
    "code-edit (docstring)": ("Add a docstring to this function. Return the whole function.\n\n"
                              "def mean(values):\n    if not values:\n        raise ValueError('empty')\n"
                              "    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"),
    "code-edit (type hints)": ("Add type hints to this Python function and return the full code:\n\n"
                               "def scale(points, factor):\n    result = []\n    for x, y in points:\n"
                               "        result.append((x * factor, y * factor))\n    return result\n"),
}


def hf_generate(target, ids, n, **kw):
    gen_kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=target.tokenizer.pad_token_id)
    gen_kw.update(kw)
    out = target.model.generate(torch.tensor([ids], device=target.device), **gen_kw)
    return out[0, len(ids):].tolist()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", default=",".join(PROMPTS), help="comma-separated names from PROMPTS")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--head-gamma", type=int, default=0, help="γ for the draft head (0: --gamma)")
    ap.add_argument("--lookup-gamma", type=int, default=0, help="γ for prompt lookup, ours and transformers' "
                    "(0: --gamma)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--methods", default="", help="a regular expression: run only the methods whose name it "
                    "matches (e.g. 'plain|prompt lookup$|trained draft'); 'ours: plain' always runs")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16 (target and draft alike)")
    ap.add_argument("--split", action="store_true", help="also time every forward call of the target and "
                    "draft models (forward hooks) and report each method's time outside them: the loop's own "
                    "overhead, the only part an engine that runs transformers' forward can cut")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model("embedded", device=args.device, dtype=args.dtype)
    have_draft = (EMBEDDED_DRAFT_DIR / "config.json").is_file()
    draft = load_model(EMBEDDED_DRAFT, device=args.device, dtype=args.dtype) if have_draft else None
    if target.device.type == "cuda":
        hardware = f"{torch.cuda.get_device_name(target.device)} (CUDA {torch.version.cuda})"
    else:
        hardware = f"CPU, {torch.get_num_threads()} threads"
    g, n = args.gamma, args.max_new_tokens
    ee = 10

    def ours(kind, d=None, gamma=None):
        return lambda ids: generate(target, make_proposer(kind, target, d), ids, gamma=gamma or g,
                                    max_new_tokens=n).token_ids

    lg = args.lookup_gamma or g
    vocab = target.model.get_output_embeddings().weight.shape[0]

    methods = {
        "ours: plain": ours("none"),
        "hf: plain generate": lambda ids: hf_generate(target, ids, n),
        # the same proposer as transformers': a fixed number of lookup tokens per round, its n-gram sizes
        # (2 down to 1) and its choice among matches (the first one); so the proposals are identical
        # (tests/test_speculative.py checks this) and the ratio measures the engine, not the proposer ...
        "ours: prompt lookup": lambda ids: generate(
            target, PromptLookupProposer(vocab, max_ngram=2, min_ngram=1, match="first",
                                                     stop_ids=target.eos_token_ids), ids, gamma=lg,
            max_new_tokens=n).token_ids,
        "hf: prompt lookup": lambda ids: hf_generate(target, ids, n, prompt_lookup_num_tokens=lg),
        # ... and the engine's default "ngram" (adaptive length)
        "ours: prompt lookup, adaptive length": ours("ngram", gamma=lg),
        f"ours: early exit {ee}": ours(f"early-exit:{ee}"),
        f"hf: early exit {ee}": lambda ids: hf_generate(
            target, ids, n, assistant_early_exit=ee, num_assistant_tokens=g,
            num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0),
    }
    if (EMBEDDED_HEAD_DIR / "head_config.json").is_file():
        # no transformers equivalent: an EAGLE-style head needs the target's hidden states each round
        methods["ours: draft head (EAGLE-style)"] = lambda ids: generate(
            target, make_proposer("embedded-head", target, length="fixed"), ids, gamma=args.head_gamma or g,
            max_new_tokens=n).token_ids
    if draft is not None:
        # transformers reads these from the ASSISTANT's generation config (generate kwargs are ignored
        # there: with them alone it drafted 1 token per round, checked by counting forward calls)
        agc = draft.model.generation_config
        agc.num_assistant_tokens, agc.num_assistant_tokens_schedule = g, "constant"
        agc.assistant_confidence_threshold = 0.0
        methods["ours: trained draft"] = ours("model", draft)
        methods["hf: trained draft (assisted)"] = lambda ids: hf_generate(target, ids, n,
                                                                          assistant_model=draft.model)

    clock = {"target": [0.0, 0], "draft": [0.0, 0]}  # seconds, calls: top-level forward calls only
    if args.split:
        for name, lm in [("target", target), ("draft", draft)]:
            if lm is None:
                continue
            started = []

            def pre(_m, _a, started=started):
                if lm.device.type == "cuda":
                    torch.cuda.synchronize()
                started.append(time.perf_counter())

            def post(_m, _a, _o, started=started, name=name, lm=lm):
                if lm.device.type == "cuda":
                    torch.cuda.synchronize()
                clock[name][0] += time.perf_counter() - started.pop()
                clock[name][1] += 1

            lm.model.register_forward_pre_hook(pre)
            lm.model.register_forward_hook(post)

    if args.methods:
        keep = re.compile(args.methods)
        methods = {m: fn for m, fn in methods.items() if m == "ours: plain" or keep.search(m)}
    results = {}
    for pname in args.prompts.split(","):
        prompt = PROMPTS[pname]
        ids = encode_prompt(target.tokenizer, prompt)
        times = {m: [] for m in methods}
        splits = {m: [] for m in methods}
        outputs = {}
        for m, fn in methods.items():  # warm-up (and the output to compare)
            try:
                outputs[m] = fn(ids)
            except Exception as e:  # noqa: BLE001 - a method transformers cannot run is reported
                outputs[m] = f"error: {type(e).__name__}: {e}"
        for rep in range(args.reps):
            for m, fn in methods.items():
                if isinstance(outputs[m], str):
                    continue
                for c in clock.values():
                    c[:] = [0.0, 0]
                t0 = time.perf_counter()
                out = fn(ids)
                times[m].append((time.perf_counter() - t0, len(out)))
                splits[m].append({k: tuple(c) for k, c in clock.items()})
                print(f"[{pname} rep {rep}] {m}: {len(out) / times[m][-1][0]:.1f} tok/s", flush=True)
        ref = outputs["ours: plain"]
        rows = {}
        for m in methods:
            if isinstance(outputs[m], str):
                rows[m] = {"error": outputs[m]}
                continue
            tps = statistics.median(k / t for t, k in times[m])
            rows[m] = {"tokens_per_s": tps, "tokens": len(outputs[m]), "identical_to_plain": outputs[m] == ref}
            if args.split:
                # medians over reps, in ms: wall time, target/draft forward time, and the rest (the loop)
                rows[m]["split_ms"] = {
                    "wall": 1000 * statistics.median(t for t, _ in times[m]),
                    "target_forward": 1000 * statistics.median(s["target"][0] for s in splits[m]),
                    "target_calls": statistics.median(s["target"][1] for s in splits[m]),
                    "draft_forward": 1000 * statistics.median(s["draft"][0] for s in splits[m]),
                    "draft_calls": statistics.median(s["draft"][1] for s in splits[m]),
                    "outside": 1000 * statistics.median(t - s["target"][0] - s["draft"][0]
                                                        for (t, _), s in zip(times[m], splits[m]))}
        base = rows["ours: plain"]["tokens_per_s"]
        for m, r in rows.items():
            if "tokens_per_s" in r:
                r["speedup_vs_plain"] = r["tokens_per_s"] / base
        for ours_m, hf_m in [("ours: prompt lookup", "hf: prompt lookup"),
                             # default against default: our "ngram" draft against transformers' only rule
                             ("ours: prompt lookup, adaptive length", "hf: prompt lookup"),
                             (f"ours: early exit {ee}", f"hf: early exit {ee}"),
                             ("ours: trained draft", "hf: trained draft (assisted)"),
                             ("ours: plain", "hf: plain generate")]:
            if "tokens_per_s" in rows.get(ours_m, {}) and "tokens_per_s" in rows.get(hf_m, {}):
                rows[ours_m]["ratio_vs_transformers"] = rows[ours_m]["tokens_per_s"] / rows[hf_m]["tokens_per_s"]
        results[pname] = rows

    meta = {"gamma": g, "lookup_gamma": lg, "head_gamma": args.head_gamma or g, "max_new_tokens": n, "reps": args.reps, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "machine": platform.machine(), "cpus": torch.get_num_threads(),
            "device": str(target.device), "dtype": args.dtype, "hardware": hardware,
            "transformers": __import__("transformers").__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), **machine_meta(target)}
    meta["threads"] = torch.get_num_threads()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = [f"# Speculative decoding benchmark ({meta['date']})", "",
             f"Embedded SmolLM2-135M-Instruct, {args.dtype} on {hardware}, torch {torch.__version__}, "
             f"transformers {meta['transformers']}, greedy, γ = {g} (prompt lookup {lg}, draft head "
             f"{meta['head_gamma']}), {n} new tokens, median of "
             f"{args.reps} alternating reps. `{meta['command']}`", "", machine_line(meta), "",
             "× transformers: against the same proposer in transformers (for our adaptive prompt lookup, "
             "against transformers' prompt lookup at the same γ: default against default).", ""]
    for pname, rows in results.items():
        lines += [f"## {pname}", "", "| method | tokens/s | × plain | × transformers | identical |",
                  "|---|---|---|---|---|"]
        for m, r in rows.items():
            if "error" in r:
                lines.append(f"| {m} | {r['error'][:80]} | | | |")
                continue
            vs = r.get("ratio_vs_transformers")
            lines.append(f"| {m} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f} | "
                         f"{'' if vs is None else f'{vs:.2f}'} | {'yes' if r['identical_to_plain'] else 'NO'} |")
        lines.append("")
        if args.split:
            lines += ["Where the time goes (medians over reps, ms; forward = the models' top-level forward "
                      "calls, timed by hooks; outside = everything else: drafting logic, judging, cache "
                      "crops, transformers' generate machinery):", "",
                      "| method | wall ms | target forward ms (calls) | draft forward ms (calls) | outside ms | "
                      "outside % |", "|---|---|---|---|---|---|"]
            for m, r in rows.items():
                sp = r.get("split_ms")
                if not sp or sp["target_calls"] == 0:
                    continue  # early exit and the draft head call the decoder directly: not hooked
                lines.append(f"| {m} | {sp['wall']:.0f} | {sp['target_forward']:.0f} ({sp['target_calls']:.0f}) | "
                             f"{sp['draft_forward']:.0f} ({sp['draft_calls']:.0f}) | {sp['outside']:.0f} | "
                             f"{100 * sp['outside'] / sp['wall']:.1f} |")
            lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
