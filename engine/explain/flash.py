"""FlashAttention: exact attention in tiles with an online (running) softmax, and its memory-traffic model.

Three parts, all used by the FlashAttention page:

1. **Tiled attention** (:func:`tiled_attention`, :func:`trace_tiled_attention`): a block of ``Br``
   query rows meets a block of ``Bc`` key/value rows at a time. Per query row the algorithm keeps a
   running maximum ``m``, a running sum ``ℓ`` of exponentials and an unnormalized output ``Õ``; when a
   new tile of scores ``S = Q_i K_jᵀ · scale`` arrives it computes the tile's row maximum, rescales the
   old ``ℓ`` and ``Õ`` by ``exp(m_old − m_new)`` and adds the tile's contribution. At the end
   ``O = Õ / ℓ`` equals ``softmax(Q Kᵀ · scale) V`` exactly (up to rounding). Source: Dao et al. 2022,
   "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness", Algorithm 1 and
   Section 3.1 (the online softmax of Milakov & Gimelshein 2018); the unnormalized accumulator that is
   divided by ``ℓ`` only once at the end is FlashAttention-2's variant (Dao 2023, Section 3.1.1).

2. **Traffic model** (:func:`standard_traffic`, :func:`flash_traffic`): exact counts of elements read
   from and written to main memory (HBM) by the paper's Algorithm 0 (standard attention) and
   Algorithm 1 (FlashAttention forward), derived line by line from their loops, times bytes per
   element. Asymptotically these are Theorem 2's Θ(Nd + N²) and Θ(N²d²/M).

3. **Measurement** (:func:`measure_attention`): wall time and peak extra resident memory of naive
   attention (materializes the N×N scores) against PyTorch's fused
   ``torch.nn.functional.scaled_dot_product_attention`` on this machine.

Conventions: a single attention head has queries ``q`` of shape ``(N, d)`` (or ``(..., N, d)`` with any
leading batch/head dims), keys and values ``(N_k, d)``; ``scale`` defaults to ``1/√d``. With
``causal=True`` query row ``r`` sees key columns ``c ≤ r`` (top-left aligned, as PyTorch's
``is_causal``).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.errors import InputError

# ----------------------------------------------------------------------------------------------------
# Hardware presets
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwarePreset:
    """On-chip memory of one GPU streaming multiprocessor (SM), from the vendor's documentation.

    Attributes:
        name: GPU name.
        sram_kib: combined L1 data cache + shared memory per SM, KiB. This is the "on-chip SRAM per SM"
            figure the FlashAttention paper uses for the A100 (192 KB, Section 2.1), so the model
            uses it as ``M``.
        max_shared_kib: the part of it a kernel can reserve as shared memory, KiB (a smaller, stricter
            choice of ``M``).
        sms: number of SMs.
        hbm_tb_s: main-memory (HBM/GDDR) bandwidth, TB/s (for the "time at full bandwidth" bound).
        source: where the numbers come from.
    """

    name: str
    sram_kib: int
    max_shared_kib: int
    sms: int
    hbm_tb_s: float
    source: str

    @property
    def sram_bytes(self) -> int:
        return self.sram_kib * 1024


HARDWARE_PRESETS: dict[str, HardwarePreset] = {
    p.name: p
    for p in [
        HardwarePreset("NVIDIA T4", 96, 64, 40, 0.32,
                       "NVIDIA Turing Tuning Guide §1.4.2.1 (96 KB unified L1/shared per SM, up to 64 KB "
                       "shared); T4 datasheet (320 GB/s)"),
        HardwarePreset("NVIDIA V100 (SXM2)", 128, 96, 80, 0.9,
                       "NVIDIA Tesla V100 architecture whitepaper (128 KB combined L1/shared per SM, up "
                       "to 96 KB shared; 900 GB/s HBM2)"),
        HardwarePreset("NVIDIA A100 (SXM4 40GB)", 192, 164, 108, 1.555,
                       "NVIDIA A100 Tensor Core GPU architecture whitepaper (192 KB combined L1/shared "
                       "per SM, up to 164 KB shared; 1,555 GB/s HBM2); the FlashAttention paper §2.1 "
                       "quotes the same 192 KB × 108 SMs"),
        HardwarePreset("NVIDIA A10 / RTX 3090 (GA10x)", 128, 100, 72, 0.6,
                       "NVIDIA Ampere Tuning Guide §1.4.1.1 (GA10x: 128 KB combined L1/shared per SM, "
                       "up to 100 KB shared); A10 datasheet (600 GB/s)"),
        HardwarePreset("NVIDIA L4 / RTX 4090 (Ada)", 128, 100, 58, 0.3,
                       "NVIDIA Ada Tuning Guide §1.4.2.1 (128 KB combined L1/shared per SM, up to 100 KB "
                       "shared); L4 datasheet (58 SMs, 300 GB/s)"),
        HardwarePreset("NVIDIA H100 (SXM5)", 256, 228, 132, 3.35,
                       "NVIDIA H100 Tensor Core GPU architecture whitepaper (256 KB combined L1/shared "
                       "per SM); Hopper Tuning Guide §1.4.1.1 (up to 228 KB shared per SM); 3.35 TB/s "
                       "HBM3"),
    ]
}
DEFAULT_PRESET = "NVIDIA A100 (SXM4 40GB)"

# The paper's own example: Figure 2 (left) of Dao et al. 2022.
PAPER_EXAMPLE = {
    "label": "GPT-2 medium attention, A100 (Dao et al. 2022, Figure 2 left)",
    "n": 1024, "d": 64, "heads": 16, "batch": 64, "bytes_per_element": 2,
    "preset": DEFAULT_PRESET,
    "standard_gb": 40.3, "flash_gb": 4.4, "standard_ms": 41.7, "flash_ms": 7.3,
    "what": "measured HBM reads+writes of forward + backward, fp16, 16 heads × batch 64, on an A100",
}

# ----------------------------------------------------------------------------------------------------
# Attention, standard and tiled
# ----------------------------------------------------------------------------------------------------


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        raise InputError("q, k and v must have shape (..., N, d).")
    if k.shape != v.shape:
        raise InputError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.shape[-1] != k.shape[-1]:
        raise InputError(f"q and k must have the same head dimension d, got {q.shape[-1]} and {k.shape[-1]}.")
    if q.shape[:-2] != k.shape[:-2]:
        raise InputError(f"q and k must have the same leading (batch/head) dims, got {tuple(q.shape[:-2])} "
                         f"and {tuple(k.shape[:-2])}.")
    if q.shape[-2] < 1 or k.shape[-2] < 1 or q.shape[-1] < 1:
        raise InputError("Sequence length N and head dimension d must be at least 1.")


def _causal_mask(rows: range | torch.Tensor, cols: range | torch.Tensor) -> torch.Tensor:
    r = torch.as_tensor(list(rows) if isinstance(rows, range) else rows)
    c = torch.as_tensor(list(cols) if isinstance(cols, range) else cols)
    return c[None, :] <= r[:, None]  # True where the query row may see the key column


def standard_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       scale: float | None = None) -> torch.Tensor:
    """Standard attention, materializing the full score matrix (the paper's Algorithm 0).

    ``S = q kᵀ · scale`` (shape ``(..., N, N_k)``), ``P = softmax(S)`` row-wise, ``O = P v``.

    Args:
        q: ``(..., N, d)``; k, v: ``(..., N_k, d)``.
        causal: mask key columns ``c > r`` for query row ``r``.
        scale: score scale, default ``1/√d``.

    Returns:
        ``O`` of shape ``(..., N, d)``, same dtype as ``q``.

    Raises:
        InputError: on mismatched shapes.
    """
    _check_qkv(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(range(q.shape[-2]), range(k.shape[-2])), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _online_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, s: torch.Tensor,
                   v_tile: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One online-softmax step for a tile of scores (Algorithm 1, lines 10–12, unnormalized output).

    Args:
        m, l: ``(..., Br)`` running row max and row sum of ``exp(S − m)`` so far.
        acc: ``(..., Br, d)`` unnormalized output ``Σ exp(S − m) V`` so far.
        s: ``(..., Br, Bc)`` scaled, masked (−inf) scores of this tile.
        v_tile: ``(..., Bc, d)``.

    Returns:
        ``(m_new, l_new, acc_new, m_tile, l_tile, p_tile)``: the updated statistics, the tile's own row
        max ``m̃`` and row sum ``ℓ̃`` and ``P̃ = exp(S − m̃)``.
    """
    m_tile = s.amax(dim=-1)
    # A row whose every column in this tile is masked has m̃ = −inf; shift by 0 instead to avoid NaN.
    m_tile_safe = torch.where(torch.isinf(m_tile), torch.zeros_like(m_tile), m_tile)
    p_tile = torch.exp(s - m_tile_safe[..., None])
    l_tile = p_tile.sum(dim=-1)
    m_new = torch.maximum(m, m_tile)
    m_new_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_new_safe)          # rescales what was accumulated before (0 if m = −inf)
    beta = torch.exp(m_tile_safe - m_new_safe)  # rescales this tile's contribution
    beta = torch.where(torch.isinf(m_tile), torch.zeros_like(beta), beta)
    l_new = alpha * l + beta * l_tile
    acc_new = alpha[..., None] * acc + beta[..., None] * (p_tile @ v_tile)
    return m_new, l_new, acc_new, m_tile, l_tile, p_tile


