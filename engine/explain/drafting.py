"""Sequential against parallel (block) drafting: what a round costs and yields, as a model.

Two ways to draft γ tokens for one target verify pass:

- **Sequential** (a small draft model, an EAGLE-style head): γ draft steps, one token each, each step
  conditioned on the tokens drafted before it. A round costs γ·c + t(γ+1)/t(1) target decode steps
  (Leviathan et al. 2023, Theorem 3.8, with the verify-cost curve of ``engine.explain.analytic``).
- **Parallel, block** (DFlash, arXiv 2602.06036): a non-causal drafter fills a block of B positions
  [bonus token, MASK × (B − 1)] in **one** forward pass, conditioned on the target's hidden states, so it
  drafts γ = B − 1 tokens for the price of one pass: a round costs c_block(B) + t(B)/t(1), with c_block(B)
  the cost of that one drafter pass over B positions in target decode steps (``BlockCost``).

Acceptance (the model, explicit): draft position j = 1..γ is accepted with probability α_j given that every
position before it was; a round emits E = 1 + Σ_{k=1..γ} Π_{j≤k} α_j tokens per target pass (Leviathan et
al. 2023, Eq. 1 with a per-position α; ``engine.explain.analytic.expected_tokens_by_position``). Here
α_j = α·δ^(j−1): the sequential drafter with its own decay δ_seq (1 = the constant α of the textbook
formula), the block drafter with a block decay δ_block. Position 1 sees the same context in both (the
target's state); position j > 1 of a block conditions only on MASK placeholders, not on the tokens drafted
before it, so it is usually accepted less: δ_block < δ_seq. That, not the cost, decides how long a block
still pays.

The confidence cut (DSpark, arXiv 2607.05147: DFlash plus a head that cuts how many block tokens are
verified) is modelled as an **oracle**, not measured: ``cut_oracle_*`` assume a cut that always knows where
the first rejection will fall and verifies only the tokens that will be kept. It keeps every token the full
verify keeps and makes the verify pass shorter, so it is the ceiling of what a cut can save on this model;
a real confidence head sometimes cuts tokens that would have been accepted (fewer tokens) and sometimes
verifies past the first rejection (a longer pass). A cut at one fixed position for every round is never
better than drafting a shorter block, so only a cut that decides per round can pay.

All costs are in target decode steps t(1) (dimensionless); every function raises ``engine.errors.InputError``
with a readable message on bad input.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from engine.errors import InputError
from engine.explain.analytic import (
    GAMMA_LIMIT,
    GAMMA_MAX,
    expected_tokens_by_position,
    verify_cost_ratio,
)

BLOCK_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "block_amd-epyc.json"
"""Where ``benchmarks/bench_block.py`` writes the measured block-drafter results (see :func:`load_block_results`)."""
BLOCK_COST_MAX = 10.0  # the largest drafter-pass cost (in target steps) any function accepts


# ---------------------------------------------------------------------------------------------
# checks


def _num(x: object, what: str, lo: float, hi: float) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise InputError(f"{what} must be a number in [{lo:g}, {hi:g}], got {x!r}.") from None
    if not (lo <= v <= hi):  # also rejects NaN
        raise InputError(f"{what} must be in [{lo:g}, {hi:g}], got {x}.")
    return v


def _gamma(gamma: object, hi: int = GAMMA_LIMIT) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or not (1 <= gamma <= hi):
        raise InputError(f"Draft length γ must be a whole number from 1 to {hi}, got {gamma!r}.")
    return int(gamma)


def _block(block: object) -> int:
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or not (2 <= block <= GAMMA_LIMIT + 1):
        raise InputError(f"Block size B must be a whole number from 2 to {GAMMA_LIMIT + 1} "
                         f"(γ = B − 1 draft tokens), got {block!r}.")
    return int(block)


# ---------------------------------------------------------------------------------------------
# the block drafter's pass cost


@dataclass(frozen=True)
class BlockCost:
    """c_block(B): one drafter pass over a block of B positions, in target decode steps t(1).

    Three forms (build them with :meth:`constant`, :meth:`linear` or :meth:`measured`):

    - constant: c_block(B) = c0 (the whole block costs one pass, whatever B: a memory-bound drafter);
    - linear: c_block(B) = c0 + c1·B (c1 = what each extra position adds);
    - measured: {B: ratio} read by linear interpolation between measured sizes and extended linearly from
      the last (or first) two points, flat with one point, never below 0 (as ``engine.explain.analytic``
      reads the measured verify-cost curve); the ratios of ``benchmarks/results/block_amd-epyc.json``'s ``block_pass``.

    Calling the object, ``cost(B)``, returns c_block(B) (≥ 0).
    """

    kind: str
    c0: float = 0.0
    c1: float = 0.0
    points: tuple[tuple[int, float], ...] = ()

    @classmethod
    def constant(cls, c0: float) -> "BlockCost":
        """c_block(B) = c0, c0 in [0, 1]. Raises InputError otherwise."""
        return cls("constant", _num(c0, "Block pass cost c_block", 0.0, 1.0))

    @classmethod
    def linear(cls, c0: float, c1: float) -> "BlockCost":
        """c_block(B) = c0 + c1·B, c0 in [0, 1], c1 in [0, 1]. Raises InputError otherwise."""
        return cls("linear", _num(c0, "Block pass cost c0", 0.0, 1.0),
                   _num(c1, "Block pass cost per position c1", 0.0, 1.0))

    @classmethod
    def measured(cls, ratios: Mapping[int, float]) -> "BlockCost":
        """From measured {B: one drafter pass over B positions ÷ one target decode step}.

        Raises:
            InputError: not a mapping, empty, a B < 1, or a ratio outside (0, ``BLOCK_COST_MAX``].
        """
        try:
            pts = sorted((int(k), float(v)) for k, v in dict(ratios).items())
        except (TypeError, ValueError, AttributeError):
            raise InputError("Measured block pass costs must map block sizes to cost ratios.") from None
        if not pts:
            raise InputError("Measured block pass costs are empty.")
        for b, r in pts:
            if b < 1 or not (math.isfinite(r) and 0.0 < r <= BLOCK_COST_MAX):
                raise InputError(f"Measured block pass cost at B = {b} must be a ratio in (0, {BLOCK_COST_MAX:g}] "
                                 f"of a target step, got {r}.")
        return cls("measured", points=tuple(pts))

    def __call__(self, block: int) -> float:
        b = _block(block)
        if self.kind == "constant":
            return self.c0
        if self.kind == "linear":
            return self.c0 + self.c1 * b
        ns = np.array([p[0] for p in self.points], float)
        rs = np.array([p[1] for p in self.points], float)
        if len(ns) == 1 or ns[0] <= b <= ns[-1]:
            return float(np.interp(b, ns, rs))
        (n0, r0), (n1, r1) = (self.points[-2], self.points[-1]) if b > ns[-1] else (self.points[0], self.points[1])
        return float(max(r1 + (r1 - r0) / (n1 - n0) * (b - n1), 0.0))

    def describe(self) -> str:
        """One line for captions: the form and its numbers."""
        if self.kind == "constant":
            return f"c_block(B) = {self.c0:.3g} at any B"
        if self.kind == "linear":
            return f"c_block(B) = {self.c0:.3g} + {self.c1:.3g}·B"
        return "measured c_block(B): " + ", ".join(f"B={b}: {r:.3g}" for b, r in self.points)


# ---------------------------------------------------------------------------------------------
# acceptance by position


def position_alphas(alpha: float, gamma: int, decay: float = 1.0) -> list[float]:
    """α_j = α·δ^(j−1) for draft positions j = 1..γ: the acceptance of position j given all before it were.

    δ = 1 gives the constant α of Leviathan et al. 2023 (Eq. 1); δ < 1 models a drafter whose guesses get
    worse further into the draft (for a block drafter: positions that condition only on MASKs).

    Args:
        alpha: α_1 in [0, 1]. gamma: γ in 1..64. decay: δ in [0, 1].

    Returns:
        [γ] list of α_j in [0, 1].

    Raises:
        InputError: α or δ outside [0, 1], γ outside 1..64.
    """
    a = _num(alpha, "Acceptance rate α", 0.0, 1.0)
    d = _num(decay, "Decay δ", 0.0, 1.0)
    return [a * d ** j for j in range(_gamma(gamma))]


def tokens_per_pass(alphas: Sequence[float]) -> float:
    """E = 1 + Σ_{k=1..γ} Π_{j≤k} α_j, tokens a round emits (accepted prefix + the target's own token).

    Source: Leviathan et al. 2023, Eq. 1 with a per-position α (``engine.explain.analytic.
    expected_tokens_by_position``); constant α gives (1 − α^(γ+1))/(1 − α).

    Raises:
        InputError: no positions, or an α_j outside [0, 1].
    """
    alphas = list(alphas)
    if not alphas:
        raise InputError("At least one draft position is needed (γ ≥ 1).")
    return expected_tokens_by_position(alphas, len(alphas))


def tokens_distribution(alphas: Sequence[float]) -> np.ndarray:
    """P(T = k) for the tokens T a round emits: Π_{j<k} α_j · (1 − α_k) for k = 1..γ, Π_{j≤γ} α_j at γ + 1.

    Source: the truncated geometric of Leviathan et al. 2023, Section 3.3, with a per-position α. Its mean is
    :func:`tokens_per_pass`.

    Returns:
        [γ + 1] float64 array (index k − 1), sums to 1.

    Raises:
        InputError: no positions, or an α_j outside [0, 1].
    """
    alphas = [_num(a, "Acceptance rate α_j", 0.0, 1.0) for a in alphas]
    if not alphas:
        raise InputError("At least one draft position is needed (γ ≥ 1).")
    out, survive = [], 1.0
    for a in alphas:
        out.append(survive * (1.0 - a))
        survive *= a
    out.append(survive)
    return np.array(out)


# ---------------------------------------------------------------------------------------------
# one round: cost and speedup


def _verify(n: int, slope: float, measured_ms: Mapping[int, float] | None) -> float:
    return verify_cost_ratio(n, slope, measured_ms)


def sequential_speedup(alphas: Sequence[float], c: float, verify_ratio: float) -> float:
    """Speedup of sequential drafting: E / (γ·c + t(γ+1)/t(1)), γ = len(alphas).

    Source: Leviathan et al. 2023, Theorem 3.8 (γ draft steps of cost c, one verify pass) with E of
    :func:`tokens_per_pass` and the verify pass's cost ``verify_ratio`` = t(γ+1)/t(1).

    Args:
        alphas: α_j for j = 1..γ. c: one draft step in target steps, [0, 1]. verify_ratio: > 0.

    Raises:
        InputError: bad α_j, c or verify ratio.
    """
    alphas = list(alphas)
    g = _gamma(len(alphas))
    cc = _num(c, "Draft cost c", 0.0, 1.0)
    vr = _num(verify_ratio, "Verify cost ratio t(γ+1)/t(1)", 1e-9, 1e6)
    return tokens_per_pass(alphas) / (g * cc + vr)


def block_speedup(alphas: Sequence[float], block_cost: BlockCost, verify_ratio: float) -> float:
    """Speedup of block drafting: E / (c_block(B) + t(B)/t(1)), B = γ + 1, γ = len(alphas).

    One drafter pass fills the block [bonus token, MASK × γ] (DFlash, arXiv 2602.06036); the target verifies
    the bonus token and the γ drafted ones in one pass over B tokens, ``verify_ratio`` = t(B)/t(1). The same
    accounting as Leviathan et al. 2023, Theorem 3.8, with the γ draft steps replaced by one block pass.

    Raises:
        InputError: bad α_j, block cost or verify ratio.
    """
    alphas = list(alphas)
    g = _gamma(len(alphas))
    vr = _num(verify_ratio, "Verify cost ratio t(B)/t(1)", 1e-9, 1e6)
    return tokens_per_pass(alphas) / (block_cost(g + 1) + vr)


def cut_oracle_verify_ratio(alphas: Sequence[float], slope: float = 0.0,
                            measured_ms: Mapping[int, float] | None = None) -> float:
    """Mean verify cost when an oracle cut verifies only the tokens the round keeps: E[t(T)/t(1)].

    T is the round's tokens (distribution :func:`tokens_distribution`): the oracle verifies the T − 1 drafts
    that will be accepted plus the bonus token, a pass over T tokens, instead of γ + 1. A **model** of
    DSpark's confidence cut (arXiv 2607.05147) at its best, not a measurement.

    Raises:
        InputError: bad α_j or verify curve.
    """
    probs = tokens_distribution(alphas)
    return float(sum(p * _verify(k, slope, measured_ms) for k, p in enumerate(probs, start=1)))


def cut_oracle_speedup(alphas: Sequence[float], block_cost: BlockCost, slope: float = 0.0,
                       measured_ms: Mapping[int, float] | None = None) -> float:
    """Speedup of block drafting with an oracle confidence cut: E / (c_block(B) + E[t(T)/t(1)]).

    The drafter still pays for the whole block (c_block(B), B = γ + 1); the verify pass covers only the tokens
    the round keeps (:func:`cut_oracle_verify_ratio`), so tokens per pass are those of the full verify. Since
    the oracle keeps every token and never verifies a rejected one, no cut keeps more tokens in a round or
    verifies fewer of them: the ceiling of DSpark's cut (arXiv 2607.05147) on this model, not its measured
    speed. With a flat verify cost (t(n) = t(1)) it equals :func:`block_speedup`: the cut saves only where
    verifying more tokens costs more.

    Raises:
        InputError: bad α_j, block cost or verify curve.
    """
    alphas = list(alphas)
    g = _gamma(len(alphas))
    return tokens_per_pass(alphas) / (block_cost(g + 1) + cut_oracle_verify_ratio(alphas, slope, measured_ms))


# ---------------------------------------------------------------------------------------------
# the curves against γ (what the page draws)


@dataclass
class DraftingCurves:
    """Sequential vs block drafting for γ = 1..gamma_max (list index γ − 1); costs in target steps t(1).

    Attributes:
        gammas: [1..gamma_max]; blocks: B = γ + 1.
        seq_tokens, block_tokens: E per target pass. seq_speedup, block_speedup, cut_speedup: ×.
        seq_draft_cost: γ·c. block_draft_cost: c_block(γ + 1). verify: t(γ+1)/t(1).
        cut_verify: E[t(T)/t(1)] under the oracle cut.
        seq_alphas, block_alphas: α_j for j = 1..gamma_max.
        best_seq, best_block, best_cut: (γ*, speedup at γ*), ties to the shorter draft.
    """

    gammas: list[int]
    blocks: list[int]
    seq_tokens: list[float]
    block_tokens: list[float]
    seq_speedup: list[float]
    block_speedup: list[float]
    cut_speedup: list[float]
    seq_draft_cost: list[float]
    block_draft_cost: list[float]
    verify: list[float]
    cut_verify: list[float]
    seq_alphas: list[float]
    block_alphas: list[float]
    best_seq: tuple[int, float] = field(default=(1, 0.0))
    best_block: tuple[int, float] = field(default=(1, 0.0))
    best_cut: tuple[int, float] = field(default=(1, 0.0))


def _best(gammas: list[int], ys: list[float]) -> tuple[int, float]:
    i = int(np.argmax(ys))
    return gammas[i], float(ys[i])


def drafting_curves(alpha: float, c: float, block_cost: BlockCost, block_decay: float = 1.0,
                    seq_decay: float = 1.0, slope: float = 0.0, measured_ms: Mapping[int, float] | None = None,
                    gamma_max: int = GAMMA_MAX) -> DraftingCurves:
    """Speedup against γ for sequential drafting, block drafting and block drafting with the oracle cut.

    Sequential: α_j = α·seq_decay^(j−1), cost γ·c + t(γ+1)/t(1) (:func:`sequential_speedup`). Block:
    α_j = α·block_decay^(j−1), cost c_block(γ+1) + t(γ+1)/t(1) (:func:`block_speedup`); with the cut, the verify
    term is E[t(T)/t(1)] (:func:`cut_oracle_speedup`). The verify curve t(n)/t(1) is
    ``engine.explain.analytic.verify_cost_ratio`` (slope s, or ``measured_ms``: ms by tokens fed).

    Args:
        alpha: α_1 in [0, 1] (the same first position for both). c: a sequential draft step, [0, 1].
        block_cost: c_block(B). block_decay, seq_decay: δ in [0, 1]. slope: s in [0, 10].
        measured_ms: {n: ms} or None. gamma_max: 1..64.

    Raises:
        InputError: any argument out of range.
    """
    gm = _gamma(gamma_max)
    seq_all = position_alphas(alpha, gm, seq_decay)
    blk_all = position_alphas(alpha, gm, block_decay)
    _num(c, "Draft cost c", 0.0, 1.0)
    gammas = list(range(1, gm + 1))
    out = DraftingCurves(gammas=gammas, blocks=[g + 1 for g in gammas], seq_tokens=[], block_tokens=[],
                         seq_speedup=[], block_speedup=[], cut_speedup=[], seq_draft_cost=[], block_draft_cost=[],
                         verify=[], cut_verify=[], seq_alphas=seq_all, block_alphas=blk_all)
    for g in gammas:
        vr = _verify(g + 1, slope, measured_ms)
        sa, ba = seq_all[:g], blk_all[:g]
        out.verify.append(vr)
        out.seq_tokens.append(tokens_per_pass(sa))
        out.block_tokens.append(tokens_per_pass(ba))
        out.seq_draft_cost.append(g * float(c))
        out.block_draft_cost.append(block_cost(g + 1))
        out.seq_speedup.append(sequential_speedup(sa, c, vr))
        out.block_speedup.append(block_speedup(ba, block_cost, vr))
        out.cut_verify.append(cut_oracle_verify_ratio(ba, slope, measured_ms))
        out.cut_speedup.append(cut_oracle_speedup(ba, block_cost, slope, measured_ms))
    out.best_seq = _best(gammas, out.seq_speedup)
    out.best_block = _best(gammas, out.block_speedup)
    out.best_cut = _best(gammas, out.cut_speedup)
    return out


# ---------------------------------------------------------------------------------------------
# measured results of the shipped drafters (benchmarks/bench_block.py)


@dataclass
class MeasuredDraft:
    """One measured row of ``block.json``: a draft's γ, tokens per target pass and speedup over plain decoding."""

    draft: str
    kind: str
    gamma: int
    tree: int
    tokens_per_pass: float
    tokens_per_s: float
    speedup: float


@dataclass
class BlockResults:
    """``benchmarks/results/block_amd-epyc.json`` read and checked.

    Attributes:
        cpu, compute: the machine's CPU model and compute path (label every number with them).
        machine: the whole ``machine`` object. command: how it was measured. target_step_ms: t(1) in ms.
        block_pass: {B: one drafter pass over B positions ÷ one target step} (c_block measured).
        rows: the measured drafts (plain included). path: the file read.
    """

    cpu: str
    compute: str
    machine: dict
    command: str
    target_step_ms: float
    block_pass: dict[int, float]
    rows: list[MeasuredDraft]
    path: str = ""

    def block_cost(self) -> BlockCost:
        """c_block(B) from the measured ``block_pass`` (:meth:`BlockCost.measured`).

        Raises:
            InputError: the file measured no block pass.
        """
        if not self.block_pass:
            raise InputError(f"{self.path or 'block.json'} has no measured block pass.")
        return BlockCost.measured(self.block_pass)

    def label(self) -> str:
        """"measured on <cpu>, <compute> kernels" for captions and legends."""
        return f"measured on {self.cpu}, {self.compute} kernels"

    def drafted(self) -> list[MeasuredDraft]:
        """The rows that drafted (γ ≥ 1), the ones that go on a speedup-against-γ chart."""
        return [r for r in self.rows if r.gamma >= 1]


def _field(obj: dict, key: str, where: str, kind: type | tuple[type, ...]):
    if not isinstance(obj, dict) or key not in obj:
        raise InputError(f"{where} lacks \"{key}\".")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, kind):
        raise InputError(f"{where}: \"{key}\" must be {'a number' if kind is not str else 'text'}, got {v!r}.")
    return v


