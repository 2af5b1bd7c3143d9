"""Per-round draft length from 0 up: a round drafts only as many tokens as the expected gain pays for.

A round that drafts k tokens and verifies them in one target pass costs, in plain decoding steps,

    T(k) = t(k + 1)/t(1) + c·k        (T(0) = 1: a plain step)

(t: this machine's measured pass-cost curve, ``engine.decoding.pass_cost``; c: one draft step ÷ one target step,
measured) and yields in expectation

    E(k) = 1 + Σ_{i=1..k} Π_{j≤i} a_j

tokens, where a_j is the chance that draft token j is accepted given that tokens 1..j−1 were (Leviathan et al. 2023,
§3.1, with a different a per position instead of one α). The round's expected speedup over plain decoding is
S(k) = E(k)/T(k), S(0) = 1.

The rule (``LengthRule``), applied while drafting: with tokens 1..i drafted, the draft's distribution q for token
i + 1 is computed; its confidence (max q, taken *before* the token is drawn) gives â_{i+1} = min(A_MAX, ρ·max q),
where ρ calibrates the draft's confidence against its running acceptance in this sequence (ρ = (accepted + w·ρ₀) ÷
(Σ confidence of judged tokens + w), exponentially forgetting older rounds). Token i + 1 is drafted iff some length
k' in i + 1..γ beats stopping at i, i.e. max_{k'} S(k') > S(i), with the tokens after i + 1 projected at â_{i+1}
(the curve may be flat over a few tokens, so one more token can pay only together with the next), by more than
the curve's own noise (``Costs.tolerance``: a draft that expects 1.01× is within what the costs can move). Otherwise
the round stops at i; i = 0 is a plain target step.

The ideas are the field's (code is ours): SpecDec++ (Huang et al. 2024) stops drafting when an acceptance estimate
says the expected loss exceeds the gain; EAGLE-2 (Li et al. 2024, §4) uses the draft's confidence as that estimate;
llama.cpp's ``--draft-p-min`` stops below a draft probability; vLLM's dynamic speculative decoding (Liu et al.
2024, "Optimizing speculative decoding for serving") chooses the length from a goodput model of acceptance and cost.

Lossless: whether token i + 1 is drafted depends only on the draft's own state (tokens 1..i and the distribution of
token i + 1 before it is drawn) and on earlier rounds, never on this round's target pass, so each drafted token is
judged by the usual rule and the output follows the target exactly (greedy: the same text as plain greedy decoding).
The rule makes no random draws and reads no clock, so a seeded run is repeatable.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

from engine.errors import InputError

ADAPTIVE_GAMMA_MAX = 6
"""The default cap on a round's draft under the adaptive rule (the γ the head's rounds are timed up to,
``pass_cost.HEAD_ROUND_GAMMAS``); the rule stops earlier wherever the expected gain says so."""
A_MAX = 0.98
"""The largest acceptance estimate (a calibrated confidence of 1 is still not a certain acceptance)."""
PRIOR_WEIGHT = 2.0
"""w: the prior's weight in the calibration, in judged tokens."""
FORGET = 0.9
"""Each round's sums are multiplied by this before the new outcomes are added (acceptance drifts along a text:
a copied stretch, then free text)."""
LOOKUP_PRIOR = 0.5
"""ρ₀ of prompt lookup, whose q is a point mass (confidence 1): its estimate starts at 0.5 and follows its running
acceptance (prompt lookup on a code edit accepts most tokens, on a chat answer few)."""
LENGTH_POLICIES = ("adaptive", "fixed")


def check_policy(length: str) -> str:
    """A draft-length policy name: "adaptive" (this module) or "fixed" (every round drafts γ).

    Raises:
        InputError: another name.
    """
    if length not in LENGTH_POLICIES:
        raise InputError(f"The draft length is 'adaptive' or 'fixed', got {length!r}.")
    return length


def expected_tokens(a: Sequence[float]) -> float:
    """E(k) = 1 + Σ_{i=1..k} Π_{j≤i} a_j: expected tokens of a round drafting len(a) tokens whose conditional
    acceptance chances are ``a`` (the accepted draft tokens plus the target's own token). E.g. a = [0.5, 0.5]:
    1 + 0.5 + 0.25 = 1.75."""
    total, run = 1.0, 1.0
    for x in a:
        run *= float(x)
        total += run
    return total