def _tile_grid(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool,
               order: str) -> list[tuple[int, int, bool]]:
    """All (i, j, visited) pairs in loop order; ``visited`` is False for tiles a causal mask empties."""
    if order not in ("kv_outer", "q_outer"):
        raise InputError(f"order must be 'kv_outer' (Algorithm 1) or 'q_outer' (FlashAttention-2), got {order!r}.")
    t_r, t_c = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
    pairs = ([(i, j) for j in range(t_c) for i in range(t_r)] if order == "kv_outer"
             else [(i, j) for i in range(t_r) for j in range(t_c)])
    out = []
    for i, j in pairs:
        last_row = min((i + 1) * block_q, n_q) - 1
        out.append((i, j, not (causal and last_row < j * block_k)))
    return out


def _check_blocks(block_q: int, block_k: int) -> None:
    if int(block_q) != block_q or int(block_k) != block_k or block_q < 1 or block_k < 1:
        raise InputError(f"Block sizes must be whole numbers ≥ 1, got Br = {block_q}, Bc = {block_k}.")


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int,
                    causal: bool = False, scale: float | None = None,
                    return_stats: bool = False):
    """Exact attention computed tile by tile with an online softmax (FlashAttention's forward pass).

    Never forms the full ``(N, N_k)`` score matrix: only one ``(Br, Bc)`` tile of scores exists at a
    time. Tiles that a causal mask empties entirely are skipped, as the kernels do.

    Args:
        q: ``(..., N, d)``; k, v: ``(..., N_k, d)``. N need not be a multiple of the block sizes: the
            last tile is smaller.
        block_q: ``Br``, query rows per tile (≥ 1; may exceed N, giving one block).
        block_k: ``Bc``, key/value rows per tile (≥ 1).
        causal: query row ``r`` sees key columns ``c ≤ r``.
        scale: score scale, default ``1/√d``.
        return_stats: also return the final running statistics.

    Returns:
        ``O`` ``(..., N, d)``; with ``return_stats`` a tuple ``(O, m, ℓ)`` where ``m`` and ``ℓ``
        ``(..., N)`` are the row max of the scaled scores and ``Σ_c exp(S_rc − m_r)``.

    Raises:
        InputError: bad shapes or block sizes.

    Source: Dao et al. 2022, Algorithm 1 (loop over K/V blocks outside, Q blocks inside); the result
    does not depend on the loop order.
    """
    _check_qkv(q, k, v)
    _check_blocks(block_q, block_k)
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    lead = q.shape[:-2]
    m = torch.full((*lead, n_q), float("-inf"), dtype=q.dtype)
    l = torch.zeros((*lead, n_q), dtype=q.dtype)
    acc = torch.zeros((*lead, n_q, v.shape[-1]), dtype=q.dtype)
    for i, j, visited in _tile_grid(n_q, n_k, block_q, block_k, causal, "kv_outer"):
        if not visited:
            continue
        r0, r1 = i * block_q, min((i + 1) * block_q, n_q)
        c0, c1 = j * block_k, min((j + 1) * block_k, n_k)
        s = (q[..., r0:r1, :] @ k[..., c0:c1, :].transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~_causal_mask(range(r0, r1), range(c0, c1)), float("-inf"))
        m_new, l_new, acc_new, *_ = _online_update(m[..., r0:r1], l[..., r0:r1], acc[..., r0:r1, :], s,
                                                   v[..., c0:c1, :])
        m[..., r0:r1], l[..., r0:r1], acc[..., r0:r1, :] = m_new, l_new, acc_new
    out = acc / l[..., None]
    return (out, m, l) if return_stats else out


