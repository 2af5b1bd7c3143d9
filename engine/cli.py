"""``python -m engine generate``: speculative decoding in the terminal (see ``--help``)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

from engine.decoding.trace import token_origins
from engine.errors import InputError, ModelLoadError

COLORS = {"accepted": "\033[32m", "correction": "\033[31m", "bonus": "\033[34m", "plain": ""}
# without colour: accepted draft tokens are bare text; a run of plain target steps (no draft that round)
# is wrapped as one group, so it cannot pass for accepted draft tokens
MARKS = {"accepted": ("", ""), "correction": ("⟨", "⟩"), "bonus": ("«", "»"), "plain": ("‹", "›")}
RESET = "\033[0m"


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding",
                       description="Speculative decoding on a real model, printed with each token "
                                   "marked by origin, then the run statistics.")
    p.add_argument("--prompt", action="append", default=None,
                   help="the user message (chat template applied); give it several times to decode the prompts "
                        "together as one batch (one target pass per round for all of them)")
    p.add_argument("--prompts-file", default=None,
                   help="a text file with one prompt a line (blank lines skipped), decoded as one batch")
    p.add_argument("--target", default="embedded", help="embedded | hub id | local folder")
    p.add_argument("--draft", default=None,
                   help="embedded-head (trained EAGLE-style head) | embedded-auto (prompt lookup where the context "
                        "repeats, the head elsewhere, chosen per round) | embedded-medusa (Medusa heads, a tree "
                        "draft) | embedded-block (DFlash-style block drafter: one pass fills a block of γ + 1 "
                        "positions, γ = block − 1) | embedded-draft (trained small "
                        "model) | ngram | early-exit:K | none | hub id | folder (default: "
                        f"{_default_draft_help()})")
    p.add_argument("--gamma", type=int, default=None,
                   help=f"γ, draft tokens per round (1–64; default: {_default_gamma_help()}; ignored with "
                        "--draft none)")
    p.add_argument("--length", choices=("adaptive", "fixed"), default=None,
                   help="draft length: adaptive (each round drafts 0 to γ tokens, as many as the expected gain on "
                        "this machine's measured costs pays for; γ is then the cap, default "
                        "6) or fixed (γ every round) (default: adaptive for embedded-head and embedded-auto, fixed "
                        "for the other drafts)")
    p.add_argument("--no-draft-above", default=None, metavar="B",
                   help="operator's load limit: a batch of more than B prompts is decoded without a draft (plain "
                        "decoding), as serving engines switch speculation off under load (default: "
                        "$SPEEDUP_LAB_NO_DRAFT_ABOVE, else off; 0 = off). The app's room reads the same variable")
    p.add_argument("--draft-confidence", type=float, default=None,
                   help="draft head only: stop a round's draft at the first token the head gives a probability "
                        "below this, in [0, 1) (default: off)")
    add_tree_options(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off (default)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling draws (default 0)")
    p.add_argument("--sampling-rule", choices=("standard", "gumbel"), default="standard",
                   help="sampled runs: standard (accept with min(1, p/q), else draw from the residual; default) or "
                        "gumbel (drafter-invariant Gumbel-max sampling, noise keyed by seed, position and token: "
                        "plain and speculative decoding give the same text for a seed)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--baseline", action="store_true",
                   help=f"also decode without speculation (same settings and seed) and report the speedup: after "
                        f"the shown run (a warm-up too), {BASELINE_REPS} speculative and {BASELINE_REPS} plain runs "
                        "alternate (A B B A A B); the speedup is the ratio of their median ms per token")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None,
                   help="fp32 | bf16 | fp16 (default: fp32, also on CUDA, so greedy output matches plain decoding)")
    add_compute_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--metrics-out", default=None, metavar="FILE",
                   help="also write the run's draft counts as vLLM-named Prometheus text to FILE (read it with "
                        "python -m engine traffic FILE, or paste it into the Your traffic page)")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="colour tokens by origin (auto: when printing to a terminal)")
    p.set_defaults(func=run_generate)


def add_compute_option(p) -> None:
    """--compute: which matmul kernels run (``engine.decoding.compute``)."""
    p.add_argument("--compute", default=None, metavar="PATH",
                   help="compute path of the linear layers: auto (the fastest, measured once per machine), "
                        "default (PyTorch's own, MKL on x86), onednn, or stream (this project's weight-streaming "
                        "kernel for ≤ 16 rows, oneDNN above; built once per machine) (default: "
                        "$SPEEDUP_LAB_COMPUTE, else auto)")


def compute_settings(lm) -> dict:
    """The compute path a loaded model runs, for ``--json`` settings and result headers."""
    c = lm.compute
    return {"path": c.path, "reason": c.reason, "cpu": c.cpu, "threads": c.threads} if c else {}


def batch_invariance_settings(lm) -> dict:
    """The room's batch-invariance self-check on this machine (``engine.decoding.invariance``), for ``--json``
    settings: whether a row of a shared pass gets the bits of its lone pass here, and why not where it does not."""
    from engine.decoding.invariance import invariance_check

    c = invariance_check(lm)
    return {**c.to_dict(), "label": c.label()}


def add_tree_options(p) -> None:
    """--tree, --tree-branching, --accept (token trees, ``engine.decoding.tree``)."""
    from engine.decoding.tree import MAX_BRANCHING, MAX_TREE, TREE_DEFAULT_DEPTH

    p.add_argument("--tree", type=int, default=None,
                   help=f"token tree of at most N nodes per round, 0–{MAX_TREE} (0 = a chain; default: a chain, or "
                        "embedded-medusa's shipped static tree): the draft head becomes an EAGLE-2 dynamic tree, "
                        "prompt lookup takes several matches as branches, Medusa heads their best N-node tree; "
                        f"--gamma is then the tree's depth (default {TREE_DEFAULT_DEPTH}; Medusa: its K heads)")
    p.add_argument("--tree-branching", type=int, default=None,
                   help=f"with --tree: children per expanded node (head: top-k, and nodes expanded per depth; "
                        f"lookup: matches), 1–{MAX_BRANCHING} (default 4)")
    p.add_argument("--accept", choices=["exact", "typical"], default="exact",
                   help="with --tree and sampling: exact (lossless recursive rejection sampling, the default) or "
                        "typical (Medusa's typical acceptance: LOSSY, the output no longer follows the target)")


def check_tree_cli(args: argparse.Namespace) -> None:
    """Bounds of the tree options, checked before any model loads.

    Raises:
        InputError: --tree outside 0..MAX_TREE, --tree-branching outside 1..MAX_BRANCHING or without --tree,
            --accept typical without --tree.
    """
    from engine.decoding.tree import MAX_BRANCHING, MAX_TREE

    if args.tree is not None and not 0 <= args.tree <= MAX_TREE:
        raise InputError(f"--tree must be from 0 (a chain) to {MAX_TREE} nodes, got {args.tree}.")
    if args.tree_branching is not None:
        if not args.tree:
            raise InputError("--tree-branching applies to token trees: add --tree N.")
        if not 1 <= args.tree_branching <= MAX_BRANCHING:
            raise InputError(f"--tree-branching must be from 1 to {MAX_BRANCHING}, got {args.tree_branching}.")
    if args.accept == "typical" and args.tree == 0:
        raise InputError("--accept typical (lossy) judges token trees: add --tree N.")


def _tree_settings(args, draft_spec: str, proposer) -> tuple[int, int]:
    """(tree size, γ) for a run: --tree, else the Medusa heads' shipped static tree (``tree_size``) with γ = K
    heads unless --gamma is given, else 0 (a chain)."""
    from engine.decoding.medusa import MedusaProposer

    medusa = isinstance(proposer, MedusaProposer)
    tree = args.tree if args.tree is not None else (proposer.tree_size if medusa else 0)
    gamma = args.gamma if args.gamma is not None else (proposer.heads.n_heads if medusa else None)
    return tree, gamma


def load_pair(target_spec: str, draft_spec: str, device=None, dtype=None, progress=None, compute=None,
              length: str | None = None):
    """Load the target and build the proposer for ``draft_spec`` (None proposer for "none"); ``compute`` is the
    compute path (``engine.decoding.compute``; None: $SPEEDUP_LAB_COMPUTE, else auto); ``length`` the draft-length
    policy ("adaptive", "fixed", None: the draft's default, ``engine.decoding.drafts.default_length``)."""
    from engine.decoding.models import load_model
    from engine.decoding.drafts import make_proposer

    kw = {"progress": progress} if progress else {}
    kw["compute"] = compute
    target = load_model(target_spec, device=device, dtype=dtype, **kw)
    from engine.decoding.draft_head import is_head_folder
    from engine.decoding.models import EMBEDDED_HEAD

    from engine.decoding.block_drafter import is_block_folder
    from engine.decoding.medusa import is_medusa_folder
    from engine.decoding.models import EMBEDDED_BLOCK, EMBEDDED_MEDUSA
    from engine.decoding.drafts import EMBEDDED_AUTO

    if (draft_spec in ("none", "baseline", "ngram", EMBEDDED_HEAD, EMBEDDED_MEDUSA, EMBEDDED_BLOCK, EMBEDDED_AUTO)
            or draft_spec.startswith("early-exit") or is_head_folder(draft_spec) or is_medusa_folder(draft_spec)
            or is_block_folder(draft_spec)):
        return target, make_proposer(draft_spec, target, length=length)
    if length == "adaptive":
        raise InputError(f"An adaptive draft length applies to a draft head or {EMBEDDED_AUTO}, not {draft_spec!r}.")
    try:
        draft = load_model(draft_spec, device=device, dtype=dtype, **kw)
    except ModelLoadError as e:
        raise ModelLoadError(f"{e} (A draft is embedded-head, embedded-medusa, embedded-block, embedded-draft, ngram, "
                             "early-exit:K, none, a "
                             "hub id or a local folder.)") from None
    return target, make_proposer("model", target, draft)


def marked_text(tokenizer, origins: list[tuple[int, str]], color: bool) -> str:
    """The generated text with each token marked by origin (``engine.decoding.trace.ORIGINS``): ANSI colours, or
    without colour the ``MARKS`` brackets (a run of consecutive plain target steps shares one pair)."""
    def text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    if color:
        return "".join(f"{COLORS[o]}{text(t)}{RESET if COLORS[o] else ''}" for t, o in origins)
    pieces: list[str] = []
    for origin, run in itertools.groupby(origins, key=lambda x: x[1]):
        a, b = MARKS[origin]
        words = [text(t) for t, _ in run]
        pieces += [a + "".join(words) + b] if origin == "plain" else [a + w + b for w in words]
    return "".join(pieces)


def _default_draft_help() -> str:
    from engine.decoding.models import default_draft_spec

    return f"{default_draft_spec()} for the embedded target, ngram for any other"


def _default_gamma_help() -> str:
    from engine.decoding.models import EMBEDDED_HEAD, default_gamma

    return (f"for embedded-head the best γ on this machine's measured pass cost (else {default_gamma(EMBEDDED_HEAD)}), "
            f"{default_gamma('ngram')} for the others")


BASELINE_REPS = 3  # --baseline: timed runs of each kind, alternating (engine.decoding.measure.measure_speedup_ab)


def run_generate(args: argparse.Namespace) -> int:
    from engine.decoding.measure import compare_baseline
    from engine.decoding.sampling import SamplingConfig
    from engine.decoding.speculative import encode_prompt, generate

    def progress(msg, frac):
        print(f"[{frac:4.0%}] {msg}", file=sys.stderr, flush=True)

    from engine.decoding.models import default_draft_spec

    draft_spec = args.draft or default_draft_spec(args.target)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, getattr(args, "sampling_rule", "standard"))
    prompts = _prompts(args)
    if len(prompts) > 1 and args.baseline:
        raise InputError("--baseline compares one prompt with plain decoding; to compare a batch, use "
                         "`python -m engine batch-sweep`.")
    if len(prompts) > 1 and (args.tree or getattr(args, "metrics_out", None)):
        raise InputError("Several prompts are decoded as one batch of chain drafts: --tree and --metrics-out "
                         "apply to one prompt.")
    if args.draft_confidence is not None and not 0.0 <= args.draft_confidence < 1.0:
        raise InputError(f"--draft-confidence must be in [0, 1), got {args.draft_confidence}.")
    check_tree_cli(args)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load on every run; first loads report through progress()
    from engine.decoding.compute import parse_override

    if args.compute is not None:
        parse_override(args.compute)  # a bad value fails before any model loads
    target, proposer = load_pair(args.target, draft_spec, args.device, args.dtype, progress, args.compute,
                                 length=getattr(args, "length", None))
    if args.draft_confidence is not None:
        if not hasattr(proposer, "confidence_threshold"):
            raise InputError("--draft-confidence applies to a draft head or a block drafter only (--draft "
                             "embedded-head, embedded-block or their folders).")
        proposer.confidence_threshold = args.draft_confidence
    if args.tree and proposer is not None and args.tree_branching is not None:
        if not hasattr(proposer, "set_branching"):
            if hasattr(proposer, "propose_tree"):
                raise InputError(f"The draft '{proposer.name}' drafts a static tree (its shape comes from its held-out "
                                 f"accuracies): --tree-branching does not apply; set its size with --tree N.")
            raise InputError(f"The draft '{proposer.name}' cannot make token trees; use embedded-head or ngram.")
        proposer.set_branching(args.tree_branching)
    from engine.decoding.tree import TREE_DEFAULT_DEPTH
    from engine.explain.analytic import default_gamma_here

    tree, gamma = _tree_settings(args, draft_spec, proposer)
    args.tree = tree
    if args.accept == "typical" and not tree:
        raise InputError("--accept typical (lossy) judges token trees: add --tree N.")
    from engine.decoding.drafts import is_adaptive

    if args.gamma is None and is_adaptive(proposer) and not tree:
        from engine.decoding.draft_length import ADAPTIVE_GAMMA_MAX

        args.gamma = ADAPTIVE_GAMMA_MAX  # the cap: each round drafts only what pays (engine.decoding.draft_length)
    if args.gamma is None:
        args.gamma = gamma if gamma is not None else (TREE_DEFAULT_DEPTH if tree else
                                                      default_gamma_here(draft_spec, args.target)[0])
    from engine.decoding.block_drafter import BlockProposer, check_block_size

    if isinstance(proposer, BlockProposer):
        check_block_size(args.gamma + 1, proposer.max_block)  # γ = block − 1: a clear message past the trained block
    if len(prompts) > 1:
        if tree:
            raise InputError("Several prompts are decoded as one batch of chain drafts: add --tree 0 (the Medusa "
                             "heads draft a tree by default).")
        return _run_generate_batch(args, prompts, target, proposer, draft_spec, sampling)
    ids = encode_prompt(target.tokenizer, prompts[0], chat=not args.no_chat)
    kw = dict(gamma=args.gamma, sampling=sampling, seed=args.seed, max_new_tokens=args.max_new_tokens,
              tree=tree, accept=args.accept)
    res = generate(target, proposer, ids, **kw)
    cmp = ab = None
    if args.baseline:
        # one run each, A then B, read 1.30× for two identical plain decoders (the first paid the
        # warm-up): the shown run warms up, then the kinds alternate and the medians are compared
        import dataclasses

        from engine.decoding.measure import measure_speedup_ab
        from engine.decoding.speculative import SpeculativeDecoder

        ab = measure_speedup_ab(lambda: SpeculativeDecoder(target, proposer, ids, **kw),
                                lambda: SpeculativeDecoder(target, None, ids, **{**kw, "tree": 0, "accept": "exact"}),
                                reps=BASELINE_REPS)
        # time per token, not total time: under sampling the two may generate different numbers of tokens
        timed = ab.comparison(res.token_ids)
        cmp = dataclasses.replace(compare_baseline(res.token_ids, res.stats, ab.base_ids, ab.base_stats),
                                  speedup=timed.speedup, spec_tokens_per_s=timed.spec_tokens_per_s,
                                  base_tokens_per_s=timed.base_tokens_per_s)
    if args.metrics_out:  # the run's counters in vLLM's names (engine/explain/traffic.py)
        _write_metrics(args.metrics_out, res.stats, args.gamma if proposer else None, args.target)
    if args.json:
        out = res.to_dict()
        out["draft"] = draft_spec
        out["settings"] = {"target": args.target, "draft": draft_spec, "gamma": args.gamma if proposer else None,
                           "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                           "sampling_rule": sampling.rule,
                           "seed": args.seed, "max_new_tokens": args.max_new_tokens, "chat": not args.no_chat,
                           "draft_confidence": getattr(proposer, "confidence_threshold", None),
                           "length": "adaptive" if is_adaptive(proposer) else "fixed",
                           "compute": compute_settings(target),
                           "batch_invariance": batch_invariance_settings(target)}
        if args.tree:  # chain runs keep their settings as they were
            out["settings"].update(tree=args.tree, tree_branching=getattr(proposer, "branching", None),
                                   accept="typical (lossy)" if args.accept == "typical" else "exact")
        if cmp is not None:
            out["stats"]["baseline_tokens_per_s"] = cmp.base_tokens_per_s
            out["stats"]["baseline_new_tokens"] = len(ab.base_ids)
            out["stats"]["speedup"] = cmp.speedup
            out["stats"]["identical_to_baseline"] = cmp.identical
            out["stats"]["speedup_timing"] = {"order": ab.order, "spec_ms_per_token": ab.spec_ms_per_token,
                                              "base_ms_per_token": ab.base_ms_per_token}
        json.dump(out, sys.stdout, ensure_ascii=False)
        print()
        return 0
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    tok = target.tokenizer
    print(marked_text(tok, token_origins(res.rounds), color))
    legend = ("\033[32maccepted draft\033[0m  \033[31mcorrection\033[0m  \033[34mbonus\033[0m  "
              "uncoloured: target step without a draft"
              if color else "accepted draft: bare text  ⟨correction⟩  «bonus»  ‹target steps without a draft›")
    s = res.stats
    print(f"\n--- {legend}")
    print(f"target: {target.name}   draft: {proposer.name if proposer else 'none (plain decoding)'}   "
          + ((f"γ ≤ {args.gamma} (adaptive length)   " if is_adaptive(proposer) else f"γ = {args.gamma}   ")
             if proposer else "")
          + (f"confidence gate = {proposer.confidence_threshold:g}   "
             if getattr(proposer, "confidence_threshold", 0) else "") + f"T = {args.temperature}")
    if args.tree:
        rule = "greedy" if sampling.greedy else (
            "typical acceptance (LOSSY: the output does not follow the target)" if args.accept == "typical"
            else "exact (lossless)")
        nodes = [len(r.tree.nodes) for r in res.rounds if r.tree is not None]
        branching = getattr(proposer, "branching", None)
        print(f"token tree: ≤ {args.tree} nodes, depth ≤ γ = {args.gamma}"
              + (f", branching {branching}" if branching else ", the heads' static tree") + "; rule "
              f"{rule}; {sum(nodes) / max(len(nodes), 1):.1f} nodes per round drafted. For a tree, α̂ is the "
              "per-depth acceptance (the chance the accepted path grows by one more node) and 'drafted' counts the "
              "accepted path plus its first rejected node")
    if s.acceptance_rate is not None:
        from engine.explain.analytic import expected_tokens_per_pass, expected_tokens_per_round

        e = expected_tokens_per_pass(s.acceptance_rate, args.gamma)
        e_rounds = expected_tokens_per_round(s.acceptance_rate, [r.n_drafted for r in res.rounds])
        print(f"acceptance rate α̂ = {s.acceptance_rate:.3f} ({s.accepted} of {s.judged} judged; "
              f"{s.accepted} of {s.drafted} drafted = {s.accepted_fraction:.3f})")
        print(f"tokens per target pass = {s.tokens_per_target_pass:.2f}  (formula at α̂ and each round's draft "
              f"length: {e_rounds:.2f}; with γ = {args.gamma} drafted every round: {e:.2f}; "
              f"{s.drafted / max(s.rounds, 1):.2f} drafted per round)")
        print("acceptance by draft position: " + ", ".join(f"{a:.2f}" for a in s.acceptance_by_position))
        if s.draft_cost_ratio is not None:
            print(f"draft cost c = {s.draft_cost_ratio:.3f} of a target pass")
    from engine.decoding.draft_length import choice_summary

    chosen = choice_summary(res.rounds)
    if chosen is not None:
        print(chosen["line"])
    print(f"{s.new_tokens} token{'' if s.new_tokens == 1 else 's'} in {s.rounds} round{'' if s.rounds == 1 else 's'}, "
          f"{s.total_ms:.0f} ms "
          f"({s.tokens_per_s:.1f} tokens/s, prefill {s.prefill_ms:.0f} ms)"
          + {"eos": "; ended at the end-of-sequence token (the last token shown; JSON's text leaves it out)",
             "max_new_tokens": f"; stopped at --max-new-tokens {args.max_new_tokens}"}.get(
              res.rounds[-1].stop_reason if res.rounds else None, ""))
    if cmp is not None:
        if cmp.identical:
            same = "identical"
        elif sampling.greedy:  # the rule keeps greedy output identical: a difference is arithmetic
            same = (f"different from token {cmp.first_difference} on (greedy, so arithmetic: a pass over several "
                    "tokens rounded differently from one-token steps, as bf16/fp16 often do)")
        else:
            same = "different (sampling: other random draws, the same distribution)"
        sp = "—" if cmp.speedup is None else f"{cmp.speedup:.2f}×"
        print(f"speculative {cmp.spec_tokens_per_s:.1f} tokens/s, plain decoding (baseline) "
              f"{cmp.base_tokens_per_s:.1f} tokens/s: speedup {sp} (medians of {ab.reps} alternating runs "
              "each; ms per token, speculative: " + ", ".join(f"{x:.1f}" for x in ab.spec_ms_per_token)
              + "; plain: " + ", ".join(f"{x:.1f}" for x in ab.base_ms_per_token) + ")")
        if ab.spec_stats.drafted == 0:
            print("note: the draft proposed nothing, so both runs decoded plainly and the speedup is only "
                  "machine noise")
        elif ab.noisy:
            print(f"note: the runs of one kind differed by up to {ab.spread:.1f}× (the machine was busy), so "
                  "the speedup is unsure; run again with nothing else running")
        print(f"outputs {same}")
    return 0