def parse_block_results(data: object, path: str = "block.json") -> BlockResults:
    """Check the parsed JSON of ``block.json`` (schema below) and return it as :class:`BlockResults`.

    Schema: {"machine": {"cpu": str, "compute": str, ...}, "command": str, "target_step_ms": number > 0,
    "block_pass": [{"block": int ≥ 1, "ms": number, "ratio": number in (0, 10]}, ...],
    "rows": [{"draft": str, "kind": str, "gamma": int ≥ 0, "tree": int ≥ 0, "tokens_per_pass": number ≥ 1,
    "tokens_per_s": number ≥ 0, "speedup": number > 0}, ...]}.

    Raises:
        InputError: naming the file and the first thing that does not fit the schema.
    """
    num = (int, float)
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object at the top.")
    machine = data.get("machine")
    if not isinstance(machine, dict):
        raise InputError(f"{path} lacks its \"machine\" object (cpu, compute).")
    cpu = _field(machine, "cpu", f"{path}: machine", str)
    compute = _field(machine, "compute", f"{path}: machine", str)
    step = float(_field(data, "target_step_ms", path, num))
    if not (math.isfinite(step) and step > 0):
        raise InputError(f"{path}: target_step_ms must be > 0, got {step}.")
    passes = data.get("block_pass", [])
    if not isinstance(passes, list):
        raise InputError(f"{path}: \"block_pass\" must be a list.")
    block_pass: dict[int, float] = {}
    for i, p in enumerate(passes):
        where = f"{path}: block_pass[{i}]"
        b = _field(p, "block", where, int)
        r = float(_field(p, "ratio", where, num))
        if b < 1 or not (math.isfinite(r) and 0.0 < r <= BLOCK_COST_MAX):
            raise InputError(f"{where}: needs block ≥ 1 and a ratio in (0, {BLOCK_COST_MAX:g}], got {b}, {r}.")
        block_pass[b] = r
    rows_in = data.get("rows")
    if not isinstance(rows_in, list):
        raise InputError(f"{path}: \"rows\" must be a list of measured drafts.")
    rows = []
    for i, r in enumerate(rows_in):
        where = f"{path}: rows[{i}]"
        row = MeasuredDraft(draft=_field(r, "draft", where, str), kind=_field(r, "kind", where, str),
                            gamma=_field(r, "gamma", where, int), tree=_field(r, "tree", where, int),
                            tokens_per_pass=float(_field(r, "tokens_per_pass", where, num)),
                            tokens_per_s=float(_field(r, "tokens_per_s", where, num)),
                            speedup=float(_field(r, "speedup", where, num)))
        if row.gamma < 0 or row.tree < 0 or not (1.0 <= row.tokens_per_pass < 1e6) \
                or not (0.0 <= row.tokens_per_s < 1e9) or not (0.0 < row.speedup < 1e6):
            raise InputError(f"{where} ({row.draft}): needs γ ≥ 0, tree ≥ 0, tokens per pass ≥ 1, "
                             f"tokens/s ≥ 0 and speedup > 0.")
        rows.append(row)
    return BlockResults(cpu=cpu, compute=compute, machine=machine, command=str(data.get("command", "")),
                        target_step_ms=step, block_pass=dict(sorted(block_pass.items())), rows=rows, path=path)


def load_block_results(path: str | Path | None = None) -> BlockResults | None:
    """Read ``benchmarks/results/block_amd-epyc.json`` (or ``path``, else the file named by the environment variable
    ``SPEEDUP_LAB_BLOCK_RESULTS``, which the browser tests use for a fixture): None when the file does not exist.

    Raises:
        InputError: the file is unreadable, not JSON, or does not fit the schema of :func:`parse_block_results`.
    """
    p = Path(path or os.environ.get("SPEEDUP_LAB_BLOCK_RESULTS") or BLOCK_RESULTS)
    if not p.exists():
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{p.name} could not be read as JSON: {e}.") from None
    return parse_block_results(data, p.name)