@dataclass
class TileStep:
    """One visited tile of :func:`trace_tiled_attention` (arrays are numpy copies, fp32/fp64).

    Attributes:
        index: 0-based step number.
        i, j: Q block index and K/V block index.
        rows: ``(r0, r1)`` query rows in fast memory (half-open); cols: ``(c0, c1)`` key/value rows.
        scores: ``(Br_i, Bc_j)`` scaled scores ``S_ij`` (masked entries −inf).
        p_tile: ``(Br_i, Bc_j)`` ``P̃ = exp(S − m̃)``.
        m_tile, l_tile: ``(Br_i,)`` the tile's own row max and row sum.
        m_before, m_after, l_before, l_after: ``(Br_i,)`` running statistics of these rows.
        out_before, out_after: ``(Br_i, d)`` current output estimate ``Õ / ℓ`` of these rows (zeros
            before the row's first tile).
    """

    index: int
    i: int
    j: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    scores: np.ndarray
    p_tile: np.ndarray
    m_tile: np.ndarray
    l_tile: np.ndarray
    m_before: np.ndarray
    m_after: np.ndarray
    l_before: np.ndarray
    l_after: np.ndarray
    out_before: np.ndarray
    out_after: np.ndarray


@dataclass
class TiledTrace:
    """Everything the step-through shows, for one head.

    Attributes:
        n, n_k, d, block_q, block_k, causal, order: the setting.
        t_r, t_c: number of Q blocks and K/V blocks.
        grid: ``(T_r, T_c)`` int array: step index at which tile (i, j) is visited, −1 if skipped.
        steps: the visited tiles in loop order.
        output: ``(N, d)`` tiled result; reference: ``(N, d)`` standard attention.
        max_abs_diff: ``max |output − reference|``.
        m_final, l_final: ``(N,)`` running statistics after the last tile.
        row_max, row_sum: ``(N,)`` the same quantities computed from the full score matrix at once.
    """

    n: int
    n_k: int
    d: int
    block_q: int
    block_k: int
    causal: bool
    order: str
    t_r: int
    t_c: int
    grid: np.ndarray
    steps: list[TileStep]
    output: np.ndarray
    reference: np.ndarray
    max_abs_diff: float
    m_final: np.ndarray
    l_final: np.ndarray
    row_max: np.ndarray
    row_sum: np.ndarray


MAX_TRACE_TILES = 1024


