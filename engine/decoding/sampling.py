"""Logits → probabilities, sampling, and the verification rules of speculative decoding.

Everything that decides a token lives here, so the live engine, the toy distribution check and the
tests all use the same code.

Sources:
- Speculative sampling rule: Leviathan, Kalman & Matias, "Fast Inference from Transformers via
  Speculative Decoding" (ICML 2023), Algorithm 1 and Appendix A.1; Chen et al., "Accelerating Large
  Language Model Decoding with Speculative Sampling" (2023), Algorithm 2 ("modified rejection
  sampling"): accept x ~ q with probability min(1, p(x)/q(x)); on rejection sample from
  norm(max(0, p − q)); after γ acceptances sample a bonus token from p.
- Temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020), in the order transformers'
  logits processors apply them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import InputError

MAX_GAMMA = 64


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax).

    Attributes:
        temperature: ≥ 0; 0 is greedy.
        top_k: keep the k most likely tokens; 0 turns it off.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p; in (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0) or self.temperature > 100:  # also catches NaN
            raise InputError(f"Temperature must be between 0 and 100, got {self.temperature}.")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise InputError(f"top-k must be a whole number ≥ 0 (0 = off), got {self.top_k}.")
        if not (0 < self.top_p <= 1):
            raise InputError(f"top-p must be in (0, 1], got {self.top_p}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution a token is sampled from: temperature, top-k, top-p, softmax.

    Args:
        logits: [..., V] raw scores.
        cfg: sampling settings; for greedy (T = 0) the result is the softmax at T = 1 restricted by
            top-k/top-p (for display only: greedy decisions use ``argmax`` of the logits).

    Returns:
        [..., V] float probabilities in the logits' dtype (use float32/float64 logits), each row
        summing to 1, exactly 0 outside the kept set.
    """
    x = logits / (cfg.temperature if cfg.temperature > 0 else 1.0)
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # mass strictly before each token; drop a token once the mass before it already reaches top_p
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= cfg.top_p
        drop_sorted[..., 0] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a probability vector [V] (need not be normalized, must be ≥ 0).

    Raises:
        ValueError: if the vector has no positive mass (a bug upstream; never silently token 0).
    """
    total = float(probs.sum())
    if not total > 0:
        raise ValueError("Cannot sample from a distribution with zero total mass.")
    return int(torch.multinomial(probs.to(torch.float64).cpu(), 1, generator=generator))


def uniform(generator: torch.Generator) -> float:
    """One draw u ~ U[0, 1) from the run's generator."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


@dataclass
class Verdict:
    """Outcome of verifying one round's draft tokens.

    Attributes:
        n_accepted: how many draft tokens were kept (0..k).
        next_token: the target's own token: the correction at the first rejected position, or the
            bonus token after k acceptances.
        next_kind: "correction" or "bonus".
        accept_probs: min(1, p(x)/q(x)) (1/0 under greedy) for each evaluated position
            (n_accepted, plus one more if a token was rejected).
        uniforms: the draws u for those positions (sampling only; empty under greedy).
        residual: [V] the normalized distribution the correction was drawn from (sampling + rejection
            only), else None.
    """

    n_accepted: int
    next_token: int
    next_kind: str
    accept_probs: list[float] = field(default_factory=list)
    uniforms: list[float] = field(default_factory=list)
    residual: torch.Tensor | None = None


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)), the distribution a correction is drawn from (Leviathan et al., Alg. 1).

    Args:
        p, q: [V] target and draft probabilities.

    Returns:
        [V] float64, sums to 1. When p ≤ q everywhere up to rounding (so p = q and a rejection has
        probability 0), the residual is undefined; p itself is returned, never NaN or a silent token 0.
    """
    r = torch.clamp(p.to(torch.float64) - q.to(torch.float64), min=0.0)
    s = float(r.sum())
    if s <= 1e-12:
        r, s = p.to(torch.float64).clone(), float(p.sum())
    return r / s


def verify_greedy(draft_tokens: list[int], target_argmax: list[int]) -> Verdict:
    """Greedy rule: accept a draft token iff it is the target's argmax at its position.

    Args:
        draft_tokens: k draft token ids.
        target_argmax: k + 1 target argmax ids (position i judges draft token i; the last is the bonus).
    """
    accept_probs: list[float] = []
    for i, x in enumerate(draft_tokens):
        if x == target_argmax[i]:
            accept_probs.append(1.0)
            continue
        accept_probs.append(0.0)
        return Verdict(i, target_argmax[i], "correction", accept_probs)
    k = len(draft_tokens)
    return Verdict(k, target_argmax[k], "bonus", accept_probs)


def verify_sampling(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor,
                    generator: torch.Generator) -> Verdict:
    """Speculative sampling rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

    Draft token x_i is accepted with probability min(1, p_i(x_i)/q_i(x_i)) (0 when p_i(x_i) = 0);
    the first rejection is replaced by a sample from norm(max(0, p_i − q_i)); if all k are accepted a
    bonus token is sampled from p_k. The emitted tokens are distributed exactly as the target's.

    Args:
        draft_tokens: k draft ids, x_i sampled from q_i.
        q: [k, V] the distributions the draft sampled from (a point mass for prompt lookup).
        p: [k + 1, V] the target's distributions at the same positions, plus one for the bonus.
        generator: the run's random generator (CPU).
    """
    k = len(draft_tokens)
    if q.shape[0] != k or p.shape[0] != k + 1 or (k and q.shape[-1] != p.shape[-1]):
        raise ValueError(f"Shape mismatch: {k} draft tokens, q {tuple(q.shape)}, p {tuple(p.shape)}.")
    accept_probs: list[float] = []
    uniforms: list[float] = []
    for i, x in enumerate(draft_tokens):
        px, qx = float(p[i, x]), float(q[i, x])
        a = 0.0 if px <= 0.0 else (1.0 if px >= qx else px / qx)
        u = uniform(generator)
        accept_probs.append(a)
        uniforms.append(u)
        if u < a:
            continue
        residual = residual_distribution(p[i], q[i])
        return Verdict(i, sample(residual, generator), "correction", accept_probs, uniforms, residual)
    return Verdict(k, sample(p[k], generator), "bonus", accept_probs, uniforms)