@dataclass(frozen=True)
class Costs:
    """What a round costs on this machine, in plain decoding steps.

    Attributes:
        ratios: (t(1)/t(1), t(2)/t(1), …, t(γ_max + 1)/t(1)) from the pass-cost curve (1.0 first).
        draft_cost: c, one draft step ÷ one target step (≥ 0).
        source: one line saying where the numbers come from.
        tolerance: the relative gain a longer draft must add to be drafted (the measured curve's own noise,
            ``engine.explain.analytic.gamma_tolerance``: 3–5 %); a draft within it of stopping is not worth the
            risk that the costs moved (0: any gain).
    """

    ratios: tuple[float, ...]
    draft_cost: float
    source: str = ""
    tolerance: float = 0.0

    def __post_init__(self):
        if not self.ratios or abs(self.ratios[0] - 1.0) > 1e-9 or self.draft_cost < 0 or not 0 <= self.tolerance < 1:
            raise ValueError("costs need t(1)/t(1) = 1 first, a draft cost c ≥ 0 and a tolerance in [0, 1)")

    @property
    def gamma_max(self) -> int:
        """The longest draft these costs cover (ratios up to t(γ_max + 1))."""
        return len(self.ratios) - 1

    def round_cost(self, k: int) -> float:
        """T(k) = t(k + 1)/t(1) + c·k (T(0) = 1).

        Raises:
            ValueError: k outside 0..γ_max.
        """
        if not 0 <= k <= self.gamma_max:
            raise ValueError(f"k must be in 0..{self.gamma_max}, got {k}")
        return self.ratios[k] + self.draft_cost * k

    def speedup(self, a: Sequence[float]) -> float:
        """S(k) = E(k)/T(k) for the k = len(a) tokens' acceptance chances ``a``."""
        return expected_tokens(a) / self.round_cost(len(a))

    def best_length(self, a: Sequence[float], k_min: int, k_max: int, a_rest: float) -> tuple[int, float]:
        """The k in k_min..k_max with the largest S(k), the shortest on a tie; positions past len(a) get
        ``a_rest``. Returns (k, S(k)); (k_min, S(k_min)) when k_max < k_min."""
        best_k, best_s = k_min, -1.0
        for k in range(k_min, max(k_min, k_max) + 1):
            s = self.speedup(list(a[:k]) + [a_rest] * max(0, k - len(a)))
            if s > best_s + 1e-12:
                best_k, best_s = k, s
        return best_k, best_s


def costs_from_curve(curve, draft_cost: float, gamma_max: int = ADAPTIVE_GAMMA_MAX, draft_source: str = "") -> Costs:
    """``Costs`` from a pass-cost curve (``pass_cost.PassCost``: its ``ratio(n)``, interpolated between measured
    sizes) and a draft step cost c.

    Raises:
        InputError: γ_max outside 1..64 or c < 0.
    """
    if not (isinstance(gamma_max, int) and 1 <= gamma_max <= 64):
        raise InputError(f"The adaptive draft length needs a cap γ from 1 to 64, got {gamma_max!r}.")
    if not draft_cost >= 0:
        raise InputError(f"A draft step's cost c must be ≥ 0, got {draft_cost!r}.")
    from engine.explain.analytic import gamma_tolerance

    ratios = tuple([1.0] + [float(curve.ratio(n)) for n in range(2, gamma_max + 2)])
    tol = gamma_tolerance(curve)
    return Costs(ratios, float(draft_cost), f"{getattr(curve, 'source', '') or 'pass-cost curve'}; c = "
                 f"{draft_cost:.3f}{' (' + draft_source + ')' if draft_source else ''}; tolerance {tol:.0%}", tol)


def head_step_cost(curve) -> tuple[float, str]:
    """c of the shipped draft head on this machine: from the head's rounds timed by ``python -m engine prepare``
    (``curve.extra["head_rounds"]``: round_ms(γ) and plain_ms), c = median over γ of (round_ms(γ)/plain_ms −
    t(γ + 1)/t(1)) ÷ γ, floored at 0 (what a round costs beyond its verify pass, per drafted token: the head's
    steps and the judging of its tokens); else the head card's c (``engine.explain.analytic.HEAD_CARD_C``).
    Returns (c, where it comes from)."""
    rounds = (getattr(curve, "extra", None) or {}).get("head_rounds") if curve is not None else None
    try:
        plain = float(rounds["plain_ms"])
        per = [(float(ms) / plain - curve.ratio(int(g) + 1)) / int(g) for g, ms in rounds["round_ms"].items()]
        if plain > 0 and per:
            return max(0.0, statistics.median(per)), "the head's rounds timed on this machine"
    except (TypeError, KeyError, ValueError, ZeroDivisionError):
        pass
    from engine.explain.analytic import HEAD_CARD_C

    return HEAD_CARD_C, "the head card's c"