def trace_tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int,
                          causal: bool = False, order: str = "kv_outer",
                          scale: float | None = None) -> TiledTrace:
    """Run :func:`tiled_attention` on one head and record every tile (for the step-through).

    Args:
        q: ``(N, d)``; k, v: ``(N_k, d)``; block_q ``Br``, block_k ``Bc`` ≥ 1; causal as in
            :func:`tiled_attention`.
        order: ``"kv_outer"`` (Algorithm 1 of the FlashAttention paper: each K/V block is loaded once
            and every Q block visits it) or ``"q_outer"`` (FlashAttention-2: each Q block stays in fast
            memory while all K/V blocks stream past). Same result either way.

    Returns:
        A :class:`TiledTrace`.

    Raises:
        InputError: bad shapes/blocks, or more than ``MAX_TRACE_TILES`` tiles to record.
    """
    _check_qkv(q, k, v)
    if q.dim() != 2:
        raise InputError("The step-through works on one head: q, k, v of shape (N, d).")
    _check_blocks(block_q, block_k)
    n_q, n_k, d = q.shape[0], k.shape[0], q.shape[1]
    t_r, t_c = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
    if t_r * t_c > MAX_TRACE_TILES:
        raise InputError(f"N = {n_q} with Br = {block_q} and Bc = {block_k} makes {t_r} × {t_c} = "
                         f"{t_r * t_c} tiles, too many to step through (at most {MAX_TRACE_TILES}). "
                         "Use larger blocks or a shorter sequence.")
    scale = d ** -0.5 if scale is None else scale
    m = torch.full((n_q,), float("-inf"), dtype=q.dtype)
    l = torch.zeros(n_q, dtype=q.dtype)
    acc = torch.zeros((n_q, v.shape[1]), dtype=q.dtype)
    grid = np.full((t_r, t_c), -1, dtype=int)
    steps: list[TileStep] = []

    def estimate(rows: slice) -> np.ndarray:
        lv = l[rows]
        safe = torch.where(lv > 0, lv, torch.ones_like(lv))
        return (acc[rows] / safe[:, None]).numpy().copy()

    for i, j, visited in _tile_grid(n_q, n_k, block_q, block_k, causal, order):
        if not visited:
            continue
        r0, r1 = i * block_q, min((i + 1) * block_q, n_q)
        c0, c1 = j * block_k, min((j + 1) * block_k, n_k)
        rows = slice(r0, r1)
        s = (q[rows] @ k[c0:c1].T) * scale
        if causal:
            s = s.masked_fill(~_causal_mask(range(r0, r1), range(c0, c1)), float("-inf"))
        m_before, l_before, out_before = m[rows].numpy().copy(), l[rows].numpy().copy(), estimate(rows)
        m_new, l_new, acc_new, m_tile, l_tile, p_tile = _online_update(m[rows], l[rows], acc[rows], s,
                                                                       v[c0:c1])
        m[rows], l[rows], acc[rows] = m_new, l_new, acc_new
        grid[i, j] = len(steps)
        steps.append(TileStep(len(steps), i, j, (r0, r1), (c0, c1), s.numpy().copy(),
                              p_tile.numpy().copy(), m_tile.numpy().copy(), l_tile.numpy().copy(),
                              m_before, m[rows].numpy().copy(), l_before, l[rows].numpy().copy(),
                              out_before, estimate(rows)))
    output = (acc / l[:, None])
    reference = standard_attention(q, k, v, causal=causal, scale=scale)
    s_full = (q @ k.T) * scale
    if causal:
        s_full = s_full.masked_fill(~_causal_mask(range(n_q), range(n_k)), float("-inf"))
    row_max = s_full.amax(dim=-1)
    row_sum = torch.exp(s_full - row_max[:, None]).sum(dim=-1)
    return TiledTrace(n_q, n_k, d, int(block_q), int(block_k), causal, order, t_r, t_c, grid, steps,
                      output.numpy(), reference.numpy(), float((output - reference).abs().max()),
                      m.numpy(), l.numpy(), row_max.numpy(), row_sum.numpy())


# ----------------------------------------------------------------------------------------------------
# Memory-traffic model
# ----------------------------------------------------------------------------------------------------


def sram_elements(sram_bytes: int, bytes_per_element: int) -> int:
    """On-chip memory ``M`` in elements: ``⌊sram_bytes / bytes_per_element⌋``.

    The paper counts ``M`` in elements of the input's dtype (Theorem 2, ``d ≤ M ≤ Nd``).
    """
    if sram_bytes < 1 or bytes_per_element < 1:
        raise InputError("On-chip memory and bytes per element must be positive.")
    return int(sram_bytes) // int(bytes_per_element)


def block_sizes(m_elements: int, d: int) -> tuple[int, int]:
    """The FlashAttention paper's block sizes for on-chip memory of ``M`` elements.

    ``Bc = ⌈M / 4d⌉``, ``Br = min(⌈M / 4d⌉, d)`` (Dao et al. 2022, Algorithm 1 line 1). With these,
    ``K_j, V_j`` (2·Bc·d) and ``Q_i, O_i`` (2·Br·d) fill about ``M``.

    Returns:
        ``(Br, Bc)``.

    Raises:
        InputError: if ``M < d`` (not even one row of Q fits) or ``d < 1``.
    """
    if d < 1:
        raise InputError(f"Head dimension d must be ≥ 1, got {d}.")
    if m_elements < d:
        raise InputError(f"On-chip memory of {m_elements} elements cannot hold even one row of length d = {d} "
                         "(the paper assumes d ≤ M ≤ Nd).")
    bc = math.ceil(m_elements / (4 * d))
    return min(bc, d), bc


