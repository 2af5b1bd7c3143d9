"""Batch-invariant decode passes: inside ``batch_invariant`` every product takes the streaming kernel and the lean
layers' attention is ``invariant_attention``, so each row of a shared pass gets the bits of its lone pass
(``engine.decoding.invariance`` checks on the machine that this holds).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from engine.decoding.compute import extension

_INVARIANT = threading.local()  # batch_invariant's settings, per thread (the room's worker, a page's own decoder)
KEY_ALIGN = 16
"""Where ``invariant_attention`` falls back to PyTorch's SDPA (no kernel built), each row's keys are zero-padded to a
multiple of this (16 fp32 lanes), as its lone pass's are, so the row's call has its lone call's shapes; the room's
batch cache is allocated to a multiple of it too."""


@contextlib.contextmanager
def batch_invariant(rows: list[tuple[int, int]] | None = None, new_at: int | None = None):
    """Run decode passes (a pass after a cache, the target's or a draft's) so that each sequence's result is the same
    bits whatever else shares its pass: the room's batched pass and a reader's lone pass give a row the same logits
    and KV entries, so the room's texts are a reader's texts alone even at a near tie.

    Inside: every product takes the streaming kernel at any row count (its sums never depend on the rows beside
    them, ``small_linear.cpp``; oneDNN's do), and ``_lean_forward``'s attention is ``invariant_attention`` (each
    row's softmax from its own keys in a fixed order, ``invariant_attention.cpp``). Prefills stay outside (one
    sequence each, so their bits never depend on others either). ``engine.decoding.invariance`` checks on the
    machine that a shared pass gives each row its lone bits.

    Args:
        rows: for a batched pass, each row's (its cached keys, tokens it feeds): the cached keys are columns
            [start, new_at) of the batch cache for an int start (left-padded, ``attention.stack_left_padded``), or the
            columns a LongTensor lists, in order (a cache with holes: the head's batched drafting); its fed tokens'
            keys are [new_at, new_at + fed). None: one sequence, keys from column 0.
        new_at: the batch cache's column where the pass's fed tokens start (with ``rows``).
    """
    prev = (getattr(_INVARIANT, "on", False), getattr(_INVARIANT, "rows", None), getattr(_INVARIANT, "new_at", None))
    _INVARIANT.on, _INVARIANT.rows, _INVARIANT.new_at = True, rows, new_at
    try:
        yield
    finally:
        _INVARIANT.on, _INVARIANT.rows, _INVARIANT.new_at = prev
        _INVARIANT.span_key = None


def _aligned(n: int) -> int:
    return (n + KEY_ALIGN - 1) // KEY_ALIGN * KEY_ALIGN


def _padded(k: torch.Tensor, v: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, heads, n, dim] keys and values zero-padded to ``_aligned(n)`` entries (the same tensors when aligned)."""
    m = _aligned(n)
    if m == n == k.shape[2]:
        return k, v
    kk, vv = k.new_zeros(1, k.shape[1], m, k.shape[3]), v.new_zeros(1, v.shape[1], m, v.shape[3])
    kk[:, :, :n], vv[:, :, :n] = k[:, :, :n], v[:, :, :n]
    return kk, vv


def _causal(n_keys: int, n_q: int, total: int, device) -> torch.Tensor:
    """[1, 1, n_q, total] bool: query j (the last n_q of n_keys positions) sees keys [0, n_keys − n_q + j]."""
    j = torch.arange(n_q, device=device)[:, None]
    c = torch.arange(total, device=device)[None, :]
    return (c <= n_keys - n_q + j)[None, None]


def _spans(rows: list[tuple] | None, length: int, n_q: int, new_at: int | None, device) -> tuple:
    """(cols [B, C] int64, n_cols [B], n_fed [B]) for ``invariant_attention``'s kernel: each row's key columns in
    order, its cached columns then its fed tokens' ``[new_at, new_at + fed)``; rows None: one sequence whose
    ``length`` keys are all its own, the last ``n_q`` of them fed."""
    if rows is None:
        return (torch.arange(length, device=device)[None], torch.tensor([length], device=device),
                torch.tensor([n_q], device=device))
    per = []
    for s, w in rows:
        cached = torch.arange(s, new_at, device=device) if isinstance(s, int) else s.to(device=device, dtype=torch.long)
        per.append(torch.cat([cached, torch.arange(new_at, new_at + w, device=device)]))
    cols = torch.zeros(len(per), max(1, max(len(c) for c in per)), dtype=torch.long, device=device)
    for r, c in enumerate(per):
        cols[r, :len(c)] = c
    return (cols, torch.tensor([len(c) for c in per], device=device),
            torch.tensor([w for _, w in rows], device=device))


def pass_spans(rows: list[tuple] | None, length: int, n_q: int, new_at: int | None, device) -> tuple:
    """``_spans`` for the current pass, made once per pass, not per layer (kept in ``_INVARIANT`` under the pass's
    rows, cache length and width): (cols [B, C], n_cols [B], n_fed [B]) int64."""
    key = (id(rows), length, n_q, new_at)
    if getattr(_INVARIANT, "span_key", None) != key:
        _INVARIANT.spans, _INVARIANT.span_key = _spans(rows, length, n_q, new_at, device), key
    return _INVARIANT.spans


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        rows: list[tuple[int, int]] | None = None, new_at: int | None = None) -> torch.Tensor:
    """Causal attention of a decode pass whose every query gets the same bits as in a lone pass of its sequence,
    on any CPU, by construction.

    With the streaming kernel's extension built (``stream_kernel``), the kernel ``invariant_attention.cpp`` computes
    each (row, head, query) from the row's own keys only, in a summation order fixed by this project (16-lane
    partial sums in key and dimension order, a fixed pairwise tree, one exp polynomial): nothing depends on the other
    rows, on where a row's keys sit in the batch cache, or on the thread split. Without it (no compiler here), each
    row is one PyTorch SDPA call laid out exactly as its lone pass (its keys copied out and zero-padded to a multiple
    of ``KEY_ALIGN``, the same shapes and values as alone), which relies only on SDPA giving equal inputs equal
    outputs; ``invariance_check`` says which holds on this machine.

    Args:
        q: [B, query heads, Q, dim]; k, v: [B, kv heads, L, dim] (grouped heads, query heads a multiple of kv heads).
        scale: the softmax scale. rows, new_at: as ``batch_invariant``'s (None: B = 1, keys from column 0, the last
            Q of them the queries' own).

    Returns:
        [B, query heads, Q, dim]; a row's positions past what it feeds are zeros.

    Raises:
        ValueError: a batch of several rows without their spans.
    """
    b, _, n_q, _ = q.shape
    if rows is None and b != 1:
        raise ValueError(f"invariant_attention: a batch of {b} needs each row's span (rows, new_at)")
    op = extension._STREAM.get("attention") if q.device.type == "cpu" and q.dtype == torch.float32 else None
    if op is not None and k.stride(-1) == 1 and v.stride(-1) == 1:
        return op(q, k, v, *pass_spans(rows, k.shape[2], n_q, new_at, q.device), scale)
    if rows is None:
        kk, vv = _padded(k, v, k.shape[2])
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=_causal(k.shape[2], n_q, kk.shape[2], q.device),
                                              scale=scale, enable_gqa=True)
    out = q.new_zeros(q.shape)
    for r, (s, w) in enumerate(rows):
        if w == 0:
            continue
        cached = slice(s, new_at) if isinstance(s, int) else s
        n = (new_at - s if isinstance(s, int) else len(s)) + w
        kk = k.new_zeros(1, k.shape[1], _aligned(n), k.shape[3])
        vv = v.new_zeros(1, v.shape[1], _aligned(n), v.shape[3])
        kk[:, :, :n - w], vv[:, :, :n - w] = k[r:r + 1, :, cached], v[r:r + 1, :, cached]
        kk[:, :, n - w:n], vv[:, :, n - w:n] = k[r:r + 1, :, new_at:new_at + w], v[r:r + 1, :, new_at:new_at + w]
        out[r:r + 1, :, :w] = F.scaled_dot_product_attention(q[r:r + 1, :, :w], kk, vv, scale=scale, enable_gqa=True,
                                                             attn_mask=_causal(n, w, kk.shape[2], q.device))
    return out
