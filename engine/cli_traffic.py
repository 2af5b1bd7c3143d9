"""``python -m engine traffic SCRAPE [SCRAPE_AFTER]``: the acceptance profile of a serving engine's metrics.

Reads one or two files of Prometheus text (``-`` for standard input), or the JSON of ``python -m engine
generate --json``, and prints what :mod:`engine.explain.traffic` computes: acceptance rate, mean acceptance
length, survival and conditional α by position, tokens per target pass by γ, the best γ for a draft cost
``--draft-cost`` and the flags to run it.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.errors import InputError


def add_traffic(sub) -> None:
    p = sub.add_parser("traffic", help="acceptance profile from a server's /metrics text (vLLM, SGLang, llama.cpp, TensorRT-LLM)",
                       description="Read a serving engine's speculative-decoding metrics (Prometheus text from "
                                   "/metrics; two scrapes are differenced) and print the acceptance profile, the "
                                   "best draft length γ and the flags to run it.")
    p.add_argument("scrape", help="file with Prometheus text, generate --json output, or vLLM response JSON with "
                                  "metrics.speculative_decoding; - for standard input")
    p.add_argument("scrape_after", nargs="?", default=None,
                   help="a second scrape of the same server, taken later: the counters between the two are used")
    p.add_argument("--model", default=None, help="the model_name label to read when a scrape has several")
    p.add_argument("--draft-cost", type=float, default=0.05,
                   help="c, one draft step as a fraction of a target decode step (default 0.05)")
    p.add_argument("--verify-slope", type=float, default=0.0,
                   help="s in t(n) = t(1)(1 + s(n − 1)), the verify pass's cost growth (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_traffic)


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InputError(f"Cannot read {path}: {e.strerror}.") from None
    except UnicodeDecodeError:
        raise InputError(f"{path} is not UTF-8 text.") from None


def load_profile(first: str, second: str | None = None, model: str | None = None):
    """The profile of one or two texts: generate --json output, vLLM responses with per-request metrics (JSON), or
    Prometheus text (:func:`engine.explain.traffic.profile_from_input`)."""
    from engine.explain.traffic import profile_from_input

    if first.lstrip()[:1] in ("{", "[") and second is not None:
        raise InputError("JSON (a run, or vLLM responses) is read alone: give it without a second scrape.")
    return profile_from_input(first, second, model, source="files")


def run_traffic(args: argparse.Namespace) -> int:
    from engine.explain.traffic import ENGINE_TITLES, predict, profile_json, settings_for

    if args.scrape == "-" and args.scrape_after == "-":
        raise InputError("Only one of the two scrapes can come from standard input.")
    prof = load_profile(_read(args.scrape), None if args.scrape_after is None else _read(args.scrape_after),
                        args.model)
    if args.json:
        json.dump(profile_json(prof, args.draft_cost, args.verify_slope), sys.stdout, ensure_ascii=False)
        print()
        return 0
    pred = predict(prof, args.draft_cost, args.verify_slope)
    print(f"{ENGINE_TITLES[prof.engine]}" + (f", model {prof.model}" if prof.model else "") + f" ({prof.window})")
    if prof.has_counts:
        print(f"drafts {prof.drafts:g}, draft tokens {prof.draft_tokens:g}, accepted {prof.accepted_tokens:g}")
    elif prof.draft_tokens is not None:
        print(f"draft tokens {prof.draft_tokens:g}, accepted {prof.accepted_tokens:g} (no count of drafts)")
    if prof.tokens_per_pass_counter is not None:
        print(f"verify calls {prof.verify_calls:g}, generation tokens {prof.generation_tokens:g}: "
              f"tokens per target pass = {prof.tokens_per_pass_counter:.3f}")
    ar, ml = prof.acceptance_rate, prof.mean_acceptance_length
    print("acceptance rate (accepted ÷ draft tokens) = " + ("—" if ar is None else f"{ar:.3f}")
          + "; mean acceptance length (1 + accepted ÷ drafts) = " + ("—" if ml is None else f"{ml:.3f}"))
    if prof.alpha_hat is not None:
        print(f"α̂ (the analytic model's α, accepted ÷ judged) = {prof.alpha_hat:.3f}")
    if prof.per_position:
        print("position   survival P(A≥i+1)   conditional α_i")
        for i, (s, a) in enumerate(zip(prof.survival, prof.conditional_alpha)):
            print(f"{i:>8}   {s:>17.3f}   {'—' if a is None else f'{a:.3f}':>15}")
    else:
        print("no per-position counts: predictions use one α (geometric model)")
    print(f"tokens per target pass by γ (measured α_i | constant α̂), c = {pred.c:g}, s = {pred.slope:g}:")
    for g, tm, tg, ext in zip(pred.gammas, pred.tokens_measured, pred.tokens_geometric, pred.extrapolated):
        print(f"  γ = {g:>2}: {tm:.3f} | {tg:.3f}" + ("  (extrapolated)" if ext else ""))
    iv = "" if pred.speedup_interval is None else \
        f" (95 % from the counts: {pred.speedup_interval[0]:.2f}–{pred.speedup_interval[1]:.2f}×)"
    print(f"best γ = {pred.best_gamma}: {pred.best_speedup:.2f}×{iv}"
          + (f"; past the {pred.measured_positions} measured positions, best measured γ = "
             f"{pred.best_gamma_measured} ({pred.best_speedup_measured:.2f}×)" if pred.best_is_extrapolated else ""))
    for s in settings_for(pred.best_gamma):
        print(f"  {s.engine}: {s.flags}")
    for n in prof.notes:
        print(f"note: {n}")
    return 0