@dataclass(frozen=True)
class Traffic:
    """Main-memory (HBM) traffic of one attention forward pass for ONE head, and its extra memory.

    Attributes:
        algorithm: "standard" (Algorithm 0) or "flash" (Algorithm 1).
        n, d, bytes_per_element: the setting; block_q, block_k: ``Br, Bc`` (0 for standard).
        reads, writes: elements read/written per tensor, e.g. ``{"Q": …, "K": …, "S": …}``.
        extra_elements: elements held in main memory besides Q, K, V, O (S and P for standard; m and ℓ
            for FlashAttention).
        tiles: number of (Q block, K/V block) pairs visited (0 for standard).
    """

    algorithm: str
    n: int
    d: int
    bytes_per_element: int
    reads: dict[str, int]
    writes: dict[str, int]
    extra_elements: int
    block_q: int = 0
    block_k: int = 0
    tiles: int = 0

    @property
    def read_elements(self) -> int:
        return sum(self.reads.values())

    @property
    def write_elements(self) -> int:
        return sum(self.writes.values())

    @property
    def elements(self) -> int:
        """Elements read + written."""
        return self.read_elements + self.write_elements

    @property
    def bytes(self) -> int:
        """Bytes read + written: ``elements × bytes_per_element``."""
        return self.elements * self.bytes_per_element

    @property
    def extra_bytes(self) -> int:
        return self.extra_elements * self.bytes_per_element


def _check_nd(n: int, d: int, bytes_per_element: int) -> None:
    if n < 1 or d < 1:
        raise InputError(f"Sequence length N and head dimension d must be ≥ 1, got N = {n}, d = {d}.")
    if bytes_per_element not in (1, 2, 4, 8):
        raise InputError(f"Bytes per element must be 1, 2, 4 or 8, got {bytes_per_element}.")


def standard_traffic(n: int, d: int, bytes_per_element: int = 2) -> Traffic:
    """Exact main-memory traffic of standard attention, the paper's Algorithm 0, for one head.

    Line 1: read Q, K (2Nd), write S (N²). Line 2: read S (N²), write P (N²). Line 3: read P (N²) and
    V (Nd), write O (Nd). Total reads ``2N² + 3Nd``, writes ``2N² + Nd``: Θ(Nd + N²) (Theorem 2).
    A causal mask is assumed applied inside line 2 (no extra pass); the full N×N matrices are still
    written. Extra memory: S and P, ``2N²`` elements (an out-of-place softmax keeps both alive, as
    PyTorch's does).

    Args:
        n: sequence length N; d: head dimension; bytes_per_element: 2 for fp16/bf16, 4 for fp32.

    Raises:
        InputError: non-positive sizes.

    Source: Dao et al. 2022, Algorithm 0 and Theorem 2.
    """
    _check_nd(n, d, bytes_per_element)
    nd, nn = n * d, n * n
    reads = {"Q": nd, "K": nd, "V": nd, "S": nn, "P": nn}
    writes = {"S": nn, "P": nn, "O": nd}
    return Traffic("standard", n, d, bytes_per_element, reads, writes, extra_elements=2 * nn)


def flash_traffic(n: int, d: int, block_q: int, block_k: int, causal: bool = False,
                  bytes_per_element: int = 2) -> Traffic:
    """Exact main-memory traffic of FlashAttention's forward pass, the paper's Algorithm 1, for one head.

    Counted from the loops (``T_c = ⌈N/Bc⌉`` K/V blocks outside, ``T_r = ⌈N/Br⌉`` Q blocks inside):

    - line 2, initialize O, ℓ, m in HBM: write ``Nd + 2N``;
    - line 6, load K_j, V_j: read ``2 · Bc_j · d`` per K/V block, ``2Nd`` in all;
    - line 8, load Q_i, O_i, ℓ_i, m_i: read ``2 · Br_i · d + 2 · Br_i`` per visited tile;
    - lines 12–13, write O_i, ℓ_i, m_i: write ``Br_i · d + 2 · Br_i`` per visited tile.

    Without a mask every tile is visited and the total is ``3Nd + 2N + T_c · (3Nd + 4N)`` elements,
    which is Θ(N²d²/M) for ``Bc ≈ M/4d`` (Theorem 2). With ``causal=True`` tiles whose every entry is
    masked (last row of Q_i < first column of K_j) are skipped, as the block-sparse variant
    (Algorithm 5) does. Extra memory: ℓ and m, ``2N`` elements.

    Args:
        n: sequence length N; d: head dimension; block_q: ``Br``; block_k: ``Bc`` (see
            :func:`block_sizes`); causal: skip fully masked tiles; bytes_per_element: 2 for fp16.

    Raises:
        InputError: non-positive sizes.

    Source: Dao et al. 2022, Algorithm 1, Theorem 2, Algorithm 5.
    """
    _check_nd(n, d, bytes_per_element)
    _check_blocks(block_q, block_k)
    t_r, t_c = math.ceil(n / block_q), math.ceil(n / block_k)
    # Per K/V block j (outer loop) the visited Q blocks are i = i0_j … T_r − 1, where i0_j = 0 without a
    # mask and, with a causal mask, the Q block holding row j·Bc (earlier Q blocks end before column
    # j·Bc). Those blocks cover rows i0_j·Br … N − 1, so lines 8 and 12–13 move
    # (N − i0_j·Br)·(2d + 2) and (N − i0_j·Br)·(d + 2) elements. Summing over j instead of looping over
    # every (i, j) keeps this O(T_c).
    j = np.arange(t_c, dtype=np.int64)
    i0 = (j * block_k) // block_q if causal else np.zeros_like(j)
    rows_visited = int((n - i0 * block_q).sum())     # Σ_j Σ_{visited i} Br_i
    tiles = int((t_r - i0).sum())
    reads = {"Q": rows_visited * d, "K": n * d, "V": n * d, "O": rows_visited * d, "m, ℓ": 2 * rows_visited}
    writes = {"O": n * d + rows_visited * d,          # line 2 (initialize) + line 12
              "m, ℓ": 2 * n + 2 * rows_visited}        # line 2 + line 13
    return Traffic("flash", n, d, bytes_per_element, reads, writes, extra_elements=2 * n,
                   block_q=int(block_q), block_k=int(block_k), tiles=tiles)


