"""Logits → probabilities, sampling, and the verification rules of speculative decoding.

Everything that decides a token lives here, so the live engine, the toy distribution check and the
tests all use the same code.

Sources:
- Speculative sampling rule: Leviathan, Kalman & Matias, "Fast Inference from Transformers via
  Speculative Decoding" (ICML 2023), Algorithm 1 and Appendix A.1; Chen et al., "Accelerating Large
  Language Model Decoding with Speculative Sampling" (2023), Algorithm 2 ("modified rejection
  sampling"): accept x ~ q with probability min(1, p(x)/q(x)); on rejection sample from
  norm(max(0, p − q)); after γ acceptances sample a bonus token from p.
- Token trees: SpecInfer's multi-step speculative sampling (Miao et al. 2024, §4.3, Algorithm 2) and
  recursive rejection sampling for children drawn without replacement (Jeon et al. 2024), both lossless;
  Medusa's typical acceptance (Cai et al. 2024, §2.3.1), LOSSY, for comparison.
- Drafter-invariant sampling (the "gumbel" rule): Daliri, Musco & Suresh, "Coupling without Communication and
  Drafter-Invariant Speculative Decoding" (arXiv 2408.07978, 2024), §3 (Gumbel-max coupling): the token at position
  t is argmax_x(log p_t(x) + g_t(x)), with g_t(x) standard Gumbel noise fixed by (seed, t, x); the draft proposes
  argmax_x(log q_t(x) + g_t(x)) with the same noise, and a draft token is kept iff the target's perturbed argmax
  is it. Gumbel-max: P(argmax = x) = p(x) (Gumbel 1954; e.g. Maddison et al. 2014, §2).
- Temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020), in the order transformers'
  logits processors apply them.
"""

from __future__ import annotations

import functools
import math

from dataclasses import dataclass, field

import torch

from engine.errors import InputError

MAX_GAMMA = 64

