"""The explainer's 5-word toy target and draft, run through the engine's own speculative sampling.

Vocabulary ["the", "cat", "sat", "on", "mat"]. Both models are bigram models: after word w, the next
word in the cycle (the → cat → sat → on → mat → the) gets weight ``peak`` and every other word weight 1,
normalised. The target is more confident (default peak 8) than the draft (default peak 4); with these
defaults α = Σ min(p, q) = 4·(1/12) + 4/8 = 5/6 ≈ 0.83 after every word.

:func:`run_toy_rounds` drafts γ tokens autoregressively from q (batched torch.multinomial, the
vectorised form of :func:`engine.decoding.sampling.sample`), builds the target's p rows at the same contexts
plus the bonus row, and decides every round with
:func:`engine.decoding.sampling.verify_sampling` — the same code the live engine uses — so the histogram of the
first emitted token tests the real rule (Leviathan et al. 2023, Theorem 3.5 / Appendix A.1: the
output is distributed exactly as p).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine.decoding.sampling import Verdict, sample, verify_sampling
from engine.errors import InputError

VOCAB: tuple[str, ...] = ("the", "cat", "sat", "on", "mat")
TOY_MAX_ROUNDS = 20_000
TOY_MAX_GAMMA = 8
PEAK_RANGE = (1.0, 50.0)


def _check_peak(peak: float, who: str) -> float:
    try:
        x = float(peak)
    except (TypeError, ValueError):
        raise InputError(f"The {who}'s confidence must be a number, got {peak!r}.") from None
    if not (PEAK_RANGE[0] <= x <= PEAK_RANGE[1]):
        raise InputError(f"The {who}'s confidence (weight of its favourite next word) must be in "
                         f"[{PEAK_RANGE[0]:g}, {PEAK_RANGE[1]:g}], got {peak}.")
    return x


def bigram_matrix(peak: float) -> torch.Tensor:
    """[V, V] float64: row w is the next-word distribution after word w (favourite = next in cycle).

    Entry [w, (w+1) mod 5] = peak / (peak + 4), every other entry 1 / (peak + 4).
    """
    pk = _check_peak(peak, "model")
    v = len(VOCAB)
    m = torch.ones(v, v, dtype=torch.float64)
    for w in range(v):
        m[w, (w + 1) % v] = pk
    return m / m.sum(dim=1, keepdim=True)


def toy_target(prev: str, peak: float = 8.0) -> torch.Tensor:
    """Target p [V] (float64) after word ``prev``; ``peak`` is the favourite word's weight."""
    return bigram_matrix(peak)[_word(prev)]


def toy_draft(prev: str, peak: float = 4.0) -> torch.Tensor:
    """Draft q [V] (float64) after word ``prev``; a less confident copy of the target by default."""
    return bigram_matrix(peak)[_word(prev)]


def _word(w: str) -> int:
    if w not in VOCAB:
        raise InputError(f"Unknown toy word {w!r}; choose one of {', '.join(VOCAB)}.")
    return VOCAB.index(w)


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> float:
    """α = Σ_x min(p(x), q(x)) (Leviathan et al. 2023, Definition 3.1 and Corollary 3.6)."""
    return float(torch.minimum(p.to(torch.float64), q.to(torch.float64)).sum())


def verify_always_accept(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor,
                         generator: torch.Generator) -> Verdict:
    """A deliberately WRONG rule, for demonstration and tests: keep every draft token, then a bonus.

    The first emitted token is then distributed as the draft's q, not the target's p.
    """
    k = len(draft_tokens)
    return Verdict(k, sample(p[k], generator), "bonus", [1.0] * k, [])


VerifyFn = Callable[[list[int], torch.Tensor, torch.Tensor, torch.Generator], Verdict]


@dataclass
class ToyResult:
    """Outcome of ``n_rounds`` speculative-sampling rounds on the toy models.

    Attributes:
        vocab: the 5 words. context: the word before each round.
        p: [5] target distribution of the first token after the context. q: [5] the draft's.
        first_counts: [5] how often each word was the first token emitted in a round.
        first_freq: [5] first_counts / n_rounds.
        chi2, chi2_p: χ² goodness-of-fit statistic and p-value of first_counts against n·p
            (scipy.stats.chisquare, 4 degrees of freedom).
        tvd: total variation distance ½ Σ |first_freq − p|.
        alpha_formula: Σ min(p, q) at the context.
        alpha_measured: accepted draft tokens / draft tokens evaluated (accepted + rejected).
        tokens_per_pass: mean tokens emitted per round (one target pass each).
        tokens_formula: (1 − α^(γ+1)) / (1 − α) with α = alpha_formula (Leviathan et al. 2023, Eq. 1).
        tokens_counts: [γ + 1] rounds that emitted k = 1..γ+1 tokens.
    """

    vocab: list[str]
    context: str
    gamma: int
    n_rounds: int
    seed: int
    p: list[float]
    q: list[float]
    first_counts: list[int]
    first_freq: list[float]
    chi2: float
    chi2_p: float
    tvd: float
    alpha_formula: float
    alpha_measured: float
    tokens_per_pass: float
    tokens_formula: float
    tokens_counts: list[int]
    rule: str