@dataclass
class TrafficCurve:
    """Traffic and extra memory against N for the whole batch (``batch_heads`` heads).

    Attributes:
        ns: sequence lengths; block_q, block_k: ``Br, Bc`` used; m_elements: ``M`` in elements.
        standard_bytes, flash_bytes: main-memory bytes read + written, per N.
        standard_extra_bytes, flash_extra_bytes: extra main memory, per N.
        ratio: standard_bytes / flash_bytes per N.
    """

    ns: list[int]
    d: int
    block_q: int
    block_k: int
    m_elements: int
    batch_heads: int
    bytes_per_element: int
    causal: bool
    standard_bytes: list[int] = field(default_factory=list)
    flash_bytes: list[int] = field(default_factory=list)
    standard_extra_bytes: list[int] = field(default_factory=list)
    flash_extra_bytes: list[int] = field(default_factory=list)

    @property
    def ratio(self) -> list[float]:
        return [s / f for s, f in zip(self.standard_bytes, self.flash_bytes)]


def traffic_curve(ns: list[int], d: int, sram_bytes: int, bytes_per_element: int = 2, causal: bool = False,
                  batch_heads: int = 1) -> TrafficCurve:
    """Standard vs FlashAttention forward traffic and extra memory over sequence lengths ``ns``.

    Block sizes come from :func:`block_sizes` with ``M = sram_bytes / bytes_per_element``; every
    count is :func:`standard_traffic` / :func:`flash_traffic` times ``batch_heads``.

    Raises:
        InputError: bad sizes, or on-chip memory smaller than one row.
    """
    if batch_heads < 1:
        raise InputError(f"batch × heads must be ≥ 1, got {batch_heads}.")
    m_el = sram_elements(sram_bytes, bytes_per_element)
    br, bc = block_sizes(m_el, d)
    curve = TrafficCurve(list(ns), d, br, bc, m_el, batch_heads, bytes_per_element, causal)
    for n in ns:
        st_, fl = standard_traffic(n, d, bytes_per_element), flash_traffic(n, d, br, bc, causal, bytes_per_element)
        curve.standard_bytes.append(st_.bytes * batch_heads)
        curve.flash_bytes.append(fl.bytes * batch_heads)
        curve.standard_extra_bytes.append(st_.extra_bytes * batch_heads)
        curve.flash_extra_bytes.append(fl.extra_bytes * batch_heads)
    return curve


@dataclass
class PaperComparison:
    """The model on the paper's Figure 2 workload, next to the paper's measured numbers."""

    standard: Traffic
    flash: Traffic
    heads_total: int
    model_standard_gb: float
    model_flash_gb: float
    paper_standard_gb: float
    paper_flash_gb: float

    @property
    def model_ratio(self) -> float:
        return self.model_standard_gb / self.model_flash_gb

    @property
    def paper_ratio(self) -> float:
        return self.paper_standard_gb / self.paper_flash_gb


def paper_comparison() -> PaperComparison:
    """The traffic model on GPT-2 medium attention (N = 1024, d = 64, 16 heads × batch 64, fp16, A100's
    192 KiB per SM) beside Figure 2 (left) of Dao et al. 2022 (40.3 GB vs 4.4 GB).

    The model counts the forward pass only and only the loads/stores written in Algorithms 0 and 1;
    the paper's numbers are profiled reads+writes of forward AND backward, whose standard version
    also writes and reads dP and dS (more N×N matrices; Algorithm 3 in the paper's appendix), and real
    implementations add elementwise N×N passes (mask, dropout; Section 2.2) that Algorithm 0 omits.
    So the model's numbers are smaller, and its ratio is not the paper's ratio.
    """
    ex = PAPER_EXAMPLE
    preset = HARDWARE_PRESETS[ex["preset"]]
    m_el = sram_elements(preset.sram_bytes, ex["bytes_per_element"])
    br, bc = block_sizes(m_el, ex["d"])
    s = standard_traffic(ex["n"], ex["d"], ex["bytes_per_element"])
    f = flash_traffic(ex["n"], ex["d"], br, bc, False, ex["bytes_per_element"])
    heads = ex["heads"] * ex["batch"]
    return PaperComparison(s, f, heads, s.bytes * heads / 1e9, f.bytes * heads / 1e9,
                           ex["standard_gb"], ex["flash_gb"])