SAMPLING_RULES = ("standard", "gumbel")
"""How a sampled run draws its tokens: "standard" (inverse-CDF draws from the run's generator; speculative rounds
judge with min(1, p/q) and a residual draw, ``verify_sampling``) or "gumbel" (drafter-invariant Gumbel-max sampling
with noise keyed by (seed, position, token), ``verify_gumbel``: for one seed, plain and speculative decoding give the
same tokens whatever drafts)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax).

    Attributes:
        temperature: ≥ 0; 0 is greedy.
        top_k: keep the k most likely tokens; 0 turns it off.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p; in (0, 1].
        rule: the sampling rule, one of ``SAMPLING_RULES`` ("standard" or "gumbel"); greedy runs ignore it.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    rule: str = "standard"

    def __post_init__(self) -> None:
        if not (self.temperature >= 0) or self.temperature > 100:  # also catches NaN
            raise InputError(f"Temperature must be between 0 and 100, got {self.temperature}.")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise InputError(f"top-k must be a whole number ≥ 0 (0 = off), got {self.top_k}.")
        if not (0 < self.top_p <= 1):
            raise InputError(f"top-p must be in (0, 1], got {self.top_p}.")
        if self.rule not in SAMPLING_RULES:
            raise InputError(f"Unknown sampling rule {self.rule!r}; expected one of {', '.join(SAMPLING_RULES)}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def gumbel(self) -> bool:
        """Sampled under the drafter-invariant rule (False for greedy runs, whatever ``rule`` says)."""
        return self.rule == "gumbel" and not self.greedy


def argmax_rows(x: torch.Tensor) -> list[int]:
    """``torch.argmax(x, dim=-1)`` as a list of ints: [V] gives one, [R, V] gives R.

    The same rule (the first index of the largest value; a NaN counts as the largest), through NumPy for float32 and
    float64 CPU tensors: measured on a 2-core Intel Xeon (2 threads), ``torch.argmax`` of one 49 152-entry
    float32 row took 150 µs against NumPy's 5 µs, and greedy rounds take it per position, per row and per draft step.
    Other tensors (another device or dtype) use ``torch.argmax``.
    """
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.numel() and not x.requires_grad:
        import numpy as np

        return np.atleast_1d(x.detach().numpy().argmax(axis=-1)).reshape(-1).tolist()
    return torch.argmax(x, dim=-1).reshape(-1).tolist()


TOPK_CHUNK = 256  # ``top_k_rows``: entries per chunk of the first step (a vocabulary of 49 152: 192 chunks)


def top_k_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` (largest first) of [R, V] ``x``, for the short lists a page shows.

    Two steps: each row's chunks of ``TOPK_CHUNK`` entries and their maxima (``amax``, a fast reduction), then
    ``torch.topk`` over the k chunks with the largest maxima only (the k largest entries lie in them: a chunk holding
    one of them has a maximum at least as large, and at most k − 1 other chunks can have a larger one). Measured on
    a 2-core Intel Xeon: ``torch.topk`` of 5 took 130 µs per 49 152-entry row. The values are exactly
    ``torch.topk``'s; among exactly equal values which index comes first is unspecified, as for ``torch.topk``.
    Rows shorter than 16 chunks, or not a multiple of the chunk, or k over 8, use ``torch.topk``.

    Returns:
        (values [R, k'], indices [R, k'] long) with k' = min(k, V).
    """
    r, v = x.shape
    k = min(k, v)
    if k > 8 or v % TOPK_CHUNK or v < 16 * TOPK_CHUNK or x.requires_grad:
        return torch.topk(x, k, dim=-1)
    chunks = x.reshape(r, v // TOPK_CHUNK, TOPK_CHUNK)
    best = torch.topk(chunks.amax(dim=-1), k, dim=-1).indices  # [R, k]
    cand = torch.gather(chunks, 1, best[:, :, None].expand(r, k, TOPK_CHUNK)).reshape(r, k * TOPK_CHUNK)
    vals, local = torch.topk(cand, k, dim=-1)
    idx = torch.gather(best, 1, local // TOPK_CHUNK) * TOPK_CHUNK + local % TOPK_CHUNK
    return vals, idx


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
    divisor = cfg.temperature if cfg.temperature > 0 else 1.0
    x = logits if divisor == 1.0 else logits / divisor  # x / 1 is x, bit for bit: no copy of V entries a row
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


def sample(probs: torch.Tensor, generator: torch.Generator, cdf: torch.Tensor | None = None) -> int:
    """Draw one token id from a probability vector [V] (need not be normalized, must be ≥ 0).

    Inverse-CDF sampling with one uniform draw from the run's generator (``uniform``): the first id whose cumulative
    mass (float64) exceeds u · total, so P(id) = probs[id] ÷ total and an id of zero mass is never drawn. Why not
    ``torch.multinomial(probs, 1)``: without replacement (its default) it draws one exponential per entry (the
    exponential race), 49 152 random numbers per token; measured on the AMD EPYC, 3.7 ms against 0.09 ms here for
    the embedded model's vocabulary (2 threads, a busy machine), a few per speculative round.

    ``cdf``: ``torch.cumsum`` of ``probs`` as float64 [V], computed by a caller that checked ``probs`` has no negative
    entry (``cumsum_rows``: a room's rows together); the same draw as without it.

    Raises:
        ValueError: if the vector has no positive mass, a negative entry, or a NaN or infinite entry (a bug upstream;
            never silently token 0).
    """
    p = probs.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
    checked = cdf is not None
    cdf = torch.cumsum(p, 0) if cdf is None else cdf
    total = float(cdf[-1]) if cdf.numel() else 0.0
    if not total > 0:
        raise ValueError("Cannot sample from a distribution with zero total mass.")
    if not math.isfinite(total) or (not checked and bool((p < 0).any())):
        raise ValueError("Cannot sample from a distribution with negative, NaN or infinite entries.")
    u = torch.tensor(uniform(generator) * total, dtype=torch.float64)
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= p.numel():  # u · total rounded up to the total: the last id with mass
        i = int(torch.nonzero(p > 0)[-1])
    return i


def cumsum_rows(probs: torch.Tensor) -> list[torch.Tensor | None]:
    """``sample``'s ``cdf`` for each row of [R, V] ``probs`` in two calls: the float64 cumulative sums of the rows
    (``torch.cumsum`` adds along a row in order, so each row's sums are the bits of its own call), None for a row
    with a negative entry (``sample`` then finds and reports it)."""
    p = probs.detach().to(device="cpu", dtype=torch.float64)
    cdf = torch.cumsum(p, dim=-1)
    bad = (p < 0).any(dim=-1).tolist()
    return [None if b else row for b, row in zip(bad, cdf)]


def uniform(generator: torch.Generator) -> float:
    """One draw u ~ U[0, 1) from the run's generator."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


# ---------------------------------------------------------------- drafter-invariant (Gumbel-max) sampling

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
NOISE_CACHE = 64
"""Positions whose noise rows ``gumbel_noise`` keeps (a vocabulary of 49 152: 393 KB a row, 25 MB in all)."""


def _mix64(z):
    """splitmix64's output function (Steele, Lea & Flood, "Fast splittable pseudorandom number generators",
    OOPSLA 2014; the constants of Java's SplittableRandom): a bijection of 64-bit words that scrambles every bit.
    Works on a Python int (masked to 64 bits) or a NumPy uint64 array (wrapping arithmetic)."""
    import numpy as np

    if isinstance(z, int):
        z &= _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def noise_key(seed: int, position: int) -> int:
    """The 64-bit key of one position's noise: splitmix64 of the seed, then of that plus the position (a
    counter-based generator: the key is a pure function of (seed, position), never of earlier draws)."""
    return _mix64(_mix64(int(seed) + _GOLDEN) + (int(position) + 1) * _GOLDEN)


@functools.lru_cache(maxsize=NOISE_CACHE)
def _noise_row(seed: int, position: int, vocab: int):
    import numpy as np

    with np.errstate(over="ignore"):
        ids = np.arange(1, vocab + 1, dtype=np.uint64)
        z = _mix64(ids * np.uint64(_GOLDEN) + np.uint64(noise_key(seed, position)))
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53  # in (0, 1), never 0 or 1
    return torch.from_numpy(-np.log(-np.log(u)))


def uniform_at(seed: int, position: int, token: int) -> float:
    """The uniform u ∈ (0, 1) behind g(seed, position, token) = −log(−log u) (``gumbel_noise``): splitmix64
    of the position's key plus (token + 1) golden-ratio steps, its top 53 bits, offset by half a step."""
    z = _mix64(noise_key(seed, position) + (int(token) + 1) * _GOLDEN)
    return ((z >> 11) + 0.5) * 2.0 ** -53


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise g(seed, position, x) = −log(−log u(seed, position, x)) for x = 0..vocab−1.

    Counter-based: each entry is a hash (``uniform_at``, splitmix64) of (seed, absolute position, token id), so a
    position's noise is the same in a plain run, in a draft and in a verify pass, whatever was drawn before. The
    last ``NOISE_CACHE`` rows are memoized (a row of 49 152 entries costs about 1 ms).

    Args:
        seed: the run's seed (any int; used modulo 2⁶⁴).
        position: the absolute position of the token in the sequence (prompt included), ≥ 0.
        vocab: V, the number of token ids.

    Returns:
        [V] float64, the memoized row itself: read it, never write to it.

    Raises:
        ValueError: a negative position or a vocabulary < 1.
    """
    if position < 0 or vocab < 1:
        raise ValueError(f"Noise needs a position ≥ 0 and a vocabulary ≥ 1, got {position} and {vocab}.")
    return _noise_row(int(seed) & _M64, int(position), int(vocab))


def noise_seed(generator: torch.Generator) -> int:
    """The seed that keys a run's noise under the "gumbel" rule: the seed its generator was started with
    (``torch.Generator.initial_seed``), so the noise does not depend on how many numbers the generator drew."""
    return int(generator.initial_seed())


def gumbel_argmax(probs: torch.Tensor, seed: int, position: int, ids: torch.Tensor | None = None) -> int:
    """Gumbel-max sampling: the index i maximizing log probs[i] + g(seed, position, id_i) (ties: the first index).

    P(index i) = probs[i] ÷ Σ probs over the noise (Gumbel-max trick; Daliri, Musco & Suresh, arXiv 2408.07978, §3).
    Entries of zero mass are never chosen.

    Args:
        probs: [n] probabilities (need not be normalized, ≥ 0).
        seed, position: the noise's key (``gumbel_noise``).
        ids: [n] long, the token id of each entry when ``probs`` covers a subset of the vocabulary (a draft head's
            reduced vocabulary); None: entry i is token i.

    Raises:
        ValueError: no positive mass, or a negative, NaN or infinite entry.
    """
    import numpy as np

    p = probs.detach().reshape(-1).to(device="cpu", dtype=torch.float64).numpy()
    if ids is None:
        g = gumbel_noise(seed, position, p.size).numpy()
    else:
        ids = ids.reshape(-1).to("cpu", torch.long)
        g = gumbel_noise(seed, position, int(ids.max()) + 1).numpy()[ids.numpy()]
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.log(p) + g  # log 0 = −inf: never chosen; a negative or NaN entry gives NaN, argmax's pick
    i = int(score.argmax())
    if not math.isfinite(float(score[i])):  # every entry 0 (−inf), or a NaN, negative or infinite one
        if float(np.nansum(p)) <= 0 and not np.isnan(p).any():
            raise ValueError("Cannot sample from a distribution with zero total mass.")
        raise ValueError("Cannot sample from a distribution with negative, NaN or infinite entries.")
    return i


def draw_token(q: torch.Tensor, cfg: "SamplingConfig", generator: torch.Generator, position: int,
               ids: torch.Tensor | None = None) -> int:
    """A draft's sampled pick from q under the run's rule: ``sample`` (one uniform from ``generator``) under
    "standard", ``gumbel_argmax`` with the run's noise at ``position`` under "gumbel" (the coupling's proposal).

    Args:
        q: [n] the draft's warped distribution; ids: [n] the token ids of its entries (None: entry i is token i).
        cfg: the run's sampling settings (not greedy); generator: the run's generator.
        position: the absolute position the drafted token takes in the sequence.

    Returns:
        an index into q.
    """
    if cfg.gumbel:
        return gumbel_argmax(q, noise_seed(generator), position, ids)
    return sample(q, generator)


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
                    generator: torch.Generator, bonus_cdf: torch.Tensor | None = None) -> Verdict:
    """Speculative sampling rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

    Draft token x_i is accepted with probability min(1, p_i(x_i)/q_i(x_i)) (0 when p_i(x_i) = 0);
    the first rejection is replaced by a sample from norm(max(0, p_i − q_i)); if all k are accepted a
    bonus token is sampled from p_k. The emitted tokens are distributed exactly as the target's.

    Args:
        draft_tokens: k draft ids, x_i sampled from q_i.
        q: [k, V] the distributions the draft sampled from (a point mass for prompt lookup).
        p: [k + 1, V] the target's distributions at the same positions, plus one for the bonus.
        generator: the run's random generator (CPU).
        bonus_cdf: ``sample``'s cdf of p[k] when the caller has it (``cumsum_rows``), for the bonus token.
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
    return Verdict(k, sample(p[k], generator, bonus_cdf), "bonus", accept_probs, uniforms)