def _write_metrics(path: str, stats, gamma: int | None, target: str) -> None:
    """``--metrics-out``: the run's counts as vLLM would expose them (engine.explain.traffic.run_metrics_text)."""
    from engine.explain.traffic import run_metrics_text

    text = run_metrics_text(stats, gamma, target)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise InputError(f"Cannot write --metrics-out {path}: {e.strerror}.") from None


# ------------------------------------------------------------------------------------------ batches


def _prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of ``generate``: every --prompt, then the lines of --prompts-file.

    Raises:
        InputError: no prompt at all, or an unreadable file.
    """
    prompts = list(args.prompt or [])
    if getattr(args, "prompts_file", None):
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise InputError(f"Cannot read --prompts-file {args.prompts_file!r}: {e.strerror or e}.") from None
    if not prompts:
        raise InputError("Give a prompt: --prompt TEXT (several times for a batch) or --prompts-file FILE.")
    return prompts


def _row_proposers(draft_spec: str, target, first, n: int):
    """n distinct proposers of the kind of ``first`` (None: plain decoding), one per batch row."""
    from engine.decoding.proposers import DraftModelProposer
    from engine.decoding.drafts import make_proposer

    if first is None:
        return None
    if isinstance(first, DraftModelProposer):
        rest = [DraftModelProposer(first.draft, target) for _ in range(n - 1)]
    else:
        from engine.decoding.drafts import is_adaptive

        length = "adaptive" if is_adaptive(first) else "fixed"
        rest = [make_proposer(draft_spec, target, length=length) for _ in range(n - 1)]
    for p in rest:
        if hasattr(first, "confidence_threshold"):
            p.confidence_threshold = first.confidence_threshold
    return [first, *rest]


def _run_generate_batch(args, prompts, target, proposer, draft_spec, sampling) -> int:
    """``generate`` with several prompts: one batch (``engine.decoding.batch.generate_batch``)."""
    from engine.decoding.batch import generate_batch
    from engine.decoding.speculative import encode_prompt

    from engine.decoding.scheduler import NO_DRAFT_ENV, parse_no_draft_above

    ids = [encode_prompt(target.tokenizer, p, chat=not args.no_chat) for p in prompts]
    limit = parse_no_draft_above(args.no_draft_above if getattr(args, "no_draft_above", None) is not None
                                 else os.environ.get(NO_DRAFT_ENV))
    drafting_off = limit is not None and len(ids) > limit and proposer is not None
    if drafting_off:
        print(f"note: {len(ids)} prompts > --no-draft-above {limit}: decoded without a draft (plain decoding)",
              file=sys.stderr)
        proposer = None
    res = generate_batch(target, _row_proposers(draft_spec, target, proposer, len(ids)), ids, gamma=args.gamma,
                         sampling=sampling, seed=args.seed, max_new_tokens=args.max_new_tokens)
    totals = res.totals()
    if args.json:
        totals["settings"] = {"target": args.target, "draft": draft_spec, "gamma": args.gamma if proposer else None,
                              "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                              "seed": args.seed, "seeds": [args.seed + i for i in range(len(ids))],
                              "max_new_tokens": args.max_new_tokens, "chat": not args.no_chat,
                              "no_draft_above": limit, "drafting_off_by_limit": drafting_off,
                              "compute": compute_settings(target),
                              "batch_invariance": batch_invariance_settings(target)}
        json.dump({"results": [r.to_dict() for r in res.results], "batch": totals}, sys.stdout, ensure_ascii=False)
        print()
        return 0
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    for i, (prompt, r) in enumerate(zip(prompts, res.results)):
        head = prompt.replace("\n", " ")
        print(f"=== prompt {i + 1} of {len(prompts)}: {head[:70] + '…' if len(head) > 70 else head}")
        print(marked_text(target.tokenizer, token_origins(r.rounds), color))
        s = r.stats
        alpha = "" if s.acceptance_rate is None else f", α̂ = {s.acceptance_rate:.3f}"
        stop = r.rounds[-1].stop_reason if r.rounds else "—"
        print(f"--- {s.new_tokens} tokens in {s.rounds} rounds{alpha}, stop: {stop}")
    tps = totals["tokens_per_s"]
    print(f"\nbatch of {len(prompts)}: {totals['new_tokens']} tokens in {totals['total_ms']:.0f} ms "
          f"({'—' if tps is None else f'{tps:.1f}'} tokens/s in all), {totals['target_passes']} target passes "
          f"(the prefill included; one per round for the whole batch)   draft: "
          f"{proposer.name if proposer else 'none (plain decoding)'}" + (f"   γ = {args.gamma}" if proposer else ""))
    return 0


def add_batch_sweep(sub) -> None:
    p = sub.add_parser("batch-sweep", help="measure plain vs speculative batched decoding against batch size",
                       description="Total generated tokens/s of plain and speculative batched greedy decoding for "
                                   "each batch size (engine.decoding.batch.batch_sweep), the target pass time "
                                   "against tokens in the pass, and the crossover batch.")
    p.add_argument("--batches", default="1,2,4", help="comma-separated batch sizes (default 1,2,4)")
    p.add_argument("--methods", default="plain,ngram,embedded-head",
                   help="comma-separated: plain, ngram, embedded-head, embedded-draft, early-exit:K")
    p.add_argument("--gamma", type=int, default=None, help="γ of every speculative method (default: each one's)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="per sequence (default 16)")
    p.add_argument("--reps", type=int, default=1, help="alternating timed runs per cell (default 1)")
    p.add_argument("--min-prompts", type=int, default=1,
                   help="each cell decodes at least this many prompts, in groups of B one after another "
                        "(default 1: batch B decodes the first B prompts)")
    p.add_argument("--target", default="embedded", help="embedded | hub id | local folder")
    p.add_argument("--prompts-file", default=None, help="one prompt a line (default: the 32 built-in prompts)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    add_compute_option(p)
    p.add_argument("--json", action="store_true", help="print the sweep as one JSON object")
    p.set_defaults(func=run_batch_sweep)


def run_batch_sweep(args: argparse.Namespace) -> int:
    from engine.decoding.batch import SWEEP_PROMPTS, batch_sweep, parse_batches
    from engine.decoding.models import load_model

    from engine.decoding.compute import parse_override

    batches = parse_batches(args.batches)
    if args.compute is not None:
        parse_override(args.compute)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    prompts = SWEEP_PROMPTS
    if args.prompts_file:
        args.prompt = None
        prompts = _prompts(args)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    target = load_model(args.target, device=args.device, compute=args.compute,
                        progress=lambda msg, frac: print(f"[{frac:4.0%}] {msg}", file=sys.stderr, flush=True))

    def progress(done, total, label, _sweep):
        print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True)

    sweep = batch_sweep(target, prompts, batches=batches, methods=methods, gamma=args.gamma,
                        max_new_tokens=args.max_new_tokens, reps=args.reps, chat=not args.no_chat, on_progress=progress,
                        min_prompts=args.min_prompts)
    if args.json:
        json.dump(sweep.to_dict(), sys.stdout, ensure_ascii=False)
        print()
        return 0
    print(sweep.markdown())
    print("\ntarget pass time by tokens in the pass: " + ", ".join(f"{n}: {ms:.1f} ms" for n, ms, _ in sweep.pass_curve()))
    print(f"({sweep.max_new_tokens} new tokens per row, {sweep.reps} run(s) per cell"
          + (f", each covering at least {sweep.min_prompts} prompts" if sweep.min_prompts > 1 else "")
          + f", torch threads {sweep.threads}, "
          f"{sweep.elapsed_s:.0f} s)")
    return 0


def add_draft_card(sub) -> None:
    from engine.training.draft_card import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_PROMPTS, DRAFTS

    names = ", ".join(k.name + (":K" if k.needs_k else "") for k in DRAFTS.values())
    p = sub.add_parser("draft-card", help="measure a shipped draft's model card on your prompts",
                       description="A shipped draft's card, measured (engine.training.draft_card): teacher-forced "
                                   "top-1 agreement by draft position on the target's own greedy answers, in-engine "
                                   "greedy acceptance by draft position and by round (round 0 separately), tokens "
                                   "per target pass, and speed against plain decoding on this machine.")
    p.add_argument("draft", help=f"the draft: {names}")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="one prompt a line (default: the first --max-prompts of the card's held-out prompts)")
    p.add_argument("--max-prompts", type=int, default=DEFAULT_MAX_PROMPTS,
                   help=f"how many of the card's held-out prompts (default {DEFAULT_MAX_PROMPTS}; ignored with --prompts)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens per answer (default {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--gamma", type=int, default=None,
                   help="γ (a tree's depth) in the engine (default: what generate picks on this machine)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's own choice)")
    p.add_argument("--target", default="embedded",
                   help="embedded (default; the trained drafts need it) | a folder (early-exit:K only)")
    add_compute_option(p)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print the card as one JSON object instead of markdown")
    p.add_argument("--out", default=None, metavar="PREFIX", help="also write PREFIX.json and PREFIX.md")
    p.set_defaults(func=run_draft_card)


def run_draft_card(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.training.draft_card import card_markdown, draft_card, print_progress, read_prompts, resolve_draft

    # bad input first, before the model loads
    resolve_draft(args.draft)
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}.")
    if args.max_prompts < 1:
        raise InputError(f"--max-prompts must be at least 1, got {args.max_prompts}.")
    if args.gamma is not None and not 1 <= args.gamma <= 64:
        raise InputError(f"--gamma must be from 1 to 64, got {args.gamma}.")
    if args.threads < 0:
        raise InputError(f"--threads must be 0 (torch's default) or more, got {args.threads}.")
    if args.compute is not None:
        from engine.decoding.compute import parse_override

        parse_override(args.compute)
    prompts = read_prompts(args.prompts) if args.prompts is not None else None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    from engine.decoding.models import load_model

    hf_logging.disable_progress_bar()
    target = load_model(args.target, device="cpu", compute=args.compute,
                        progress=lambda msg, frac: print(f"[{frac:4.0%}] {msg}", file=sys.stderr, flush=True))
    from engine.explain.analytic import default_gamma_here

    kind, spec = resolve_draft(args.draft)
    # γ as `generate` picks it on this machine (the head's from the measured pass cost); Medusa: its K heads
    gamma, why = default_gamma_here(spec, args.target) if kind.gamma is not None else (None, "the Medusa heads' K")
    if args.gamma is not None:
        gamma, why = args.gamma, "--gamma"
    card = draft_card(target, args.draft, prompts=prompts, max_new_tokens=args.max_new_tokens,
                      max_prompts=args.max_prompts, chat=not args.no_chat, gamma=gamma, progress=print_progress)
    card["settings"]["gamma_source"] = why
    parts = [args.draft] + (["--prompts", args.prompts] if args.prompts else ["--max-prompts", str(args.max_prompts)])
    parts += ["--max-new-tokens", str(args.max_new_tokens)] + (["--gamma", str(args.gamma)] if args.gamma else [])
    parts += ["--threads", str(args.threads)] if args.threads else []
    parts += (["--target", args.target] if args.target != "embedded" else []) + (["--no-chat"] if args.no_chat else [])
    parts += ["--compute", args.compute] if args.compute else []
    command = "python -m engine draft-card " + " ".join(parts)
    card["command"] = command
    md = card_markdown(card, command)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_name(out.name + ".json").write_text(json.dumps(card, indent=1, ensure_ascii=False) + "\n")
        out.with_name(out.name + ".md").write_text(md)
    if args.json:
        json.dump(card, sys.stdout, ensure_ascii=False)
        print()
    else:
        print(md)
    return 0
