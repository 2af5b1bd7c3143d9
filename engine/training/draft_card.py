"""A shipped draft's model card, measured: ``python -m engine draft-card DRAFT`` (one job: the card's numbers).

For one draft kind (``DRAFTS``: the EAGLE-style head, the Medusa heads, the small draft model, early exit) and a
list of prompts (default: the first ``max_prompts`` of the card's own held-out set, ``heldout_prompts``), it
measures, with the embedded target in fp32 and greedy decoding:

1. **teacher-forced top-1 agreement by draft position** on the target's own greedy answers: for every context
   prompt + answer[:j] (j ≥ 1: the state a round after the first starts from, the target holding the hidden
   states of all but the newest token), the draft proposes ``positions`` tokens as it would in decoding (its
   later positions read its own earlier guesses, as a round does), and draft position d counts as agreeing
   when its token is the target's greedy token answer[j + d − 1]. Each position is scored on every context,
   whatever the earlier positions did (Medusa §3.1 reports head accuracies this way; the head's card calls
   position 1 "first draft token");
2. **in-engine greedy acceptance** (``engine.decoding.speculative.SpeculativeDecoder``, the draft's default
   settings: ``gamma``, ``tree``): by draft position d (accepted ÷ judged, judged = rounds whose draft reached
   depth d and whose first d − 1 positions were accepted; α̂ by position as in ``RunStats``), separately for
   round 0 (drafted right after the prefill) and for the rounds after it; accepted draft tokens per round;
   tokens per target pass (``RunStats.tokens_per_target_pass``, prefill pass included);
3. **speed** against plain decoding on this machine: per prompt one plain and one speculative run, in
   alternating order (plain first on even prompts, the draft first on odd ones), after one warm-up of each;
   the ratio of ms per token (prefill included), per prompt, and its median (``measure.py``'s rule:
   alternate, compare medians); the CPU model and the compute path (``engine.decoding.compute``).

Add a draft kind with one entry in ``DRAFTS``. Output: a dict (``draft_card``), rendered by ``card_markdown``.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.decoding.compute import cpu_model, path_of
from engine.decoding.models import EMBEDDED_HEAD_GAMMA, default_gamma
from engine.decoding.drafts import make_proposer
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt
from engine.errors import InputError
from engine.training.draft_data import build_prompts

DEFAULT_MAX_PROMPTS = 8
DEFAULT_MAX_NEW_TOKENS = 64
TEACHER_POSITIONS = 4


@dataclass(frozen=True)
class DraftKind:
    """One shipped draft kind.

    Attributes:
        name: the ``--draft`` spec ("early-exit" takes ":K").
        label: what the card calls it.
        card: the model card's folder (None: no card, e.g. early exit).
        heldout_prompts: size of the card's held-out set: ``build_prompts(n, "heldout", seed=0)`` with the n of
            its training command (the sets of every n share their first prompts).
        gamma: γ in the engine (None: the proposer's own, Medusa's K heads).
        tree: 0 = a chain; "saved" = the proposer's saved static tree (Medusa).
        needs_k: the spec takes ":K" (early exit).
    """

    name: str
    label: str
    card: str | None
    heldout_prompts: int
    gamma: int | None = 4
    tree: int | str = 0
    needs_k: bool = False


DRAFTS: dict[str, DraftKind] = {k.name: k for k in (
    DraftKind("embedded-head", "EAGLE-style draft head", "assets/smollm2-head", 64, gamma=EMBEDDED_HEAD_GAMMA),
    DraftKind("embedded-medusa", "Medusa heads", "assets/smollm2-medusa", 48, gamma=None, tree="saved"),
    DraftKind("embedded-block", "block drafter (DFlash-style)", "assets/smollm2-block", 32,
              gamma=default_gamma("embedded-block")),
    DraftKind("embedded-draft", "small draft model", "assets/smollm2-draft", 64, gamma=default_gamma("embedded-draft")),
    DraftKind("early-exit", "early exit (the target's first K layers)", None, 64,
              gamma=default_gamma("early-exit"), needs_k=True),
)}


def resolve_draft(spec: str) -> tuple[DraftKind, str]:
    """(kind, the exact draft spec) for a ``draft-card`` argument.

    Raises:
        InputError: an unknown draft, or early exit without a layer count K ≥ 1.
    """
    spec = (spec or "").strip()
    base, _, arg = spec.partition(":")
    kind = DRAFTS.get(base)
    if kind is None or (kind.needs_k != bool(_)):
        names = ", ".join(k.name + (":K" if k.needs_k else "") for k in DRAFTS.values())
        raise InputError(f"Unknown draft {spec!r} for a draft card; pick one of {names}.")
    if kind.needs_k:
        try:
            k = int(arg)
        except ValueError:
            k = 0
        if k < 1:
            raise InputError(f"Write early exit as 'early-exit:K' with K ≥ 1 layers, got {spec!r}.")
    return kind, spec


def heldout_prompts(kind: DraftKind, max_prompts: int = DEFAULT_MAX_PROMPTS) -> list[str]:
    """The first ``max_prompts`` of the card's held-out prompts (``build_prompts(kind.heldout_prompts, "heldout",
    seed=0)``, as the training commands and ``benchmarks/bench_head.py`` / ``bench_medusa.py`` chose them).

    Raises:
        InputError: max_prompts < 1.
    """
    if max_prompts < 1:
        raise InputError(f"A draft card needs at least one prompt, got --max-prompts {max_prompts}.")
    return [p["prompt"] for p in build_prompts(kind.heldout_prompts, "heldout", seed=0)][:max_prompts]


def read_prompts(path: str) -> list[str]:
    """One prompt a line (blank lines skipped).

    Raises:
        InputError: a missing or unreadable file, or one without prompts.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"Cannot read the prompt file {path!r}: {e.strerror if isinstance(e, OSError) else e}.") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InputError(f"The prompt file {path!r} holds no prompts (one a line, blank lines are skipped).")
    return prompts