def verify_gumbel(draft_tokens: list[int], p: torch.Tensor, seed: int, position: int) -> Verdict:
    """Drafter-invariant rule (Daliri, Musco & Suresh, arXiv 2408.07978, Algorithm 2 with Gumbel-max sampling).

    The target's token at position t is y_t = argmax_x(log p_t(x) + g(seed, t, x)) (``gumbel_argmax``); draft token
    x_i is kept iff x_i = y_{position+i}; the first mismatch is replaced by y there (a correction), and after k
    matches the bonus token is y at position + k. Every emitted token is the target's own perturbed argmax, so the
    tokens are those plain decoding under this rule gives for the seed, whatever the draft proposed; each follows
    p exactly (Gumbel-max). A draft that proposes argmax(log q + g) with the same noise is kept with probability
    ≥ (1 − TV(p, q)) ÷ (1 + TV(p, q)) (ibid., Theorem 3).

    Args:
        draft_tokens: k draft ids.
        p: [k + 1, V] the target's warped distributions (row i judges draft token i; the last gives the bonus).
        seed: the noise's seed (``noise_seed``); position: the absolute position of draft token 0 (the
            sequence's length before the round).

    Returns:
        a ``Verdict`` with accept_probs 1/0 (the verdict is a function of the noise), no uniforms, no residual.
    """
    k = len(draft_tokens)
    if p.shape[0] != k + 1:
        raise ValueError(f"Shape mismatch: {k} draft tokens, p {tuple(p.shape)}.")
    accept_probs: list[float] = []
    for i, x in enumerate(draft_tokens):
        y = gumbel_argmax(p[i], seed, position + i)
        if y == x:
            accept_probs.append(1.0)
            continue
        accept_probs.append(0.0)
        return Verdict(i, y, "correction", accept_probs)
    return Verdict(k, gumbel_argmax(p[k], seed, position + k), "bonus", accept_probs)