@dataclass
class LengthChoice:
    """How a round's draft length was chosen (the trace record; ``Round.choice``).

    Attributes:
        source: which draft drafted the round's tokens ("draft head", "prompt lookup", …).
        k: tokens drafted (0: a plain target step). gamma_max: the most the round could draft.
        confidence: the draft's confidence (max q before each draw) of each drafted token, then of the token
            it stopped before (if it computed one). For prompt lookup, 1 per token.
        acceptance: â of each drafted token (and of the one it stopped before), as the rule estimated it.
        expected_tokens: E(k). cost: T(k) in plain steps. expected_speedup: S(k) = E(k)/T(k).
        next_speedup: the best S with the next token added (what stopping turned down); None when the round
            drafted γ_max or the draft had nothing more to offer.
        stopped: why the round stopped: "gain" (one more token did not pay), "gamma" (the cap), "draft" (the draft
            had nothing more: no match, no features yet), "plain" (drafting nothing was the better bet).
        alternatives: {draft: its expected speedup S} of the drafts a combined proposer compared this round.
        ratio: ρ, the confidence's calibration at the round's start.
    """

    source: str
    k: int
    gamma_max: int
    confidence: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    expected_tokens: float = 1.0
    cost: float = 1.0
    expected_speedup: float = 1.0
    next_speedup: float | None = None
    stopped: str = "gamma"
    alternatives: dict[str, float] = field(default_factory=dict)
    ratio: float = 1.0

    def line(self) -> str:
        """One sentence for a page: the choice and the expected gain it came from."""
        if self.k == 0:
            why = ("nothing to draft" if self.stopped == "draft" else
                   f"a first token at â = {self.acceptance[0]:.2f} would have given {self.next_speedup:.2f}×"
                   if self.acceptance and self.next_speedup is not None else "drafting would not pay")
            return f"{self.source}: drafted 0 (a plain step): {why}."
        s = (f"{self.source}: drafted {self.k} (expects {self.expected_tokens:.2f} tokens for "
             f"{self.cost:.2f} plain steps: {self.expected_speedup:.2f}×)")
        if self.stopped == "gain" and self.next_speedup is not None:
            s += f"; one more (â = {self.acceptance[self.k]:.2f}) would give {self.next_speedup:.2f}×"
        elif self.stopped == "gamma":
            s += f"; the cap γ = {self.gamma_max}"
        return s + "."