# ----------------------------------------------------------------------------------------------- statistics

def _rate(a: int, n: int) -> float | None:
    return round(a / n, 4) if n else None


def teacher_forced_counts(proposals: list[list[int]], answers: list[list[int]], positions: int) -> list[dict]:
    """Top-1 agreement by draft position from the drafts of each context.

    Args:
        proposals: for each context, the draft's tokens (draft position d = index d − 1).
        answers: for each context, the target's greedy tokens that follow it (as many as exist).
        positions: draft positions reported (1..positions).

    Returns:
        [{"position": d, "agree": a, "total": n, "rate": a / n}]: n = contexts with a target token at position
        d (a missing draft token counts as a miss), a = those whose draft token there equals it.
    """
    out = []
    for d in range(positions):
        n = sum(1 for ans in answers if len(ans) > d)
        a = sum(1 for prop, ans in zip(proposals, answers) if len(ans) > d and len(prop) > d and prop[d] == ans[d])
        out.append({"position": d + 1, "agree": a, "total": n, "rate": _rate(a, n)})
    return out


def _draft_depth(rnd) -> int:
    if rnd.tree is not None:
        return max((n.depth for n in rnd.tree.nodes), default=0)
    return rnd.n_drafted


def acceptance_by_position(rounds, positions: int) -> list[dict]:
    """Greedy acceptance by draft position over ``rounds`` (``engine.decoding.trace.Round``).

    Position d is judged in a round whose draft reached depth d (a chain's length, a tree's depth) and whose
    first d − 1 positions were accepted (``n_accepted`` ≥ d − 1); accepted when ``n_accepted`` ≥ d.

    Returns:
        [{"position": d, "accepted", "judged", "rate"}] for d = 1..positions.
    """
    out = []
    for d in range(1, positions + 1):
        judged = [r for r in rounds if _draft_depth(r) >= d and r.n_accepted >= d - 1]
        acc = sum(1 for r in judged if r.n_accepted >= d)
        out.append({"position": d, "accepted": acc, "judged": len(judged), "rate": _rate(acc, len(judged))})
    return out


def round_summary(rounds, positions: int) -> dict:
    """Rounds, draft tokens accepted per round, α̂ = accepted ÷ judged and acceptance by position."""
    by_pos = acceptance_by_position(rounds, positions)
    acc = sum(r.n_accepted for r in rounds)
    judged = sum(p["judged"] for p in by_pos)
    return {"rounds": len(rounds), "accepted": acc, "accepted_per_round": _rate(acc, len(rounds)),
            "judged": judged, "alpha": _rate(sum(p["accepted"] for p in by_pos), judged), "by_position": by_pos}


