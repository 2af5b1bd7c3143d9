"""The product every fast linear layer runs: ``linear`` for a bare weight and ``OneDNNLinear`` for a layer, on the
process's active path (``_ACTIVE``, set by ``apply_path``): on "stream" the streaming kernel for few rows (reading a
weight's exact compact form where it has one), else oneDNN (on a packed weight for big products); ``F.linear`` where
autograd needs a gradient, for non-fp32 tensors and off the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.decoding.compute import extension, invariant, onednn
from engine.decoding.compute.extension import STREAM_MAX_ROWS
from engine.decoding.compute.formats import COMPACT_ATTR, compact_weight, dense_values
from engine.decoding.compute.onednn import _packed

_ACTIVE = {"path": "default"}
"""The process's active path for ``linear`` and every fast layer: the last one ``apply_path`` applied."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the process's active path (set by the last ``use_path``).

    Args:
        x: [..., in] activations. weight: [out, in]. bias: [out] or None.

    Returns:
        [..., out]. Falls back to ``F.linear`` off the CPU, for non-fp32 tensors, and whenever autograd
        needs a gradient (training).
    """
    if _ACTIVE["path"] != "default" and _fast_ok(x, weight):
        return _fast(x, weight, bias)
    return F.linear(x, dense_values(weight), bias)


def prepare_weight(weight: torch.Tensor) -> None:
    """Give a bare weight tensor used with ``linear`` (a draft head's LM-head rows) its compact form when the
    active path is "stream" (``compact_weight``); nothing otherwise."""
    if _ACTIVE["path"] == "stream":
        compact_weight(weight)


def _fast_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return ((onednn._ONEDNN_OP is not None or extension._STREAM["op"] is not None) and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The active fast path's product (call only when ``_fast_ok``)."""
    if _ACTIVE["path"] == "stream":
        y = _stream(x, weight, bias)
        if y is not None:
            return y
    if weight.stride() == (0, 0) and weight.numel() > 1:  # released (``dense.release_linear``): its values rebuilt
        return F.linear(x, dense_values(weight), bias)
    if onednn._ONEDNN_OP is not None and x.dim() >= 2:
        if x.numel() >= onednn.PACK_MIN_ROWS * x.shape[-1]:
            weight = _packed(weight)
        return onednn._ONEDNN_OP(x, weight, bias, "none", [], "")
    return F.linear(x, dense_values(weight), bias)


def _stream(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The streaming kernel's product for at most the active row limit (``use_path``: the machine's measured
    ``ComputePath.stream_rows``, else ``STREAM_MAX_ROWS``), else None (the caller takes oneDNN). A weight with an
    exact compact form (``compact_weight``) is read from that form: the same output bits, fewer bytes."""
    op = extension._STREAM["op"]
    k = x.shape[-1]
    if op is None or k == 0:
        return None
    rows = x.numel() // k
    c = weight.__dict__.get(COMPACT_ATTR)
    if c is not None and c.ptr == weight.data_ptr() and c.version == weight._version:  # _compact_fresh, inlined
        # a released weight (``dense.release_linear``) has nothing else to read: its compact form serves any rows
        if (rows <= extension._STREAM.get("max_rows", STREAM_MAX_ROWS) or weight.stride() == (0, 0)
                or getattr(invariant._INVARIANT, "on", False)):
            return c.op(x.reshape(rows, k), *c.tensors, bias).view(*x.shape[:-1], weight.shape[0])
        return None
    if not weight.is_contiguous() or (rows > extension._STREAM.get("max_rows", STREAM_MAX_ROWS)
                                      and not getattr(invariant._INVARIANT, "on", False)):
        return None
    return op(x.reshape(rows, k), weight, bias).view(*x.shape[:-1], weight.shape[0])


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward runs the fast path (oneDNN; on the "stream" path the streaming
    kernel for few rows) with the same parameters and state dict.

    ``use_path`` switches a module's class to this one and back; training (autograd on) and non-CPU or
    non-fp32 inputs take ``F.linear``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102 - nn.Linear's
        if _fast_ok(x, self.weight):
            return _fast(x, self.weight, self.bias)
        return F.linear(x, dense_values(self.weight), self.bias)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What a fast linear layer's forward computes for this weight (``OneDNNLinear.forward``)."""
    if _fast_ok(x, weight):
        return _fast(x, weight, bias)
    return F.linear(x, dense_values(weight), bias)


def _linears(modules) -> list[nn.Linear]:
    """Every ``nn.Linear`` inside ``modules`` (an ``nn.Module`` or a list of them), each once, in module order."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    out, seen = [], set()
    for root in roots:
        for m in root.modules():
            if isinstance(m, nn.Linear) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out