def run_toy_rounds(n_rounds: int = 20_000, gamma: int = 4, target_peak: float = 8.0,
                   draft_peak: float = 4.0, context: str = "cat", seed: int = 0,
                   verify: VerifyFn = verify_sampling) -> ToyResult:
    """Run ``n_rounds`` independent rounds of speculative sampling from ``context`` on the toy models.

    Each round: draft γ tokens autoregressively from the toy draft q (rows [γ, 5] at contexts
    context, x1, …, x_{γ−1}; drawn for all rounds at once with torch.multinomial, the batched form of
    :func:`engine.decoding.sampling.sample`, from the same generator); take the
    target's rows p [γ + 1, 5] at the same contexts plus the one after x_γ (the bonus row); call
    ``verify`` (by default :func:`engine.decoding.sampling.verify_sampling`, the engine's rule) with one seeded
    ``torch.Generator`` for the whole run. Emitted tokens = accepted draft tokens + the correction or
    bonus token. Cost: about 0.1 ms per round, dominated by the per-round verify call (10 000 rounds:
    1.5 s measured on a busy 2-core CPU, see benchmarks/results/whatif_rerun.md).

    Args:
        n_rounds: 1..20 000. gamma: γ, 1..8. target_peak, draft_peak: favourite-word weights in
            [1, 50] (1 = uniform). context: one of VOCAB. seed: generator seed.
        verify: the verification rule; pass :func:`verify_always_accept` to see a wrong rule fail.

    Returns:
        :class:`ToyResult` with the first-token histogram, χ² p-value (scipy.stats.chisquare) and
        total variation distance against p, measured vs Σ min(p, q) acceptance, and measured vs
        formula tokens per pass.

    Raises:
        InputError: any argument out of range.
    """
    from scipy.stats import chisquare

    if isinstance(n_rounds, bool) or not isinstance(n_rounds, (int, np.integer)) \
            or not (1 <= n_rounds <= TOY_MAX_ROUNDS):
        raise InputError(f"Number of rounds must be 1..{TOY_MAX_ROUNDS}, got {n_rounds!r}.")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) \
            or not (1 <= gamma <= TOY_MAX_GAMMA):
        raise InputError(f"Draft length γ must be 1..{TOY_MAX_GAMMA} for the toy, got {gamma!r}.")
    P = bigram_matrix(_check_peak(target_peak, "target"))
    Q = bigram_matrix(_check_peak(draft_peak, "draft"))
    c0 = _word(context)
    g = torch.Generator().manual_seed(int(seed))
    v = len(VOCAB)
    first = [0] * v
    tokens_counts = [0] * (gamma + 1)
    accepted = evaluated = total_tokens = 0
    n = int(n_rounds)
    # Draft: γ autoregressive draws from q for all rounds at once, one torch.multinomial per position
    # (the batched form of engine.decoding.sampling.sample, same generator): ctx[:, i] is the word before
    # draft token i, so ctx[:, 0] = context and ctx[:, i + 1] = x_i.
    ctx = torch.full((n, gamma + 1), c0, dtype=torch.long)
    for i in range(gamma):
        ctx[:, i + 1] = torch.multinomial(Q[ctx[:, i]], 1, generator=g).squeeze(1)
    q_rows = Q[ctx[:, :-1]].unbind(0)                      # n × [γ, V]
    p_rows = P[ctx].unbind(0)                              # n × [γ + 1, V]
    drafts = ctx[:, 1:].tolist()
    for r in range(n):
        draft = drafts[r]
        verdict = verify(draft, q_rows[r], p_rows[r], g)   # the engine's accept/reject decision
        n_acc = verdict.n_accepted
        emitted = draft[:n_acc] + [verdict.next_token]
        first[emitted[0]] += 1
        tokens_counts[len(emitted) - 1] += 1
        total_tokens += len(emitted)
        accepted += n_acc
        evaluated += n_acc + (1 if verdict.next_kind == "correction" else 0)
    n = int(n_rounds)
    p0, q0 = P[c0], Q[c0]
    alpha = acceptance_rate(p0, q0)
    freq = [f / n for f in first]
    expected = (p0 * n).tolist()
    chi2, chi2_p = chisquare(first, expected)
    tvd = 0.5 * sum(abs(f - float(pi)) for f, pi in zip(freq, p0))
    tokens_formula = sum(alpha ** k for k in range(gamma + 1))  # = (1 − α^(γ+1))/(1 − α), Eq. 1
    rule = "speculative sampling (engine.decoding.sampling.verify_sampling)" if verify is verify_sampling \
        else getattr(verify, "__name__", "custom rule")
    return ToyResult(
        vocab=list(VOCAB), context=context, gamma=int(gamma), n_rounds=n, seed=int(seed),
        p=p0.tolist(), q=q0.tolist(), first_counts=first, first_freq=freq,
        chi2=float(chi2) if math.isfinite(float(chi2)) else 0.0,
        chi2_p=float(chi2_p) if math.isfinite(float(chi2_p)) else 1.0,
        tvd=float(tvd), alpha_formula=alpha,
        alpha_measured=accepted / evaluated if evaluated else 1.0,
        tokens_per_pass=total_tokens / n, tokens_formula=float(tokens_formula),
        tokens_counts=tokens_counts, rule=rule)