def verify_chain(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor, cfg: SamplingConfig,
                 generator: torch.Generator, position: int, bonus_cdf: torch.Tensor | None = None) -> Verdict:
    """A sampled chain round under the run's rule: ``verify_gumbel`` (keyed by the generator's seed) under
    "gumbel", else ``verify_sampling``. Arguments as theirs; ``position``: the absolute position of draft token 0."""
    if cfg.gumbel:
        return verify_gumbel(draft_tokens, p, noise_seed(generator), position)
    return verify_sampling(draft_tokens, q, p, generator, bonus_cdf)


def gumbel_agreement(p: torch.Tensor, q: torch.Tensor, samples: int = 2000, seed: int = 0) -> float:
    """The Gumbel coupling's agreement probability P(argmax(log p + g) = argmax(log q + g)), estimated over
    ``samples`` noise rows (positions 0..samples−1 of ``seed``): the acceptance of one draft token under the
    "gumbel" rule, against Σ min(p, q) under the standard rule (ibid., Theorem 3: ≥ (1 − TV) ÷ (1 + TV)).

    Args:
        p, q: [V] target and draft distributions.

    Returns:
        the fraction of noise rows whose two perturbed argmaxes agree, in [0, 1].
    """
    p = p.detach().to("cpu", torch.float64).reshape(-1)
    q = q.detach().to("cpu", torch.float64).reshape(-1)
    if p.shape != q.shape or samples < 1:
        raise ValueError(f"p and q must have the same length and samples ≥ 1: {tuple(p.shape)}, {tuple(q.shape)}.")
    support = torch.nonzero((p > 0) | (q > 0)).reshape(-1)
    lp, lq = torch.log(p[support]), torch.log(q[support])
    agree = 0
    for t in range(samples):
        g = gumbel_noise(seed, t, p.numel())[support]
        agree += int(torch.argmax(lp + g)) == int(torch.argmax(lq + g))
    return agree / samples