def median_ratio(plain_ms_per_token: list[float], draft_ms_per_token: list[float]) -> float | None:
    """Median over prompts of plain ms/token ÷ draft ms/token (> 1: the draft is faster)."""
    ratios = [p / d for p, d in zip(plain_ms_per_token, draft_ms_per_token) if d > 0]
    return round(statistics.median(ratios), 4) if ratios else None


# ------------------------------------------------------------------------------------------------ measuring

class _TeacherForcedTarget:
    """What a feature-reading draft sees of the target in a round after the first: ``hidden`` of every position
    but the newest (``CachedLM``'s attributes; ``last_logits`` None: not the first round)."""

    keep_hidden = True

    def __init__(self, hidden: torch.Tensor, ids: list[int]):
        self.all_hidden, self.all_ids, self.n = hidden, ids, 0
        self.last_logits = None

    @property
    def hidden(self) -> torch.Tensor:
        return self.all_hidden[:self.n]

    @property
    def ids(self) -> list[int]:
        return self.all_ids[:self.n]

    @property
    def cached_len(self) -> int:
        return self.n


@torch.inference_mode()
def teacher_forced(target, proposer, prompt_ids: list[int], answer: list[int], positions: int
                   ) -> tuple[list[list[int]], list[list[int]]]:
    """The draft's proposals on every context prompt + answer[:j], 1 ≤ j < len(answer) (see the module), and the
    target's tokens after each: (proposals, answers) for ``teacher_forced_counts``."""
    full = list(prompt_ids) + list(answer)
    P = len(prompt_ids)
    shim = None
    if getattr(proposer, "needs_target_hidden", False):
        h = target.model.get_decoder()(input_ids=torch.tensor([full], device=target.device)).last_hidden_state[0]
        shim = _TeacherForcedTarget(h, full)
        proposer.attach(shim)
    proposer.reset()
    cfg = SamplingConfig()
    gen = torch.Generator().manual_seed(0)
    proposals, answers = [], []
    for j in range(1, len(answer)):
        seq = full[:P + j]
        if shim is not None:
            shim.n = len(seq) - 1
        proposer.rollback(seq)
        proposals.append(list(proposer.propose(seq, positions, cfg, gen).tokens))
        answers.append(full[P + j:P + j + positions])
    return proposals, answers


def compute_path(target) -> dict:
    """The target's compute path (``engine.decoding.compute``, chosen when the model loaded): {"path", "label",
    "reason"}; "default" when the model was loaded without a choice (a test's model)."""
    c = getattr(target, "compute", None)
    if c is None:
        return {"path": path_of(target.model), "label": "PyTorch default (no choice recorded)", "reason": ""}
    return {"path": c.path, "label": c.label(), "reason": c.reason}


def _settings(kind: DraftKind, proposer, gamma: int | None = None) -> tuple[int, int]:
    """(γ, tree size) the engine uses for this draft: ``gamma`` when given (the command line passes
    ``python -m engine generate``'s default for this machine), else the kind's static default (Medusa: its K
    heads); the tree: the proposer's own (Medusa: the static tree chosen for this machine when its pass cost
    was measured, ``drafts._machine_medusa_tree``)."""
    if gamma is None:
        gamma = kind.gamma if kind.gamma is not None else proposer.heads.n_heads
    tree = proposer.tree_size if kind.tree == "saved" else int(kind.tree)
    return gamma, tree


def _run(target, proposer, ids, gamma, tree, max_new):
    dec = SpeculativeDecoder(target, proposer, ids, gamma=gamma, tree=tree if proposer is not None else 0,
                             max_new_tokens=max_new)
    return dec.run()


