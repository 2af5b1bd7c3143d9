"""Sibling fusion: linears that read the same input (q/k/v, gate/up) run as one product over their stacked weights
(``_fuse_siblings``: ``FusedLeadLinear`` computes it, each ``FusedFollowerLinear`` hands back its part).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.decoding.compute.formats import dense_values
from engine.decoding.compute.products import OneDNNLinear, _fast, _fast_ok


class FusedLeadLinear(OneDNNLinear):
    """The first of sibling linears that read the same input (q/k/v, gate/up): one oneDNN product over their
    stacked weights, whose parts the siblings (``FusedFollowerLinear``) hand back when called next on the
    same input tensor. One call instead of three (or two): measured on the AMD EPYC, a oneDNN call costs
    ~25 µs before any arithmetic, 7 calls per layer × 30 layers (``benchmarks/bench_compute.py``).

    The siblings' weights become views into the stacked weight (no extra memory; their parameters and state
    dict are unchanged). gpt-fast fuses ``wqkv`` the same way; this keeps transformers' own forward.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if not _fast_ok(x, self.weight):
            return F.linear(x, dense_values(self.weight), self.bias)
        out = _fast(x, self._fused_weight, self._fused_bias)
        parts = out.split(self._fused_sizes, dim=-1)
        for follower, part in zip(self._followers, parts[1:]):
            follower._pending = (x, part)  # one attribute store: a reader sees both or neither
        return parts[0]


class FusedFollowerLinear(OneDNNLinear):
    """A sibling of a ``FusedLeadLinear``: returns its part of the lead's product when called on the very
    input tensor the lead just saw, else computes on its own (any other caller, any other input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        pending = self.__dict__.pop("_pending", None)
        if pending is not None and pending[0] is x:
            return pending[1]
        return super().forward(x)


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Attribute names of linears that read the same input, in the order a Llama-style forward calls them
(transformers' ``LlamaAttention.forward`` and ``LlamaMLP.forward``)."""


def _fuse_siblings(modules, settle=None) -> int:
    """Fuse each group of ``SIBLINGS`` found in ``modules`` (plain or oneDNN linears, same input size, dtype
    and device, all with or all without bias), calling ``settle(lead, former weights)`` after each group is fused
    (``apply_path`` gives it its compact form, lets its fp32 storage go and drops the former weights' pages of a
    checkpoint's mapping, so at most a few stacked copies are in memory beside the model). Returns the number of
    groups fused."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    n = 0
    for root in roots:
        for parent in root.modules():
            for names in SIBLINGS:
                mods = [getattr(parent, a, None) for a in names]
                if not all(type(m) in (nn.Linear, OneDNNLinear) for m in mods):
                    continue
                w0 = mods[0].weight
                if (len({m.in_features for m in mods}) != 1 or any(m.weight.dtype != w0.dtype or
                                                                    m.weight.device != w0.device for m in mods)
                        or len({m.bias is None for m in mods}) != 1):
                    continue
                lead = mods[0]
                originals = []
                if _still_fused(lead, mods):  # fused before and switched back: the same stacked weight again
                    fused, bias, sizes = lead._fused_weight, lead._fused_bias, lead._fused_sizes
                else:
                    fused, bias, sizes, originals = _stack(mods)
                lead.__class__ = FusedLeadLinear
                lead._fused_weight, lead._fused_bias, lead._fused_sizes = fused, bias, sizes
                lead._followers = mods[1:]
                for m in mods[1:]:
                    m.__class__ = FusedFollowerLinear
                if settle is not None:
                    settle(lead, originals)
                n += 1
    return n


def _stack(mods) -> tuple[torch.Tensor, torch.Tensor | None, list[int], list[torch.Tensor]]:
    """Stack sibling linears' weights (and biases) into one tensor; the siblings' parameters become views into it
    (no extra memory; their parameters and state dict are unchanged). Returns (weight, bias, rows per sibling, the
    siblings' former weights)."""
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable in training too
        originals = [m.weight.detach() for m in mods]
        fused = torch.cat(originals)
        bias = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods])
        sizes, start = [], 0
        for m in mods:  # the siblings' weights become views into the stacked weight
            rows = m.weight.shape[0]
            m.weight.data = fused[start:start + rows]
            if bias is not None:
                m.bias.data = bias[start:start + rows]
            sizes.append(rows)
            start += rows
    return fused, bias, sizes, originals


def _still_fused(lead: nn.Module, mods) -> bool:
    """Whether ``mods`` (a lead and its siblings, e.g. after ``apply_path(..., "default")``) are still the views
    ``_stack`` made into the lead's stacked weight: then fusing again reuses it instead of stacking a new copy
    (a new copy is new memory, whose first reads fault its pages in: measured on the AMD EPYC, the first
    1-token pass after a switch took 37 instead of 22 ms)."""
    fused, bias, sizes = (lead.__dict__.get(k) for k in ("_fused_weight", "_fused_bias", "_fused_sizes"))
    if fused is None or sizes is None or len(sizes) != len(mods) or (bias is None) != (mods[0].bias is None):
        return False
    start = 0
    for m, rows in zip(mods, sizes):
        if (rows <= 0 or m.weight.shape != (rows, fused.shape[1]) or m.weight.data_ptr() != fused[start].data_ptr()
                or m.weight.stride() != fused.stride()
                or (bias is not None and (m.bias.shape != (rows,) or m.bias.data_ptr() != bias[start].data_ptr()))):
            return False
        start += rows
    return start == fused.shape[0]