class LengthRule:
    """The per-round rule of the module docstring, for one sequence (its calibration is that sequence's).

    Use per round: ``start(k_max)``; while drafting, ``offer(confidence)`` before drawing each token (True: draft
    it); ``finish(seq_len, tokens)`` → the round's ``LengthChoice``; after the round is judged, ``observe(seq)``
    updates the calibration from how many drafted tokens the sequence kept.

    Args:
        costs: this machine's ``Costs``.
        source: the draft's name in the trace.
        prior: ρ₀, the calibration before any judged token (1: take the draft's confidence at face value;
            prompt lookup's point masses: ``LOOKUP_PRIOR``).
        rate_prior: the acceptance ``rate`` starts from (default: ``prior``; the shipped head: its held-out
            first-token agreement).
        weight: w, the prior's weight in judged tokens. forget: per-round forgetting of the sums.

    Raises:
        ValueError: a prior outside (0, 1], w ≤ 0 or forget outside (0, 1].
    """

    def __init__(self, costs: Costs, source: str = "draft", prior: float = 1.0, weight: float = PRIOR_WEIGHT,
                 forget: float = FORGET, rate_prior: float | None = None):
        rate_prior = prior if rate_prior is None else rate_prior
        if not 0 < prior <= 1 or not 0 < rate_prior <= 1 or weight <= 0 or not 0 < forget <= 1:
            raise ValueError("0 < prior ≤ 1, 0 < rate_prior ≤ 1, weight > 0 and 0 < forget ≤ 1 expected")
        self.costs, self.source = costs, source
        self.prior, self.weight, self.forget = float(prior), float(weight), float(forget)
        self.rate_prior = float(rate_prior)
        self.reset()

    def reset(self) -> None:
        """Forget the calibration (a new sequence)."""
        self.accepted = 0.0  # forgotten sum of judged tokens' outcomes (1 accepted, 0 rejected)
        self.conf_sum = 0.0  # forgotten sum of their confidences
        self.judged = 0.0  # forgotten count of judged tokens
        self._pending: tuple[int, list[int], list[float]] | None = None
        self._round: dict | None = None

    @property
    def ratio(self) -> float:
        """ρ = (accepted + w·ρ₀) ÷ (Σ confidence + w)."""
        return (self.accepted + self.weight * self.prior) / (self.conf_sum + self.weight)

    def rate(self) -> float:
        """The running acceptance of judged tokens, with the prior: (accepted + w·``rate_prior``) ÷ (judged + w),
        at most ``A_MAX``: an estimate of â without a confidence in hand (a combined draft's choice of drafter)."""
        return min(A_MAX, (self.accepted + self.weight * self.rate_prior) / (self.judged + self.weight))

    def estimate(self, confidence: float) -> float:
        """â = min(A_MAX, ρ·confidence)."""
        return min(A_MAX, max(0.0, self.ratio * float(confidence)))

    def start(self, k_max: int) -> None:
        """A round begins; it may draft up to ``k_max`` tokens (at most the costs' γ_max)."""
        self._round = {"k_max": max(0, min(int(k_max), self.costs.gamma_max)), "conf": [], "a": [],
                       "next": None, "ratio": self.ratio}

    def offer(self, confidence: float) -> bool:
        """Whether to draft the next token, whose draft distribution has max q = ``confidence`` (before it is
        drawn). Records the estimate either way."""
        r = self._round
        if r is None:
            raise ValueError("LengthRule.start was not called")
        i = len(r["a"])
        if i >= r["k_max"]:
            return False
        a_next = self.estimate(confidence)
        k_best, s_best = self.costs.best_length(r["a"] + [a_next], i + 1, r["k_max"], a_next)
        take = s_best > self.costs.speedup(r["a"]) * (1 + self.costs.tolerance) + 1e-12
        r["conf"].append(float(confidence))
        r["a"].append(a_next)
        if not take:
            r["next"] = s_best
            r["stopped"] = "gain" if i else "plain"
        return take

    def finish(self, seq_len: int, tokens: list[int], stopped: str | None = None,
               alternatives: dict[str, float] | None = None) -> LengthChoice:
        """The round's draft is ``tokens`` (proposed after a sequence of ``seq_len`` tokens): its record, kept to
        be judged by ``observe``. ``stopped`` overrides the reason (e.g. "draft" when the draft ran out)."""
        r = self._round or {"k_max": len(tokens), "conf": [1.0] * len(tokens), "a": [], "next": None,
                            "ratio": self.ratio}
        k = len(tokens)
        a = r["a"][:k] if len(r["a"]) >= k else [self.estimate(c) for c in r["conf"][:k]]
        reason = stopped or r.get("stopped") or ("gamma" if k >= r["k_max"] else "draft")
        self._pending = (seq_len, list(tokens), list(r["conf"][:k]))
        self._round = None
        return LengthChoice(source=self.source, k=k, gamma_max=r["k_max"], confidence=list(r["conf"]),
                            acceptance=list(r["a"]), expected_tokens=expected_tokens(a),
                            cost=self.costs.round_cost(k), expected_speedup=self.costs.speedup(a),
                            next_speedup=r["next"], stopped=reason, alternatives=dict(alternatives or {}),
                            ratio=r["ratio"])

    def plan_flat(self, a: float, k_max: int) -> tuple[int, float]:
        """The best length for a draft whose every token has acceptance chance ``a`` (prompt lookup's): (k, S(k))
        over k in 0..min(k_max, γ_max), as ``offer`` would stop token by token at that estimate (the tolerance
        included)."""
        k_max, c = min(k_max, self.costs.gamma_max), self.costs
        k = 0
        while k < k_max and c.best_length([a] * (k + 1), k + 1, k_max, a)[1] > \
                c.speedup([a] * k) * (1 + c.tolerance) + 1e-12:
            k += 1
        return k, c.speedup([a] * k)

    def observe(self, seq: list[int]) -> None:
        """The round ended with ``seq``: count the drafted tokens it kept (accepted) and the first it did not
        (rejected) into the calibration. Tokens after a rejection were not judged and do not count."""
        if self._pending is None:
            return
        n, tokens, conf = self._pending
        self._pending = None
        if not tokens:
            return
        kept = 0
        while kept < len(tokens) and n + kept < len(seq) and seq[n + kept] == tokens[kept]:
            kept += 1
        ended = n + kept >= len(seq)  # the sequence ended inside the draft (EOS or the token limit)
        judged = kept if (ended and kept < len(tokens)) else min(kept + 1, len(tokens))
        self.accepted = self.accepted * self.forget + kept
        self.conf_sum = self.conf_sum * self.forget + sum(conf[:judged])
        self.judged = self.judged * self.forget + judged