def draft_card(target, draft: str, prompts: list[str] | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
               max_prompts: int = DEFAULT_MAX_PROMPTS, positions: int = TEACHER_POSITIONS, chat: bool = True,
               gamma: int | None = None, progress=None) -> dict:
    """Measure one draft's card (see the module docstring).

    Args:
        target: the loaded target (``load_model("embedded")``; fp32 so greedy outputs compare exactly).
        draft: a ``DRAFTS`` name ("early-exit:K" for early exit).
        prompts: the prompts (None: the first ``max_prompts`` of the card's held-out set).
        max_new_tokens: N ≥ 1 tokens per answer.
        positions: teacher-forced draft positions reported.
        gamma: γ (a tree's depth) in the engine; None: the kind's static default (see ``_settings``).
        progress: optional callable(message) for each step.

    Returns:
        {"draft", "label", "card", "prompts": {"source", "count", "texts"}, "settings", "machine",
        "teacher_forced", "engine": {"round0", "later", "all", "tokens_per_pass", "identical_to_plain"},
        "speed": {...}}.

    Raises:
        InputError: an unknown draft, no prompts, or N < 1.
    """
    kind, spec = resolve_draft(draft)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be a whole number ≥ 1, got {max_new_tokens!r}.")
    source = "given"
    if prompts is None:
        prompts = heldout_prompts(kind, max_prompts)
        source = (f"the first {len(prompts)} of the card's {kind.heldout_prompts} held-out prompts "
                  f"(engine.training.draft_data.build_prompts({kind.heldout_prompts}, 'heldout', seed=0))")
    prompts = [p for p in prompts if p and p.strip()]
    if not prompts:
        raise InputError("A draft card needs at least one non-empty prompt.")
    say = progress or (lambda msg: None)
    draft_model = None
    if spec == "embedded-draft":
        from engine.decoding.models import load_model

        draft_model = load_model(spec, device=target.device, compute=getattr(target.compute, "path", None))
    # a card measures the draft at a fixed γ (its acceptance by position needs every round to draft γ)
    make = lambda: make_proposer(spec, target, draft_model, length="fixed")  # noqa: E731 - a fresh proposer per run
    first = make()
    gamma, tree = _settings(kind, first, gamma)

    ids_all = [encode_prompt(target.tokenizer, p, chat=chat) for p in prompts]
    say("warm-up")
    _run(target, None, ids_all[0], gamma, tree, min(8, max_new_tokens))
    _run(target, make(), ids_all[0], gamma, tree, min(8, max_new_tokens))

    rounds0, later, tf_props, tf_ans = [], [], [], []
    plain_mspt, draft_mspt, per_prompt = [], [], []
    new_tokens = passes = 0
    plain_ms = draft_ms = plain_tokens = 0.0
    identical = True
    for i, ids in enumerate(ids_all):
        say(f"prompt {i + 1}/{len(ids_all)}: plain and draft runs")
        order = ("plain", "draft") if i % 2 == 0 else ("draft", "plain")
        res = {}
        for which in order:
            res[which] = _run(target, None if which == "plain" else make(), ids, gamma, tree, max_new_tokens)
        base, spec_res = res["plain"], res["draft"]
        identical &= base.token_ids == spec_res.token_ids
        rounds0 += spec_res.rounds[:1]
        later += spec_res.rounds[1:]
        s, b = spec_res.stats, base.stats
        new_tokens += s.new_tokens
        passes += s.target_passes
        plain_ms += b.total_ms
        draft_ms += s.total_ms
        plain_tokens += b.new_tokens
        pm = b.total_ms / max(b.new_tokens, 1)
        dm = s.total_ms / max(s.new_tokens, 1)
        plain_mspt.append(pm)
        draft_mspt.append(dm)
        per_prompt.append({"prompt": i, "order": "/".join(order), "plain_ms_per_token": round(pm, 2),
                           "draft_ms_per_token": round(dm, 2), "ratio": round(pm / dm, 4) if dm > 0 else None,
                           "new_tokens": s.new_tokens, "identical": base.token_ids == spec_res.token_ids})
        say(f"prompt {i + 1}/{len(ids_all)}: teacher-forced drafts")
        p_, a_ = teacher_forced(target, make(), ids, base.token_ids, positions)
        tf_props += p_
        tf_ans += a_

    depth = max([_draft_depth(r) for r in rounds0 + later] + [1])
    return {
        "draft": spec, "label": kind.label, "card": kind.card,
        "prompts": {"source": source, "count": len(prompts), "texts": prompts, "chat_template": chat},
        "settings": {"gamma": gamma, "tree": tree, "max_new_tokens": max_new_tokens, "greedy": True,
                     "dtype": str(next(target.model.parameters()).dtype).replace("torch.", ""),
                     "teacher_forced_positions": positions},
        "machine": {"cpu": cpu_model(), "torch_threads": torch.get_num_threads(), "compute_path": compute_path(target),
                    "python": platform.python_version(), "torch": torch.__version__},
        "teacher_forced": {"contexts": len(tf_props), "by_position": teacher_forced_counts(tf_props, tf_ans, positions)},
        "engine": {"round0": round_summary(rounds0, depth), "later": round_summary(later, depth),
                   "all": round_summary(rounds0 + later, depth), "new_tokens": new_tokens, "target_passes": passes,
                   "tokens_per_pass": _rate(new_tokens, passes), "identical_to_plain": identical},
        "speed": {"median_ratio": median_ratio(plain_mspt, draft_mspt),
                  "total_ratio": round(plain_ms / plain_tokens / (draft_ms / new_tokens), 4)
                  if plain_tokens and new_tokens and draft_ms > 0 else None,
                  "plain_tokens_per_s": round(plain_tokens / plain_ms * 1000, 2) if plain_ms else None,
                  "draft_tokens_per_s": round(new_tokens / draft_ms * 1000, 2) if draft_ms else None,
                  "per_prompt": per_prompt,
                  "rule": "one plain and one draft run per prompt, alternating which goes first, after a warm-up; "
                          "ratio = plain ms/token ÷ draft ms/token (prefill included)"},
    }