# ---------------------------------------------------------------- token trees
#
# A token tree (``engine.decoding.tree.TokenTree``) is judged from the roots down: at each accepted node (the
# context first) the children are judged one after another until one is accepted; the walk goes on from it.
# The target's own token comes from the last accepted node: a correction when it had children (none was
# accepted), a bonus token when it is a leaf.


@dataclass
class TreeVerdict:
    """Outcome of verifying one round's token tree.

    Attributes:
        path: accepted node indices, root first (the accepted path).
        next_token: the target's own token after the path: the correction at the path's last node (it had
            children, none accepted) or the bonus token (it is a leaf).
        next_kind: "correction" or "bonus".
        accept_probs: [N] the acceptance probability each node was judged with (1/0 under greedy and typical
            acceptance), None for a node never judged.
        uniforms: [N] the uniform draw compared with it (sampling only), else None.
        residual: [V] the distribution the correction was drawn from (lossless sampling + correction), else
            None.
    """

    path: list[int]
    next_token: int
    next_kind: str
    accept_probs: list[float | None]
    uniforms: list[float | None]
    residual: torch.Tensor | None = None

    @property
    def n_accepted(self) -> int:
        return len(self.path)


def _children(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        kids.setdefault(int(par), []).append(i)
    return kids


def verify_tree_greedy(tokens: list[int], parents: list[int], target_argmax: list[int]) -> TreeVerdict:
    """Greedy rule on a tree: the longest path whose every token is the target's argmax at its parent, plus
    the target's own next token (its argmax after the path). Siblings are judged in order; the first that
    matches is taken (a later sibling repeating it is never judged).

    The output equals plain greedy decoding: every accepted token is the target's argmax given the tokens
    before it (the tree pass's logits at a node are those of a causal pass over context + the node's path,
    pinned by tests/test_attention.py), and so is the next token.

    Args:
        tokens, parents: the tree's N nodes (``TokenTree``).
        target_argmax: N + 1 target argmax ids: [0] after the context, [1 + i] after node i.
    """
    kids = _children(parents)
    accept: list[float | None] = [None] * len(tokens)
    path: list[int] = []
    node = -1
    while True:
        want = target_argmax[node + 1]
        nxt = None
        for c in kids.get(node, []):
            if tokens[c] == want:
                accept[c] = 1.0
                nxt = c
                break
            accept[c] = 0.0
        if nxt is None:
            kind = "correction" if kids.get(node) else "bonus"
            return TreeVerdict(path, want, kind, accept, [None] * len(tokens))
        path.append(nxt)
        node = nxt


def verify_tree_sampling(tokens: list[int], parents: list[int], q: torch.Tensor, draw: str, p: torch.Tensor,
                         generator: torch.Generator) -> TreeVerdict:
    """Lossless sampling rule on a tree: recursive rejection sampling over each accepted node's children.

    At a node with target distribution p (the context first), children x_1..x_m are judged in order. Child i,
    drawn from q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)) (0 when p_i(x_i) = 0), where
    p_1 = p; on rejection p_{i+1} = norm(max(0, p_i − q_i)) (``residual_distribution``). If no child is
    accepted the correction is drawn from p_{m+1}; at a leaf the bonus token is drawn from p. This is
    SpecInfer's multi-step speculative sampling (Miao et al. 2024, "SpecInfer", §4.3 and Algorithm 2, with
    Theorem 4.2: the output is distributed as the target's), for children drawn independently:

    - draw "sampled": each child drawn from its parent's q independently, q_i = q;
    - draw "deterministic" (top-k picks, lookup matches): q_i is one-hot on x_i, so child i is accepted with
      probability p_i(x_i) and a rejection zeroes x_i in p and renormalizes;
    - draw "without_replacement": children drawn from q one after another without replacement; q_i is q with
      x_1..x_{i−1} removed and renormalized (Jeon et al. 2024, "Recursive Speculative Decoding", §3.2,
      recursive rejection sampling; Theorem 3.1).

    Why it is exact (one node; the tree follows by induction on depth): P(accept x_1 and X_1 = x) = min(p, q_1)(x);
    given a rejection the target token must follow norm(max(0, p − q_1)) = p_2, which is 0 on every token
    that can be rejected, so the remaining children (drawn independently of the verdict, from q_2) face the
    same problem with target p_2; with no children left the residual itself is sampled.

    Args:
        tokens, parents, q, draw: the tree (``TokenTree``; q is [N, V]).
        p: [N + 1, V] the target's warped distributions: [0] after the context, [1 + i] after node i.
        generator: the run's random generator (CPU).
    """
    n = len(tokens)
    if p.shape[0] != n + 1 or q.shape[0] != n:
        raise ValueError(f"Shape mismatch: {n} nodes, q {tuple(q.shape)}, p {tuple(p.shape)}.")
    kids = _children(parents)
    accept: list[float | None] = [None] * n
    us: list[float | None] = [None] * n
    path: list[int] = []
    node = -1
    while True:
        row = p[node + 1].to(torch.float64)
        removed: list[int] = []
        nxt = None
        for c in kids.get(node, []):
            x = int(tokens[c])
            qc = q[c].to(torch.float64)
            if draw == "without_replacement" and removed:
                qc = qc.clone()
                qc[removed] = 0.0
                qc = qc / qc.sum()
            px, qx = float(row[x]), float(qc[x])
            a = 0.0 if px <= 0.0 else (1.0 if px >= qx else px / qx)
            u = uniform(generator)
            accept[c], us[c] = a, u
            if u < a:
                nxt = c
                break
            row = residual_distribution(row, qc)
            removed.append(x)
        if nxt is None:
            if kids.get(node):
                return TreeVerdict(path, sample(row, generator), "correction", accept, us, row)
            return TreeVerdict(path, sample(row, generator), "bonus", accept, us)
        path.append(nxt)
        node = nxt


def verify_tree_gumbel(tokens: list[int], parents: list[int], p: torch.Tensor, seed: int,
                       position: int) -> TreeVerdict:
    """The drafter-invariant rule on a tree (``verify_gumbel`` from the roots down): at each accepted node (the
    context first) at depth d the target's token is y = argmax(log p + g(seed, position + d, ·)); the first child
    whose token is y is accepted and the walk goes on from it; with none, y is the correction (the node had
    children) or the bonus token (a leaf). The path and the next token are those plain decoding under this rule
    gives for the seed, whatever the tree holds.

    Args:
        tokens, parents: the tree's N nodes (``TokenTree``).
        p: [N + 1, V] the target's warped distributions: [0] after the context, [1 + i] after node i.
        seed: the noise's seed (``noise_seed``); position: the absolute position of the roots' tokens.
    """
    n = len(tokens)
    if p.shape[0] != n + 1:
        raise ValueError(f"Shape mismatch: {n} nodes, p {tuple(p.shape)}.")
    kids = _children(parents)
    accept: list[float | None] = [None] * n
    path: list[int] = []
    node = -1
    while True:
        want = gumbel_argmax(p[node + 1], seed, position + len(path))
        nxt = None
        for c in kids.get(node, []):
            if tokens[c] == want:
                accept[c] = 1.0
                nxt = c
                break
            accept[c] = 0.0
        if nxt is None:
            kind = "correction" if kids.get(node) else "bonus"
            return TreeVerdict(path, want, kind, accept, [None] * n)
        path.append(nxt)
        node = nxt


TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3
"""Medusa's typical-acceptance defaults (ε the hard threshold, δ = √ε the entropy factor; Cai et al. 2024's
code: ``posterior_threshold=0.09``, ``posterior_alpha=0.3``)."""


def typical_threshold(p: torch.Tensor, epsilon: float = TYPICAL_EPSILON, delta: float = TYPICAL_DELTA) -> float:
    """min(ε, δ·exp(−H(p))), Medusa's typical-acceptance threshold (Cai et al. 2024, §2.3.1), H in nats."""
    p = p.to(torch.float64)
    nz = p[p > 0]
    entropy = float(-(nz * nz.log()).sum())
    return min(epsilon, delta * float(torch.exp(torch.tensor(-entropy))))


def verify_tree_typical(tokens: list[int], parents: list[int], p: torch.Tensor, generator: torch.Generator,
                        epsilon: float = TYPICAL_EPSILON, delta: float = TYPICAL_DELTA) -> TreeVerdict:
    """LOSSY rule: Medusa's typical acceptance (Cai et al. 2024, §2.3.1).

    A node's token x passes if p(x) > min(ε, δ·exp(−H(p))) with p the target's distribution at its parent
    (``typical_threshold``); the accepted path is the longest path of passing nodes (the first in node order
    among equally long ones), and the target's own token is sampled from p after it. Tokens the target finds
    merely "typical enough" are kept outright, so the output is NOT distributed as the target's
    (``first_token_check`` measures how far); it is here to show that, labelled lossy everywhere.

    Args:
        tokens, parents: the tree's N nodes.
        p: [N + 1, V] the target's warped distributions ([0] after the context, [1 + i] after node i).
        generator: the run's random generator.
        epsilon, delta: ε and δ (Medusa's defaults ``TYPICAL_EPSILON``, ``TYPICAL_DELTA``).
    """
    n = len(tokens)
    kids = _children(parents)
    thresholds = {-1: typical_threshold(p[0], epsilon, delta)}
    passes = [False] * n
    accept: list[float | None] = [None] * n
    # a node is judged when its parent is the context or passed (nodes come after their parents)
    for i in range(n):
        par = parents[i]
        if par >= 0 and not passes[par]:
            continue
        if par not in thresholds:
            thresholds[par] = typical_threshold(p[par + 1], epsilon, delta)
        passes[i] = float(p[par + 1, tokens[i]]) > thresholds[par]
        accept[i] = 1.0 if passes[i] else 0.0
    best: list[int] = []

    def walk(node: int, path: list[int]) -> None:
        nonlocal best
        if len(path) > len(best):
            best = list(path)
        for c in kids.get(node, []):
            if passes[c]:
                walk(c, path + [c])

    walk(-1, [])
    end = best[-1] if best else -1
    kind = "correction" if kids.get(end) else "bonus"
    return TreeVerdict(best, sample(p[end + 1], generator), kind, accept, [None] * n)


ACCEPT_RULES = ("exact", "typical")
"""Tree acceptance rules: "exact" (greedy under T = 0, else the lossless ``verify_tree_sampling``) and
"typical" (Medusa's typical acceptance, LOSSY, ``verify_tree_typical``)."""


@dataclass
class FirstTokenCheck:
    """The first emitted token's distribution under a tree rule, against p (``first_token_check``).

    Attributes:
        counts: [V] how often each token came first.
        freq: [V] counts ÷ trials.
        tv: total-variation distance ½ Σ |freq − p| (0 for a lossless rule up to sampling noise).
        noise_tv: the mean TV of ``trials`` exact draws from p (4 simulated repetitions): the sampling noise an
            exact rule's ``tv`` is compared with.
        accepted: fraction of trials in which a draft node was accepted.
    """

    counts: torch.Tensor
    freq: torch.Tensor
    tv: float
    noise_tv: float
    accepted: float


def first_token_check(p: torch.Tensor, q: torch.Tensor, n_children: int, draw: str, rule: str, trials: int,
                      seed: int = 0, epsilon: float = TYPICAL_EPSILON, delta: float = TYPICAL_DELTA) -> FirstTokenCheck:
    """The distribution check of a tree rule: draft a one-level tree of ``n_children`` children from q
    (``draw``: "deterministic" = the top-n tokens of q, "sampled" = independent draws,
    "without_replacement"), judge it with ``rule`` ("exact" = ``verify_tree_sampling``, "typical" =
    ``verify_tree_typical``, LOSSY) against the target p, and count the first emitted token over ``trials``.

    Args:
        p, q: [V] target and draft distributions.
        n_children: children of the root (≥ 1).
        draw, rule: see above.
        trials: number of trials (≥ 1).
        seed: seeds the draws.

    Returns:
        ``FirstTokenCheck`` with the total-variation distance from p (½ Σ |freq − p|) and the TV that exact
        draws from p show with as many trials (sampling noise).

    Raises:
        InputError: for an unknown rule or draw, n_children < 1 or trials < 1.
    """
    if rule not in ACCEPT_RULES:
        raise InputError(f"Unknown acceptance rule {rule!r}; expected one of {', '.join(ACCEPT_RULES)}.")
    if draw not in ("deterministic", "sampled", "without_replacement"):
        raise InputError(f"Unknown draw {draw!r}.")
    if n_children < 1 or trials < 1:
        raise InputError("The check needs at least one child and one trial.")
    g = torch.Generator().manual_seed(seed)
    p = p.to(torch.float64)
    q = q.to(torch.float64)
    v = p.shape[0]
    counts = torch.zeros(v, dtype=torch.float64)
    p_rows = p[None].expand(n_children + 1, v)
    accepted = 0
    for _ in range(trials):
        if draw == "deterministic":
            toks = [int(i) for i in torch.topk(q, n_children).indices]
            qrows = torch.zeros(n_children, v, dtype=torch.float64)
            qrows[torch.arange(n_children), toks] = 1.0
        elif draw == "sampled":
            toks = [sample(q, g) for _ in range(n_children)]
            qrows = q[None].expand(n_children, v)
        else:
            left = q.clone()
            toks = []
            for _c in range(n_children):
                if float(left.sum()) <= 0:
                    break
                x = sample(left, g)
                toks.append(x)
                left[x] = 0.0
            qrows = q[None].expand(len(toks), v)
        parents = [-1] * len(toks)
        rows = p_rows[:len(toks) + 1]
        if rule == "exact":
            verdict = verify_tree_sampling(toks, parents, qrows, draw, rows, g)
        else:
            verdict = verify_tree_typical(toks, parents, rows, g, epsilon, delta)
        first = toks[verdict.path[0]] if verdict.path else verdict.next_token
        accepted += bool(verdict.path)
        counts[first] += 1
    freq = counts / trials
    noise = torch.multinomial(p, trials * 4, replacement=True, generator=g).view(4, trials)
    noise_tv = float(sum(0.5 * (torch.bincount(r, minlength=v).double() / trials - p).abs().sum() for r in noise) / 4)
    return FirstTokenCheck(counts, freq, float(0.5 * (freq - p).abs().sum()), noise_tv, accepted / trials)