def machine_rule(target, source: str = "draft head", gamma_max: int = ADAPTIVE_GAMMA_MAX,
                 rate_prior: float | None = None) -> LengthRule:
    """A ``LengthRule`` on ``target``'s costs here: this machine's pass-cost curve for its compute path
    (``pass_cost.cached_pass_cost``; before ``python -m engine prepare`` measured it, the shipped curve, labelled)
    and the head's step cost c (``head_step_cost``). Never measures, so building a draft stays quick.

    Raises:
        InputError: γ_max outside 1..64.
    """
    from engine.decoding import pass_cost

    curve = pass_cost.cached_pass_cost(target.spec, target.compute.path if target.compute else "default",
                                       target.device.type)
    if curve is None:
        curve = pass_cost.shipped_pass_cost()
    c, why = head_step_cost(curve)
    return LengthRule(costs_from_curve(curve, c, gamma_max, why), source=source, rate_prior=rate_prior)


def choice_summary(rounds) -> dict | None:
    """What a run's length rule chose (rounds with a ``choice``): {"rounds": n, "by_length": {k: rounds},
    "by_source": {draft: rounds that drafted with it}, "plain": rounds that drafted 0, "mean_expected": the mean
    expected speedup S of the rounds, "line": one sentence}; None when no round has a choice (a fixed γ)."""
    chosen = [r.choice for r in rounds if getattr(r, "choice", None) is not None]
    if not chosen:
        return None
    by_len: dict[int, int] = {}
    by_src: dict[str, int] = {}
    for c in chosen:
        by_len[c.k] = by_len.get(c.k, 0) + 1
        if c.k:
            by_src[c.source] = by_src.get(c.source, 0) + 1
    mean = sum(c.expected_speedup for c in chosen) / len(chosen)
    lengths = ", ".join(f"{k}: {n}" for k, n in sorted(by_len.items()))
    srcs = "; ".join(f"{s} drafted {n}" for s, n in sorted(by_src.items(), key=lambda x: -x[1]))
    line = (f"adaptive length: {len(chosen)} rounds by tokens drafted ({lengths}); {by_len.get(0, 0)} plain "
            f"steps{'; ' + srcs if srcs else ''}; expected {mean:.2f}× a plain step per round on average")
    return {"rounds": len(chosen), "by_length": dict(sorted(by_len.items())), "by_source": by_src,
            "plain": by_len.get(0, 0), "mean_expected": mean, "line": line}


def slope_costs(slope: float, draft_cost: float, gamma_max: int = ADAPTIVE_GAMMA_MAX) -> Costs:
    """``Costs`` of the explainer's verify-cost model t(n) = t(1)·(1 + s·(n − 1)) (What-if's slope s) and a draft
    step c.

    Raises:
        InputError: s or c negative, γ_max outside 1..64.
    """
    if not (slope >= 0 and draft_cost >= 0 and isinstance(gamma_max, int) and 1 <= gamma_max <= 64):
        raise InputError(f"The verify slope and draft cost must be ≥ 0 and γ from 1 to 64, got {slope!r}, "
                         f"{draft_cost!r}, {gamma_max!r}.")
    return Costs(tuple(1.0 + slope * n for n in range(gamma_max + 1)), float(draft_cost),
                 f"t(n) = t(1)·(1 + {slope:g}·(n − 1)), c = {draft_cost:g}")


def rule_examples(costs: Costs, estimates=(0.95, 0.8, 0.6, 0.4, 0.25, 0.1)) -> list[dict]:
    """What the rule drafts where every token's estimated acceptance is â (a row per â): {"â": â, "tokens drafted":
    the k it stops at (``LengthRule.offer`` token by token at a confidence of â, calibration 1), "expected ×": S(k),
    "one more ×": the best S with one more token (None at the cap)}."""
    rows = []
    for a in estimates:
        rule = LengthRule(costs)
        rule.start(costs.gamma_max)
        k = 0
        while k < costs.gamma_max and rule.offer(a):
            k += 1
        ch = rule.finish(0, [0] * k)
        rows.append({"â": a, "tokens drafted": k, "expected ×": round(ch.expected_speedup, 3),
                     "one more ×": None if ch.next_speedup is None else round(ch.next_speedup, 3)})
    return rows