def format_bytes(b: float) -> str:
    """Bytes in decimal units as the FlashAttention paper writes them (1 GB = 10⁹ bytes): '9.13 GB'."""
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:.3g} {unit}"
    return f"{b:.0f} B"


# ----------------------------------------------------------------------------------------------------
# The page's one call
# ----------------------------------------------------------------------------------------------------

STEP_N_MAX, STEP_D_MAX, STEP_BLOCK_MAX = 64, 16, 32
CURVE_N_MAX = 131072


@dataclass
class FlashReport:
    """What the FlashAttention page draws: the step-through trace, the traffic curve for the chosen
    hardware, per-head counts at the largest N, and the paper comparison."""

    trace: TiledTrace
    curve: TrafficCurve
    preset: HardwarePreset
    standard_at_n: Traffic
    flash_at_n: Traffic
    paper: PaperComparison


def flash_report(n: int, d: int, block_q: int, block_k: int, causal: bool = False, order: str = "kv_outer",
                 seed: int = 0, preset: str = DEFAULT_PRESET, sram_kib: int | None = None,
                 curve_d: int = 64, curve_n_max: int = 16384, bytes_per_element: int = 2,
                 batch_heads: int = 1) -> FlashReport:
    """Build everything the page shows.

    Args:
        n, d, block_q, block_k, causal, order: the small step-through example (random fp32 q, k, v
            from ``seed``); 1 ≤ n ≤ 64, 1 ≤ d ≤ 16, 1 ≤ blocks ≤ min(32, n).
        preset: a key of :data:`HARDWARE_PRESETS`; sram_kib: overrides its on-chip memory per SM (KiB).
        curve_d, curve_n_max, bytes_per_element, batch_heads: the traffic model's setting; N runs over
            powers of two from 128 to ``curve_n_max`` (≤ 131072).

    Raises:
        InputError: out-of-range values or an impossible combination, with a message saying which.
    """
    if not 1 <= n <= STEP_N_MAX:
        raise InputError(f"Sequence length N must be between 1 and {STEP_N_MAX} in the step-through, got {n}.")
    if not 1 <= d <= STEP_D_MAX:
        raise InputError(f"Head dimension d must be between 1 and {STEP_D_MAX} in the step-through, got {d}.")
    for name, b in (("Br (query block)", block_q), ("Bc (key/value block)", block_k)):
        if not 1 <= b <= STEP_BLOCK_MAX:
            raise InputError(f"{name} must be between 1 and {STEP_BLOCK_MAX}, got {b}.")
        if b > n:
            raise InputError(f"{name} = {b} is larger than the sequence length N = {n}: a tile cannot hold "
                             f"more rows than the sequence has. Choose a block ≤ {n} or a longer sequence.")
    if preset not in HARDWARE_PRESETS:
        raise InputError(f"Unknown hardware preset {preset!r}; choose one of {', '.join(HARDWARE_PRESETS)}.")
    if not 128 <= curve_n_max <= CURVE_N_MAX:
        raise InputError(f"Largest N for the traffic chart must be between 128 and {CURVE_N_MAX}, got {curve_n_max}.")
    hw = HARDWARE_PRESETS[preset]
    sram_bytes = hw.sram_bytes if sram_kib is None else int(sram_kib) * 1024
    gen = torch.Generator().manual_seed(int(seed))
    q, k, v = (torch.randn(n, d, generator=gen) for _ in range(3))
    trace = trace_tiled_attention(q, k, v, block_q, block_k, causal=causal, order=order)
    ns = [2 ** p for p in range(7, int(math.log2(curve_n_max)) + 1)]
    if not 1 <= curve_d <= 512:
        raise InputError(f"Head dimension d for the traffic model must be between 1 and 512, got {curve_d}.")
    m_el = sram_elements(sram_bytes, bytes_per_element)
    if m_el < 4 * curve_d:
        raise InputError(f"On-chip memory of {sram_bytes / 1024:g} KiB holds {m_el} elements of "
                         f"{bytes_per_element} bytes, fewer than 4·d = {4 * curve_d}: one row each of K, V, Q "
                         "and O does not fit. Use more on-chip memory or a smaller head dimension.")
    curve = traffic_curve(ns, curve_d, sram_bytes, bytes_per_element, causal, batch_heads)
    s_n = standard_traffic(ns[-1], curve_d, bytes_per_element)
    f_n = flash_traffic(ns[-1], curve_d, curve.block_q, curve.block_k, causal, bytes_per_element)
    return FlashReport(trace, curve, hw, s_n, f_n, paper_comparison())


