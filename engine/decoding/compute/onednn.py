"""oneDNN, inside the PyTorch wheel: its private linear and weight-reorder ops, looked up by name (``_ONEDNN_OP``,
``_REORDER_OP``: None where this build lacks them), its fp32 products pinned to full fp32 (``_pin_fp32``), and each
weight packed once into its blocked layout for products of ≥ ``PACK_MIN_ROWS`` rows (``_packed``).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

PACK_MIN_ROWS = 17
"""Products with at least this many rows run oneDNN on a copy of the weight packed once into oneDNN's blocked layout
(``_packed``); smaller ones on the dense weight. 17: above what a lone reader's verify pass feeds (a chain of γ ≤ 15,
a tree of ≤ 16 nodes), so the copies are made by a prefill of 17+ tokens or the room's batched passes."""
PACKED_ATTR = "_onednn_packed"
"""The attribute of a weight tensor holding its packed copy: (data_ptr, version, packed tensor)."""

_PACK_LOCK = threading.Lock()


def _onednn_op() -> Callable | None:
    """``torch.ops.mkldnn._linear_pointwise`` if this PyTorch build has it and oneDNN is usable, else None.

    The op is private (PyTorch's inductor uses it); it is looked up by name so a build that moved or
    dropped it falls back instead of failing.
    """
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        return getattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return None


def _reorder_op() -> Callable | None:
    """``torch.ops.mkldnn._reorder_linear_weight`` if this PyTorch build has it, else None (private, looked up by
    name, as ``_onednn_op``)."""
    try:
        return getattr(torch.ops.mkldnn, "_reorder_linear_weight") if _onednn_op() is not None else None
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_OP = _onednn_op()
_REORDER_OP = _reorder_op()


def _pin_fp32() -> None:
    """Keep oneDNN's fp32 products in full fp32 (no implicit bf16/tf32 down-conversion)."""
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    except (AttributeError, RuntimeError, ValueError):  # older builds: fp32 is the only mode
        pass


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` packed once into oneDNN's blocked layout (``_reorder_linear_weight``), kept on the weight and made
    again when the weight changes (data pointer or version counter); the dense weight itself where it cannot be
    packed (an inference tensor has no version counter; no reorder op in this build).

    Why: oneDNN's product on a dense fp32 weight reorders the whole weight into its blocked layout on every call, so
    a 48-row product reads and writes the weight once more than it multiplies it. On the packed copy the product is
    bit for bit the same (the same kernel on the same layout: ``tests/test_compute.py``) and, measured in the room's
    16-reader passes (48 rows, Intel Xeon, 2 threads), the target forward took 190 instead of 290 ms
    (``benchmarks/bench_room.py``'s engine room). Cost: one packed copy per weight (4 bytes a
    parameter: ``packed_bytes``)."""
    entry = weight.__dict__.get(PACKED_ATTR)
    if weight.is_inference() or _REORDER_OP is None:
        return weight
    if entry is not None and entry[0] == weight.data_ptr() and entry[1] == weight._version:
        return entry[2]
    with _PACK_LOCK:  # its own lock: a big product can run while choice._LOCK is held (choose_path times 24-row passes)
        entry = weight.__dict__.get(PACKED_ATTR)
        if entry is None or entry[0] != weight.data_ptr() or entry[1] != weight._version:
            with torch.inference_mode():
                entry = (weight.data_ptr(), weight._version, _REORDER_OP(weight.detach()))
            weight.__dict__[PACKED_ATTR] = entry
    return entry[2]
