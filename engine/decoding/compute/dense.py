"""Released dense weights: a weight the streaming kernel reads from its exact compact form (``formats.compact_weight``)
needs no fp32 copy in memory. ``release_linear`` lets a layer's fp32 storage go (``apply_path(release=True)`` calls it as each compact form is made); ``restore_dense``
brings it back (``apply_path`` does, before any path is applied).

A released weight keeps its parameter, shape and dtype; its storage is one NaN seen through zero strides (so a read
that bypasses the kernel gives NaN, never plausible numbers). Its values are rebuilt exactly from the compact form
wherever something asks for them: ``dense_values`` (the products' ``F.linear`` fallbacks), the module's state dict
(a draft head initialised from the target's last layers reads it). Every product on the "stream" path reads the
compact form at any row count (``products._stream``): a prefill too, which otherwise ran oneDNN on a packed fp32 copy.

Why: the embedded model's layers are GGUF Q4_1 blocks and its embedding Q8_0. With both the fp32 weights and oneDNN's
packed copies for prefills resident, a room of 16 readers peaked at 1.83 GB (``benchmarks/bench_room.py``, AMD EPYC)
although a decode step reads 111 MB. Cost: a prefill's products run the streaming kernel, which on many rows does
more arithmetic per weight than oneDNN's blocked kernels (``benchmarks/bench_dense.py`` measures both).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.decoding.compute.formats import (COMPACT_ATTR, DENSE_FROM_ATTR, _compact_fresh, _same_bits, dense_values,
                                             is_released, rebuild)
from engine.decoding.compute.fusion import FusedFollowerLinear, FusedLeadLinear
from engine.decoding.compute.memory import drop_mapped_pages
from engine.decoding.compute.onednn import PACKED_ATTR
from engine.decoding.compute.products import _linears

_HOOK_ATTR = "_dense_state_hook"
CHECK_ROWS = 256
"""Rows of a weight rebuilt and compared at a time when it is released (0.3 MB for the embedded model's layers)."""


def _placeholder(shape) -> torch.Tensor:
    return torch.full((1, 1), float("nan")).expand(*shape)


def _state_hook(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict and is_released(module.weight):
        state_dict[key] = dense_values(module.weight)


def _mark(module: nn.Linear, holder: torch.Tensor, start: int, rows: int) -> None:
    w = module.weight
    w.__dict__[DENSE_FROM_ATTR] = (holder, start, rows, w.requires_grad)
    if _HOOK_ATTR not in module.__dict__:
        module.__dict__[_HOOK_ATTR] = module.register_state_dict_post_hook(_state_hook)


def embedding_pointers(modules) -> set[int]:
    """Data pointers of every embedding's weight inside ``modules`` (a tied LM head shares one: ``release_linear``
    keeps those)."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    return {m.weight.data_ptr() for root in roots for m in root.modules() if isinstance(m, nn.Embedding)}


def release_linear(m: nn.Linear, embedded: set[int], former: list | None = None) -> int:
    """Release the fp32 storage of one linear layer's weight (a fused group's stacked weight and its members' views,
    when ``m`` leads one) if the streaming kernel reads it from a fresh exact compact form, it is not shared with an
    embedding (``embedded``: its lookup reads fp32 rows) and the values rebuilt from the form (``formats.rebuild``) are
    bit for bit the weight's. Its parameters stop requiring gradients (a released weight cannot be trained;
    ``restore_dense`` gives it back). The former storage's pages of a checkpoint's mapping go now
    (``memory.drop_mapped_pages``), or with ``former`` the tensor is appended there for the caller to drop (alive
    until then). Returns the bytes released (0: kept)."""
    if type(m) is FusedFollowerLinear or is_released(m.weight):
        return 0
    fused = type(m) is FusedLeadLinear and m.__dict__.get("_fused_weight") is not None
    w = m._fused_weight if fused else m.weight
    members = list(zip([m, *m._followers], m._fused_sizes)) if fused else [(m, w.shape[0])]
    if (not _compact_fresh(w) or not w.is_contiguous() or w.dim() != 2
            or any(mm.weight.data_ptr() in embedded for mm, _ in members) or w.data_ptr() in embedded):
        return 0
    form = w.__dict__[COMPACT_ATTR]
    with torch.no_grad(), torch.inference_mode(False):
        # every value again, as the products would see it, in pieces that reuse the heap's memory
        if not all(_same_bits(rebuild(form, slice(i, i + CHECK_ROWS)), w[i:i + CHECK_ROWS])
                   for i in range(0, w.shape[0], CHECK_ROWS)):
            return 0
        freed = w.numel() * w.element_size()
        w.__dict__.pop(PACKED_ATTR, None)
        old = w.data
        w.data = _placeholder(w.shape)
        if not fused:  # a weight perhaps still in a checkpoint's mapping (a stacked one is own memory): its pages go
            if former is None:
                drop_mapped_pages([old])
            else:
                former.append(old)
        del old
        w.__dict__[COMPACT_ATTR] = replace(form, ptr=w.data_ptr(), version=w._version)
        if fused:  # the stacked weight itself, read by its lead's products, rebuilds from its own form too
            w.__dict__[DENSE_FROM_ATTR] = (w, 0, w.shape[0], False)
        start = 0
        for mm, rows in members:
            if fused:
                mm.weight.__dict__.pop(PACKED_ATTR, None)
                mm.weight.data = w[start:start + rows]
            _mark(mm, w, start, rows)
            mm.weight.requires_grad_(False)
            start += rows
    return freed


def restore_dense(modules) -> int:
    """Give every released weight inside ``modules`` its fp32 storage back (rebuilt exactly from its compact form,
    which stays fresh); a fused group's members become views into its stacked weight again. Returns the bytes
    restored."""
    restored = 0
    with torch.no_grad(), torch.inference_mode(False):
        for m in _linears(modules):
            if type(m) is FusedFollowerLinear or not is_released(m.weight):
                continue
            holder = m.weight.__dict__[DENSE_FROM_ATTR][0]
            fused = type(m) is FusedLeadLinear and m.__dict__.get("_fused_weight") is holder
            members = list(zip([m, *m._followers], m._fused_sizes)) if fused else [(m, holder.shape[0])]
            form = holder.__dict__[COMPACT_ATTR]
            holder.data = rebuild(form)
            if fused:
                holder.__dict__.pop(DENSE_FROM_ATTR, None)
            holder.__dict__[COMPACT_ATTR] = replace(form, ptr=holder.data_ptr(), version=holder._version)
            restored += holder.numel() * holder.element_size()
            start = 0
            for mm, rows in members:
                if fused:
                    mm.weight.data = holder[start:start + rows]
                grad = mm.weight.__dict__.pop(DENSE_FROM_ATTR)[3]
                mm.weight.requires_grad_(grad)
                start += rows
    return restored


def released_bytes(modules) -> int:
    """Bytes of fp32 storage released (``release_linear``) and not restored among the linear weights inside
    ``modules`` (a fused group's stacked weight once)."""
    seen, total = set(), 0
    for m in _linears(modules):
        w = m.weight
        if is_released(w):
            holder = w.__dict__[DENSE_FROM_ATTR][0]
            if id(holder) not in seen:
                seen.add(id(holder))
                total += holder.numel() * 4
    return total