# ----------------------------------------------------------------------------------------------------
# Measurement on this machine
# ----------------------------------------------------------------------------------------------------


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """The textbook PyTorch attention: ``softmax(q kᵀ/√d [+ mask]) v``, materializing N×N scores.

    Shapes ``(B, H, N, d)``; same maths as :func:`standard_attention`.
    """
    return standard_attention(q, k, v, causal=causal)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """PyTorch's fused ``scaled_dot_product_attention`` (on CPU a tiled, online-softmax kernel)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


@dataclass
class Measurement:
    """One measured point.

    Attributes:
        n: sequence length; method: "naive" or "fused".
        ms: best (minimum) wall time over the repeats, milliseconds; the minimum is the least disturbed
            by other work on a shared machine.
        peak_extra_bytes: rise of the worker process's peak resident memory (VmHWM) over its resident
            memory just before one call, bytes; None where /proc cannot be read. Below about 1 MB it
            reads low (lazy kernel RSS counters, allocator reuse).
        predicted_extra_bytes: the model's extra memory for the same shape: S and P
            (``2 · heads · N² · 4`` bytes) plus the output for naive; the output only for fused.
        max_abs_diff: max |naive − fused| on this input (both fp32).
    """

    n: int
    method: str
    ms: float
    peak_extra_bytes: int | None
    predicted_extra_bytes: int
    max_abs_diff: float


def _use_mmap_for_large_blocks() -> None:
    """Make glibc serve every allocation ≥ 64 KiB with its own mmap, returned to the OS on free, so the
    resident size follows the live tensors (otherwise freed heap memory is reused and a new N×N matrix
    can fit in memory already counted as resident). No-op outside glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _measure_points(ns: list[int], d: int, heads: int, causal: bool, repeats: int, memory_limit_bytes: int,
                    seed: int) -> list[dict]:
    """The measurement loop, run inside a fresh worker process (see :func:`measure_attention`)."""
    _use_mmap_for_large_blocks()
    gen = torch.Generator().manual_seed(seed)
    out: list[dict] = []
    for n in sorted(ns):
        naive_pred = 2 * heads * n * n * 4 + heads * n * d * 4
        if naive_pred > memory_limit_bytes:
            break
        q, k, v = (torch.randn(1, heads, n, d, generator=gen) for _ in range(3))
        outputs = {}
        for method, fn, pred in (("naive", naive_attention, naive_pred),
                                 ("fused", fused_attention, heads * n * d * 4)):
            outputs[method] = fn(q, k, v, causal)  # warm-up, and the output for the comparison
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(q, k, v, causal)
                times.append((time.perf_counter() - t0) * 1e3)
            gc.collect()
            peak = None
            if _reset_peak_rss():
                base = _proc_status("VmRSS")
                o2 = fn(q, k, v, causal)
                hwm = _proc_status("VmHWM")
                del o2
                if base is not None and hwm is not None:
                    peak = max(hwm - base, 0)
            out.append(dict(n=n, method=method, ms=min(times), peak_extra_bytes=peak,
                            predicted_extra_bytes=pred, max_abs_diff=0.0))
        diff = float((outputs["naive"] - outputs["fused"]).abs().max())
        out[-1]["max_abs_diff"] = out[-2]["max_abs_diff"] = diff
        del q, k, v, outputs
        gc.collect()
    return out


def measure_attention(ns: list[int], d: int = 64, heads: int = 4, causal: bool = False, repeats: int = 3,
                      memory_limit_bytes: int = 2 * 1024 ** 3, seed: int = 0, threads: int = 1,
                      timeout_s: float = 300.0) -> list[Measurement]:
    """Time and peak memory of naive attention vs PyTorch's fused SDPA on this machine (fp32, CPU).

    Runs in a fresh Python worker process, so the app's own memory does not blur the reading and a
    failure cannot take the app down. For each N: random ``q, k, v`` of shape ``(1, heads, N, d)``;
    each method runs once to warm up, then ``repeats`` timed runs (best kept); the peak extra resident
    memory is read from the kernel's VmHWM around one more call. Sizes whose naive S and P would exceed
    ``memory_limit_bytes`` are not run (the list stops there), so the machine never runs out of memory.

    Args:
        ns: sequence lengths; d: head dimension; heads: number of heads; causal: causal mask;
        repeats: timed runs per point (1–10); memory_limit_bytes: cap on the naive method's predicted
        extra memory; threads: torch CPU threads in the worker (default 1: on a busy 2-core machine a
        multi-threaded op waits for its slowest, descheduled thread, which swamps small sizes);
        timeout_s: give up after this long.

    Returns:
        Two :class:`Measurement` per N run (naive, then fused), N ascending.

    Raises:
        InputError: empty or non-positive sizes, repeats outside 1–10.
        SpeedupLabError: the worker failed or timed out.
    """
    import json
    import subprocess
    import sys
    from pathlib import Path

    from engine.errors import SpeedupLabError

    if not ns or any(n < 1 for n in ns) or d < 1 or heads < 1:
        raise InputError("Sequence lengths, head dimension and heads must all be ≥ 1.")
    if not 1 <= repeats <= 10:
        raise InputError(f"repeats must be between 1 and 10, got {repeats}.")
    if not 1 <= threads <= 64:
        raise InputError(f"threads must be between 1 and 64, got {threads}.")
    args = dict(ns=[int(n) for n in ns], d=int(d), heads=int(heads), causal=bool(causal), repeats=int(repeats),
                memory_limit_bytes=int(memory_limit_bytes), seed=int(seed))
    code = ("import json, sys, torch; from engine.explain.flash import _measure_points; "
            f"torch.set_num_threads({int(threads)}); "
            "print(json.dumps(_measure_points(**json.loads(sys.argv[1]))))")
    root = Path(__file__).resolve().parents[2]
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], cwd=root, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SpeedupLabError(f"The measurement took longer than {timeout_s:g} s; try smaller sizes.") from None
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no message"]
        raise SpeedupLabError(f"The measurement worker failed (exit {proc.returncode}): {tail[0]}")
    return [Measurement(**row) for row in json.loads(proc.stdout.strip().splitlines()[-1])]
