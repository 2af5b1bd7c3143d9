"""The shipped draft head (assets/smollm2-head) on held-out prompts: acceptance, step cost, speedup.

Held-out prompts come from ``engine.training.draft_data.build_prompts(n, "heldout")``: topics never used in
training. Everything runs through the engine, alternating methods prompt by prompt:

1. greedy: plain decoding, then the head at each γ in ``--gammas``; per γ the acceptance rate
   α̂ = accepted ÷ judged, tokens per target pass, wall-time speedup over plain decoding (sum of times),
   and whether every output is identical to plain decoding's;
2. T = 0.7: the same with sampling (same seed for both): α̂ and speedup;
3. draft step cost c: the head's single-pair step (its KV cache, one draft token incl. its LM-head rows)
   against the target's single-token decode step, alternately, medians.

    .venv/bin/python benchmarks/bench_head.py [--prompts 12] [--max-new-tokens 96] [--gammas 1,2,3,4]
        [--threads N] [--head embedded-head]

Writes benchmarks/results/head.json and head.md (``--out PATH`` for others; the shipped results name their machine,
``head_amd-epyc``, ``head_xeon``). ``--verify-only`` writes ``--verify-out`` (default ``verify_cost``); the app's
shipped fallback curve is ``verify_cost_amd-epyc.json``.
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

import torch  # noqa: E402

from benchmarks.machine import machine_line, machine_meta  # noqa: E402
from engine.decoding.compute import cpu_model  # noqa: E402,F401 - bench_medusa imports it from here
from engine.decoding.models import load_model  # noqa: E402
from engine.decoding.drafts import make_proposer  # noqa: E402
from engine.decoding.sampling import SamplingConfig  # noqa: E402
from engine.decoding.speculative import encode_prompt, generate  # noqa: E402
from engine.training.draft_data import build_prompts  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "head"


@torch.inference_mode()
def step_costs(target, head, prompt_ids: list[int], steps: int) -> dict:
    """Median ms of one target decode step and one head draft step (KV caches, batch 1), alternately; both in the
    batch-invariant layout the engine runs every decode pass in (``compute.batch_invariant``: on the "stream" path
    the fused layers), as ``CachedLM`` and ``FeatureHeadProposer`` run them."""
    from transformers import DynamicCache

    from engine.decoding.compute import batch_invariant

    ids = torch.tensor([prompt_ids])
    tc, hc = DynamicCache(), DynamicCache()
    dec = target.model.get_decoder()
    h = dec(input_ids=ids, cache=tc, use_cache=True).last_hidden_state
    y = head(ids[:, 1:], h[:, :-1], cache=hc)[:, -1:]
    t_tok = ids[:, -1:]
    tt, dt = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        with batch_invariant():
            out = target.model(input_ids=t_tok, cache=tc, use_cache=True)
        t_tok = out.logits[:, -1:].argmax(-1)
        t1 = time.perf_counter()
        j = int(head.logits(y[0, 0]).argmax())
        x = head.vocab_ids[j].view(1, 1)
        with batch_invariant():
            y = head(x, y, cache=hc, position_ids=torch.tensor([[hc.get_seq_length()]]))
        t2 = time.perf_counter()
        tt.append((t1 - t0) * 1e3)
        dt.append((t2 - t1) * 1e3)
    tm, dm = statistics.median(tt), statistics.median(dt)
    return {"target_step_ms": round(tm, 2), "head_step_ms": round(dm, 2), "c": round(dm / tm, 4), "steps": steps}


@torch.inference_mode()
def verify_costs(target, max_tokens: int = 8, reps: int = 15, context: int = 100) -> dict:
    """Median ms of one target pass over n = 1..max_tokens new tokens after a cached context (the verify
    pass of γ = n − 1), sizes interleaved so noise hits all alike; in the batch-invariant layout the engine's
    verify passes run in (``compute.batch_invariant``)."""
    from transformers import DynamicCache

    from engine.decoding.compute import batch_invariant

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (1, context + max_tokens), generator=g)
    times = {n: [] for n in range(1, max_tokens + 1)}
    for _ in range(reps):
        for n in times:
            cache = DynamicCache()
            target.model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
            t0 = time.perf_counter()
            with batch_invariant():
                target.model(input_ids=ids[:, context:context + n], cache=cache, use_cache=True, logits_to_keep=n)
            times[n].append((time.perf_counter() - t0) * 1e3)
    med = {n: statistics.median(v) for n, v in times.items()}
    return {"context": context, "reps": reps, "ms": {n: round(m, 2) for n, m in med.items()},
            "ratio_to_one_token": {n: round(m / med[1], 3) for n, m in med.items()}}


def acceptance_only(target, prompts: list[str], gammas: list[int], max_new: int, heads: list[str]) -> dict:
    """Greedy α̂ = accepted ÷ judged of each head at each γ over many prompts, and whether every output equals
    plain decoding's. No timing: the counts do not depend on the machine's load, so this can run on a busy
    machine and over more prompts than the timed comparison. Returns {"rows": {name: {...}}}; each row has
    accepted, judged, alpha and a 95 % Clopper-Pearson interval (scipy ``binomtest``; it treats positions
    as independent, which they are not quite, so read it as a rough guide)."""
    from scipy.stats import binomtest

    rows: dict[str, dict] = {}
    for spec in heads:
        for g in gammas:
            rows[f"{spec} γ={g}"] = {"head": spec, "gamma": g, "accepted": 0, "judged": 0, "identical": True}
    for i, p in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, p)
        base = generate(target, None, ids, max_new_tokens=max_new).token_ids
        for r in rows.values():
            prop = make_proposer(r["head"], target)
            prop.confidence_threshold = 0.0
            res = generate(target, prop, ids, gamma=r["gamma"], max_new_tokens=max_new)
            r["accepted"] += res.stats.accepted
            r["judged"] += res.stats.judged
            r["identical"] &= res.token_ids == base
        print(f"  prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    for r in rows.values():
        r["alpha"] = r["accepted"] / r["judged"] if r["judged"] else None
        if r["judged"]:
            ci = binomtest(r["accepted"], r["judged"]).proportion_ci(0.95)
            r["ci95"] = [ci.low, ci.high]
    return {"rows": rows}


def variant_name(g: int, conf: float) -> str:
    return f"head γ={g}" if conf == 0 else f"head γ={g}, confidence ≥ {conf:g}"


def run_compare(target, prompts, gammas, max_new, cfg: SamplingConfig, seed: int = 0,
                spec: str = "embedded-head", confidences=(0.0,), other_head: str = "") -> dict:
    """Alternate plain decoding and the head at each γ (and each confidence threshold, see
    ``FeatureHeadProposer``) on every prompt, and ``other_head`` (another head folder) at the first γ;
    totals per method."""
    rows = {"plain": {"ms": 0.0, "tokens": 0}}
    variants = [(variant_name(g, c), spec, g, c) for g in gammas for c in confidences]
    if other_head:
        variants.append((f"other head ({other_head}) γ={gammas[0]}", other_head, gammas[0], 0.0))
    for name, *_ in variants:
        rows[name] = {"ms": 0.0, "tokens": 0, "accepted": 0, "judged": 0, "drafted": 0, "passes": 0,
                      "identical": True}
    for p in prompts:
        ids = encode_prompt(target.tokenizer, p)
        t0 = time.perf_counter()
        base = generate(target, None, ids, sampling=cfg, seed=seed, max_new_tokens=max_new)
        rows["plain"]["ms"] += (time.perf_counter() - t0) * 1e3
        rows["plain"]["tokens"] += len(base.token_ids)
        for name, sp, g, c in variants:
            r = rows[name]
            prop = make_proposer(sp, target)
            prop.confidence_threshold = c
            t0 = time.perf_counter()
            res = generate(target, prop, ids, gamma=g, sampling=cfg, seed=seed, max_new_tokens=max_new)
            r["ms"] += (time.perf_counter() - t0) * 1e3
            r["tokens"] += len(res.token_ids)
            r["accepted"] += res.stats.accepted
            r["judged"] += res.stats.judged
            r["drafted"] += res.stats.drafted
            r["passes"] += res.stats.rounds
            r["identical"] &= res.token_ids == base.token_ids
    base_tps = rows["plain"]["tokens"] / rows["plain"]["ms"] * 1e3
    for name, r in rows.items():
        r["tokens_per_s"] = round(r["tokens"] / r["ms"] * 1e3, 2)
        r["speedup_vs_plain"] = round(r["tokens_per_s"] / base_tps, 3)
        if "judged" in r:
            r["alpha_hat"] = round(r["accepted"] / max(r["judged"], 1), 4)
            r["tokens_per_target_pass"] = round(r["tokens"] / max(r["passes"], 1), 3)
            r["drafted_per_pass"] = round(r["drafted"] / max(r["passes"], 1), 3)
            if not cfg.greedy:
                r.pop("identical")  # sampled outputs legitimately differ from plain decoding's
        r["ms"] = round(r["ms"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--gammas", default="1,2,3,4")
    ap.add_argument("--confidence", default="0", help="comma-separated confidence thresholds to compare "
                    "(0: propose all γ, the engine's default)")
    ap.add_argument("--steps", type=int, default=150, help="steps for the step-cost measurement")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--head", default="embedded-head", help="embedded-head or a head folder")
    ap.add_argument("--other-head", default="", help="another head folder, run at the first γ (A/B)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--acceptance-only", action="store_true",
                    help="greedy α̂ only (no timing) of --head (and --other-head) at each γ; writes "
                         "head_acceptance.json/.md")
    ap.add_argument("--verify-only", action="store_true",
                    help="only measure the target pass cost by tokens verified (--verify-out .json and .md)")
    ap.add_argument("--verify-out", default=str(OUT.parent / "verify_cost"),
                    help="with --verify-only: output path without suffix (another machine: another name)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.verify_only:
        target = load_model("embedded", device="cpu")
        vc = verify_costs(target)
        out = Path(args.verify_out)
        vc["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                      "load_avg_1min": os.getloadavg()[0], **machine_meta(target)}
        out.with_suffix(".json").write_text(json.dumps(vc, indent=2) + "\n")
        lines = [f"# Target pass cost by tokens verified ({vc['meta']['date']})", "",
                 f"Embedded target, fp32, {vc['meta']['cpu']}, {vc['meta']['threads']} threads, after {vc['context']} cached tokens, "
                 f"median of {vc['reps']} interleaved reps. `{vc['meta']['command']}`", "", machine_line(vc["meta"]), "",
                 "| tokens in the pass (γ + 1) | ms | × one token |", "|---|---|---|"]
        lines += [f"| {n} | {vc['ms'][n]:.1f} | {vc['ratio_to_one_token'][n]:.2f} |" for n in vc["ms"]]
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    gammas = [int(g) for g in args.gammas.split(",")]
    target = load_model("embedded", device="cpu")
    if args.acceptance_only:
        prompts = [p["prompt"] for p in build_prompts(args.prompts, "heldout", seed=0)]
        heads = [args.head] + ([args.other_head] if args.other_head else [])
        acc = acceptance_only(target, prompts, gammas, args.max_new_tokens, heads)
        acc["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                       "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
        out = Path(args.out).parent / "head_acceptance"
        out.with_suffix(".json").write_text(json.dumps(acc, indent=2) + "\n")
        lines = [f"# Draft head acceptance, greedy ({acc['meta']['date']})", "",
                 f"{len(prompts)} held-out prompts × ≤ {args.max_new_tokens} new tokens, embedded target; counts "
                 f"only, no timing. `{acc['meta']['command']}`", "",
                 "| head, γ | accepted / judged | α̂ | 95 % interval (positions as independent) | identical to plain |",
                 "|---|---|---|---|---|"]
        for name, r in acc["rows"].items():
            ci = r.get("ci95")
            alpha = "—" if r["alpha"] is None else f"{r['alpha']:.4f}"
            interval = "" if ci is None else f"{ci[0]:.3f}–{ci[1]:.3f}"
            lines.append(f"| {name} | {r['accepted']} / {r['judged']} | {alpha} | {interval} | "
                         f"{'yes' if r['identical'] else 'no'} |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    head = make_proposer(args.head, target).head
    prompts = [p["prompt"] for p in build_prompts(args.prompts, "heldout", seed=0)]
    res = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                    "platform": platform.platform(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "load_avg_1min_start": os.getloadavg()[0], "prompts": len(prompts),
                    "max_new_tokens": args.max_new_tokens, "head": head.config, **machine_meta(target)}}
    print("greedy ...", file=sys.stderr, flush=True)
    confs = [float(c) for c in args.confidence.split(",")]
    res["greedy"] = run_compare(target, prompts, gammas, args.max_new_tokens, SamplingConfig(),
                                spec=args.head, confidences=confs, other_head=args.other_head)
    print("T=0.7 ...", file=sys.stderr, flush=True)
    res["t0.7"] = run_compare(target, prompts, gammas, args.max_new_tokens,
                               SamplingConfig(temperature=0.7), spec=args.head, confidences=confs,
                               other_head=args.other_head)
    res["step_cost"] = step_costs(target, head, encode_prompt(target.tokenizer, prompts[0]), args.steps)
    res["meta"]["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    sc = res["step_cost"]
    lines = [f"# Draft head benchmark ({res['meta']['date']})", "",
             f"Embedded SmolLM2-135M-Instruct target (CPU, {res['meta']['threads']} threads; its weights as the "
             f"machine line says), the shipped "
             f"EAGLE-style head, {len(prompts)} held-out prompts × {args.max_new_tokens} new tokens, methods "
             f"alternating prompt by prompt. `{res['meta']['command']}`", "", machine_line(res["meta"]), "",
             f"Draft step cost: head {sc['head_step_ms']} ms vs target {sc['target_step_ms']} ms per step → "
             f"**c = {sc['c']}** (median of {sc['steps']} alternating steps).", ""]
    for key, title in (("greedy", "Greedy (temperature 0)"), ("t0.7", "Temperature 0.7 (same seed)")):
        lines += [f"## {title}", "", "| method | tokens/s | × plain | α̂ (accepted ÷ judged) | tokens / target pass "
                  "| draft tokens / pass | identical to plain |", "|---|---|---|---|---|---|---|"]
        for name, r in res[key].items():
            ident = r.get("identical")
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f} | "
                         f"{r.get('alpha_hat', '')} | {r.get('tokens_per_target_pass', '')} | "
                         f"{r.get('drafted_per_pass', '')} | "
                         f"{'' if ident is None else ('yes' if ident else 'NO')} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
