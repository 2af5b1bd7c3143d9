"""The shipped draft (assets/smollm2-draft) against the embedded target: acceptance and step cost.

1. Held-out acceptance, teacher-forced along the target's own answers to held-out prompts (topics never
   used in training; ``engine.training.train_draft.evaluate_draft``): greedy α on greedy answers, α at T = 0.7
   (Σ min(p, q) of the T = 0.7 distributions, averaged over positions) along sampled answers (sampled at
   the training run's data temperature 0.8 when its cached held-out set is reused, else at 0.7; the JSON
   says which).
2. Draft step cost c = median draft per-token forward time ÷ median target per-token forward time, both
   with a KV cache, batch 1, CPU, measured alternately (target step, draft step, ...) over many steps.
3. A few real speculative runs with the engine (γ = 4, greedy), alternating with plain decoding on the
   same prompts: acceptance α̂ = accepted ÷ judged, tokens per target pass, wall-time ratio, and whether
   the output is identical. This is a quick check; the engine's own benchmark is the reference.

Usage: .venv/bin/python benchmarks/bench_draft.py [--draft embedded-draft] [--heldout N] [--steps N]
           [--runs N] [--heldout-file .cache/draft-train/heldout.pt] [--threads N]
Writes benchmarks/results/draft.json and draft.md.
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

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.decoding.models import load_model  # noqa: E402
from engine.training.draft_data import build_prompts, chat_ids, generate_samples, load_samples  # noqa: E402
from engine.training.train_draft import evaluate_draft  # noqa: E402

OUT = ROOT / "benchmarks" / "results"


@torch.no_grad()
def step_costs(target, draft, prompt_ids: list[int], steps: int) -> dict:
    """Median per-token decode time (ms) of target and draft, batch 1, KV cache, measured alternately."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt_ids])
    tc, dc = DynamicCache(), DynamicCache()
    t_out = target(input_ids=ids, cache=tc, use_cache=True, logits_to_keep=1)
    d_out = draft(input_ids=ids, cache=dc, use_cache=True, logits_to_keep=1)
    t_tok = t_out.logits[:, -1:].argmax(-1)
    d_tok = d_out.logits[:, -1:].argmax(-1)
    tt, dt = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        t_out = target(input_ids=t_tok, cache=tc, use_cache=True)
        t_tok = t_out.logits[:, -1:].argmax(-1)
        t1 = time.perf_counter()
        d_out = draft(input_ids=d_tok, cache=dc, use_cache=True)
        d_tok = d_out.logits[:, -1:].argmax(-1)
        t2 = time.perf_counter()
        tt.append((t1 - t0) * 1e3)
        dt.append((t2 - t1) * 1e3)
    tm, dm = statistics.median(tt), statistics.median(dt)
    return {"target_ms": round(tm, 3), "draft_ms": round(dm, 3), "c": round(dm / tm, 4), "steps": steps,
            "target_ms_p10_p90": [round(sorted(tt)[len(tt) // 10], 3), round(sorted(tt)[9 * len(tt) // 10], 3)],
            "draft_ms_p10_p90": [round(sorted(dt)[len(dt) // 10], 3), round(sorted(dt)[9 * len(dt) // 10], 3)]}


def engine_runs(target, draft, prompts: list[str], gamma: int, max_new: int) -> dict:
    """Greedy speculative decoding vs plain decoding with the engine, alternating, same prompts."""
    from engine.decoding.drafts import make_proposer
    from engine.decoding.speculative import encode_prompt, generate

    rows, plain_ms, spec_ms, acc, judged, passes, new = [], 0.0, 0.0, 0, 0, 0, 0
    for p in prompts:
        ids = encode_prompt(target.tokenizer, p)
        t0 = time.perf_counter()
        base = generate(target, None, ids, max_new_tokens=max_new)
        t1 = time.perf_counter()
        spec = generate(target, make_proposer("draft", target, draft), ids, gamma=gamma, max_new_tokens=max_new)
        t2 = time.perf_counter()
        plain_ms += (t1 - t0) * 1e3
        spec_ms += (t2 - t1) * 1e3
        acc += spec.stats.accepted
        judged += spec.stats.judged
        passes += spec.stats.rounds
        new += spec.stats.new_tokens
        rows.append({"prompt": p[:60], "identical": spec.token_ids == base.token_ids,
                     "new_tokens": spec.stats.new_tokens, "alpha_hat": spec.stats.acceptance_rate,
                     "plain_ms": round((t1 - t0) * 1e3), "spec_ms": round((t2 - t1) * 1e3)})
    return {"gamma": gamma, "max_new_tokens": max_new, "runs": rows,
            "all_identical": all(r["identical"] for r in rows),
            "alpha_hat": round(acc / max(judged, 1), 4), "tokens_per_target_pass": round(new / max(passes, 1), 3),
            "speedup_wall": round(plain_ms / max(spec_ms, 1e-9), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="embedded-draft")
    ap.add_argument("--heldout-file", default=str(ROOT / ".cache" / "draft-train" / "heldout.pt"),
                    help="cached held-out answers from the training run (regenerated if missing)")
    ap.add_argument("--heldout", type=int, default=32, help="held-out prompts when regenerating")
    ap.add_argument("--steps", type=int, default=200, help="decode steps for the step cost")
    ap.add_argument("--runs", type=int, default=6, help="prompts for the engine runs (0: skip)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    res: dict = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                             "torch_threads": torch.get_num_threads(), "load_avg_1min_start": os.getloadavg()[0]},
                 "draft": args.draft}
    target = load_model("embedded", device="cpu")
    draft = load_model(args.draft, device="cpu")
    res["draft_parameters"] = draft.num_parameters
    res["draft_dtype_after_load"] = str(next(draft.model.parameters()).dtype)

    hf = Path(args.heldout_file)
    if hf.is_file():
        held = load_samples(hf)
        res["heldout_source"] = f"{hf.relative_to(ROOT) if hf.is_relative_to(ROOT) else hf} (from the training run)"
        temps = sorted({s.temperature for s in held})
    else:
        prompts = build_prompts(args.heldout, "heldout", seed=0)
        held = generate_samples(target.model, target.tokenizer, prompts, target.eos_token_ids, greedy_fraction=0.5,
                                temperature=0.7, max_new_tokens=160, batch_size=16, seed=1,
                                progress=lambda m: print(m, file=sys.stderr))
        res["heldout_source"] = f"regenerated: {args.heldout} held-out prompts"
        temps = [0.0, 0.7]
    t0 = time.perf_counter()
    ev = evaluate_draft(target.model, draft.model, held, temperature=0.7)
    ev["sampled_answer_temperatures"] = [t for t in temps if t > 0]
    ev["seconds"] = round(time.perf_counter() - t0, 1)
    res["heldout_acceptance"] = ev
    print(json.dumps(ev), file=sys.stderr)

    ctx = chat_ids(target.tokenizer, "Explain how a rainbow forms, step by step.")
    res["step_cost"] = step_costs(target.model, draft.model, ctx, args.steps)
    print(json.dumps(res["step_cost"]), file=sys.stderr)

    if args.runs:
        prompts = [p["prompt"] for p in build_prompts(args.runs, "heldout", seed=7)]
        res["engine_greedy"] = engine_runs(target, draft, prompts, args.gamma, args.max_new_tokens)
        print(json.dumps({k: v for k, v in res["engine_greedy"].items() if k != "runs"}), file=sys.stderr)
    res["machine"]["load_avg_1min_end"] = os.getloadavg()[0]

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "draft.json").write_text(json.dumps(res, indent=1))
    ha, sc = res["heldout_acceptance"], res["step_cost"]
    md = ["# Shipped draft vs the embedded target", "",
          f"Machine: {res['machine']['platform']}, {res['machine']['cpus']} CPUs, torch threads "
          f"{res['machine']['torch_threads']}, load average {res['machine']['load_avg_1min_start']:.1f} → "
          f"{res['machine']['load_avg_1min_end']:.1f}", "",
          "| measure | value |", "|---|---|",
          f"| draft parameters | {res['draft_parameters'] / 1e6:.1f} M |",
          f"| greedy α (held-out, teacher-forced, {ha['greedy_positions']} positions) | {ha['greedy_alpha']:.3f} |",
          f"| α at T = 0.7, Σ min(p, q) ({ha['sampled_positions']} positions) | {ha['alpha_T']:.3f} |",
          f"| target step (ms, median) | {sc['target_ms']:.2f} |",
          f"| draft step (ms, median) | {sc['draft_ms']:.2f} |",
          f"| c = draft ÷ target | {sc['c']:.3f} |"]
    if "engine_greedy" in res:
        eg = res["engine_greedy"]
        md += [f"| engine, greedy, γ = {eg['gamma']}: α̂ = accepted ÷ judged | {eg['alpha_hat']:.3f} |",
               f"| engine: tokens per target pass | {eg['tokens_per_target_pass']:.2f} |",
               f"| engine: wall-time speedup over plain (quick check) | {eg['speedup_wall']:.2f}× |",
               f"| engine: output identical to plain greedy | {eg['all_identical']} |"]
    (OUT / "draft.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