def _fmt(x, nd: int = 2) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def _positions(rows: list[dict], key: str = "rate") -> str:
    return ", ".join(_fmt(r[key]) for r in rows)


def _spread(per_prompt: list[dict]) -> str:
    r = [p["ratio"] for p in per_prompt if p.get("ratio") is not None]
    return f"{min(r):.2f}–{max(r):.2f}×" if r else "—"


def card_markdown(card: dict, command: str | None = None) -> str:
    """The card as a markdown section: what was run, then one table of the measures."""
    e, tf, sp, m, st = card["engine"], card["teacher_forced"], card["speed"], card["machine"], card["settings"]
    shape = f"tree of {st['tree']} nodes, depth ≤ {st['gamma']}" if st["tree"] else f"chain, γ = {st['gamma']}"
    if st.get("gamma_source"):
        shape += f" (γ: {st['gamma_source']})"
    lines = [f"### Draft card: {card['label']} (`{card['draft']}`)", ""]
    if command:
        lines += [f"`{command}`", ""]
    lines += [f"Prompts: {card['prompts']['source']}; {card['prompts']['count']} prompts, chat template "
              f"{'on' if card['prompts']['chat_template'] else 'off'}, greedy, ≤ {st['max_new_tokens']} new tokens, "
              f"{st['dtype']}; {shape}. Machine: {m['cpu']}, {m['torch_threads']} torch threads, compute path: "
              f"{m['compute_path']['label']}.", "",
              "| measure | value |", "|---|---|",
              f"| teacher-forced top-1 agreement by draft position 1..{len(tf['by_position'])} ({tf['contexts']} contexts) "
              f"| {_positions(tf['by_position'])} |",
              f"| in-engine greedy acceptance by draft position, round 0 ({e['round0']['rounds']} rounds) "
              f"| {_positions(e['round0']['by_position'])} |",
              f"| in-engine greedy acceptance by draft position, rounds ≥ 1 ({e['later']['rounds']} rounds) "
              f"| {_positions(e['later']['by_position'])} |",
              f"| α̂ = accepted ÷ judged, rounds ≥ 1 / all rounds | {_fmt(e['later']['alpha'])} / {_fmt(e['all']['alpha'])} |",
              f"| accepted draft tokens per round, round 0 / rounds ≥ 1 | {_fmt(e['round0']['accepted_per_round'])} / "
              f"{_fmt(e['later']['accepted_per_round'])} |",
              f"| tokens per target pass (prefill pass included) | {_fmt(e['tokens_per_pass'])} |",
              f"| tokens/s, plain / draft | {_fmt(sp['plain_tokens_per_s'], 1)} / {_fmt(sp['draft_tokens_per_s'], 1)} |",
              f"| speed × plain: median of per-prompt ratios (all tokens ÷ all time; per-prompt range) "
              f"| **{_fmt(sp['median_ratio'])}×** ({_fmt(sp['total_ratio'])}×; {_spread(sp['per_prompt'])}) |",
              f"| greedy output identical to plain decoding | {'yes' if e['identical_to_plain'] else 'NO'} |", ""]
    return "\n".join(lines)


def print_progress(msg: str) -> None:
    print(f"[draft-card] {msg}", file=sys.stderr, flush=True)
