"""Applying a compute path: what a path is and why it was chosen (``ComputePath``), the check before a fast path is
used (``self_check``), switching a model's layers to it (``apply_path``, ``use_path``), which path a module runs
(``path_of``), and what it costs in memory and in bytes read (``compact_bytes``, ``packed_bytes``,
``weight_formats``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.decoding.compute import extension, onednn, products
from engine.decoding.compute.extension import STREAM_MAX_ROWS, stream_kernel
from engine.decoding.compute.dense import embedding_pointers, release_linear, restore_dense
from engine.decoding.compute.formats import INT8_KINDS, COMPACT_ATTR, _compact_fresh, compact_weight, dense_values
from engine.decoding.compute.fusion import FusedFollowerLinear, FusedLeadLinear, _fuse_siblings
from engine.decoding.compute.lean import _lean_layers
from engine.decoding.compute.memory import _own_memory, drop_mapped_pages, trim_memory
from engine.decoding.compute.onednn import PACKED_ATTR, _pin_fp32
from engine.decoding.compute.products import OneDNNLinear, _linears
from engine.errors import InputError

PATHS = ("default", "onednn", "stream")
TOLERANCE = 1e-4
"""Self-check tolerance: max |oneDNN − F.linear| ÷ max(1, max |F.linear|), fp32 (observed ≤ 2e-6 relative)."""


@dataclass
class ComputePath:
    """Which kernels a model's linear layers run, and why.

    Attributes:
        path: "default" (PyTorch's ``F.linear``), "onednn" (``torch.ops.mkldnn._linear_pointwise``) or
            "stream" (the streaming kernel for ≤ ``STREAM_MAX_ROWS`` rows, oneDNN above).
        reason: one sentence: measured (with the times), forced by an override, or a fallback and its cause.
        cpu: the CPU model this was chosen on (``cpu_model()``).
        threads: torch intra-op threads during the choice.
        pass_ms: {path: {tokens in the pass: median ms}} when measured; empty otherwise.
        extra_bytes: memory the path costs beyond the model's weights at load: on "stream", the exact compact copies
            (``compact_bytes``: the embedded model's LM head as int8 blocks, ~31 MB); 0 otherwise. Not counted: the
            packed copies oneDNN's products of ≥ ``PACK_MIN_ROWS`` rows make on first use (``packed_bytes``: the size
            of the weights again, 538 MB for the embedded model).
        stream_rows: on "stream", the most rows a product may have to take the streaming kernel (measured per
            machine: ``measure_stream_rows``); ``STREAM_MAX_ROWS`` when not measured.
        rows_ms: {"stream"/"onednn": {tokens in the pass: best ms}} behind ``stream_rows``; empty when not measured.
        packable_bytes: on "onednn" and "stream", the memory oneDNN's packed copies take once products of every weight
            with ≥ ``PACK_MIN_ROWS`` rows have run (``_packed``; set by ``use_path``); 0 otherwise.
        formats: on "stream", the weight formats a decode step reads (``weight_formats``: matrices per form, bytes
            read, bytes as fp32; set by ``use_path``); empty otherwise.
        released_bytes: fp32 storage not kept because the kernel reads those weights from their exact compact forms
            at every row count (``use_path(release=True)``, ``dense.release_linear``; the embedded target's layers:
            425 MB); 0 otherwise.
    """

    path: str
    reason: str
    cpu: str = ""
    threads: int = 0
    pass_ms: dict = field(default_factory=dict)
    extra_bytes: int = 0
    stream_rows: int = STREAM_MAX_ROWS
    rows_ms: dict = field(default_factory=dict)
    packable_bytes: int = 0
    formats: dict = field(default_factory=dict)
    released_bytes: int = 0

    def formats_label(self) -> str:
        """How the streaming kernel reads the weights of a decode step, e.g. "weights read as GGUF Q4_1 blocks
        (120 matrices) and Q8_0 blocks (1 matrix), exactly: 104 MB a token instead of 538 as fp32" ("" when not
        known: off "stream", or a choice not yet applied)."""
        f = self.formats
        if not f or not f.get("read_bytes"):
            return ""
        names = {"q41": "GGUF Q4_1 blocks", "q8": "Q8_0 blocks", "f16": "fp16", "q41x8": "GGUF Q4_1 blocks",
                 "q8x8": "Q8_0 blocks"}
        count: dict[str, int] = {}
        for k, n in f["count"].items():
            if k in names:
                count[names[k]] = count.get(names[k], 0) + n
        parts = [f"{name} ({n} matri{'ces' if n != 1 else 'x'})" for name, n in count.items()]
        if not parts:
            return f"weights read as fp32: {f['read_bytes'] / 1e6:.0f} MB a token"
        how = ("× int8 activations (the int8 arithmetic, as llama.cpp's: activations rounded to 8 bits per block of "
               "32, so the model's numbers change slightly)" if self.arithmetic == "int8"
               else "rebuilt exactly to fp32 and multiplied in fp32 (the fp32 model's own numbers)")
        return (f"weights read as {' and '.join(parts)} {how}: {f['read_bytes'] / 1e6:.0f} MB a token instead of "
                f"{f['fp32_bytes'] / 1e6:.0f} as fp32")

    @property
    def arithmetic(self) -> str:
        """"int8" when any weight is read in an int8 form (``formats.INT8_KINDS``: activations quantized), else
        "fp32" (every product in fp32, the reference)."""
        return "int8" if any(k in INT8_KINDS for k in (self.formats or {}).get("count", {})) else "fp32"

    @property
    def name(self) -> str:
        """The path's display name."""
        return {"default": "PyTorch default (MKL/cuBLAS)", "onednn": "oneDNN",
                "stream": f"streaming kernel (≤ {self.stream_rows} rows) + oneDNN"}.get(self.path, self.path)

    def label(self) -> str:
        """Short label for pages and result headers, e.g. ``"oneDNN (measured: 1.82× faster than default)"``:
        the name and the reason without its timing details."""
        extra = f"; {self.formats_label()}" if self.formats_label() else ""
        extra += (f"; compact copies of weights (the blocks the kernel reads): +{self.extra_bytes / 1e6:.0f} MB"
                  if self.extra_bytes else "")
        extra += (f"; their fp32 copies not kept (−{self.released_bytes / 1e6:.0f} MB): those products run the "
                  "kernel at every row count, a prefill's too" if self.released_bytes else "")
        if self.packable_bytes:
            extra += (f"; packed copies for products of ≥ {onednn.PACK_MIN_ROWS} rows, made on first use: "
                      f"up to +{self.packable_bytes / 1e6:.0f} MB")
        return f"{self.name} ({self.reason.split(' (')[0]}{extra})"

    def to_dict(self) -> dict:
        return asdict(self)


def self_check(modules, rows: tuple[int, ...] = (1, 3, 16), kernel: str = "onednn") -> str | None:
    """Compare a fast kernel with ``F.linear`` on each distinct fp32 weight shape of ``modules``.

    Args:
        modules: an ``nn.Module`` or a list of them; every ``nn.Linear`` inside is checked (one per shape).
        rows: row counts to try (inputs [1, rows, in], fixed seed).
        kernel: "onednn" or "stream" (the streaming kernel, which must have been built: ``stream_kernel``).

    Returns:
        None when every product agrees within ``TOLERANCE`` (relative to the largest output), else a
        sentence saying what failed (used as the fallback reason).
    """
    if kernel == "stream":
        if extension._STREAM["op"] is None:
            return extension._STREAM["problem"] or "the streaming kernel was not built"
        name = "the streaming kernel"

        def op(x, w, b):
            return extension._STREAM["op"](x.reshape(-1, x.shape[-1]), w.contiguous(), b).view(*x.shape[:-1],
                                                                                                 w.shape[0])
    else:
        if onednn._ONEDNN_OP is None:
            return "oneDNN's linear op is not in this PyTorch build"
        name = "oneDNN"

        def op(x, w, b):
            return onednn._ONEDNN_OP(x, w, b, "none", [], "")
    _pin_fp32()
    gen = torch.Generator().manual_seed(0)
    shapes = {}
    for m in _linears(modules):
        if m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
            shapes.setdefault(tuple(m.weight.shape), m)
    with torch.inference_mode():
        for shape, m in shapes.items():
            for r in rows:
                x = torch.randn(1, r, shape[1], generator=gen)
                w = dense_values(m.weight)  # a released weight's values, rebuilt (dense.release_linear)
                try:
                    got = op(x, w, m.bias)
                except RuntimeError as e:
                    return f"{name} failed on a {shape[0]}×{shape[1]} product: {str(e).splitlines()[0]}"
                ref = F.linear(x, w, m.bias)
                err = float((got - ref).abs().max()) / max(1.0, float(ref.abs().max()))
                if not err <= TOLERANCE:
                    return (f"{name} disagreed with F.linear by {err:.1e} (relative) on a {shape[0]}×{shape[1]} "
                            f"product with {r} rows")
    return None


def apply_path(modules, path: str, release: bool = False) -> int:
    """Route every ``nn.Linear`` inside ``modules`` through ``path`` ("default", "onednn" or "stream"), in
    place, and make ``path`` the process's active path for ``linear`` and every fast layer (one path per
    process: the last one applied; "stream" builds the kernel if needed and takes oneDNN where it cannot).

    With ``release`` on "stream", each weight the kernel reads from an exact compact form lets its fp32 storage go as
    soon as the form is made (``dense.release_linear``: a fused group right after it is stacked, the others before
    the checkpoint's mapping is copied into own memory), so the load's peak memory is one stacked group above the
    checkpoint's, not a second copy of the model. Returns the bytes released (0 without ``release``).

    Raises:
        InputError: for an unknown path.
    """
    if path not in PATHS:
        raise InputError(f"Unknown compute path {path!r}; use one of {', '.join(PATHS)}.")
    if path == "stream":
        stream_kernel()
    restore_dense(modules)  # a path starts from every weight's fp32 values; use_path(release=True) lets them go again
    cls = nn.Linear if path == "default" else OneDNNLinear
    if path != "default":
        _pin_fp32()
    for m in _linears(modules):
        if type(m) in _OURS:  # leave subclasses with their own forward alone
            m.__class__ = cls
            m.__dict__.pop("_pending", None)
    released = 0
    if path != "default":
        settle, former = None, []
        if release and path == "stream":
            embedded = embedding_pointers(modules)

            def settle(m: nn.Module, originals=()) -> None:
                nonlocal released
                _compact(m)
                released += release_linear(m, embedded, former)
                former.extend(originals)
                if len(former) >= SETTLE_BATCH:
                    _let_go(former)
        _fuse_siblings(modules, settle=settle)
        if settle is not None:
            for m in _linears(modules):
                if type(m) not in (FusedLeadLinear, FusedFollowerLinear):
                    settle(m)
            _let_go(former)
        _own_memory(modules)
    _lean_layers(modules, on=path != "default")
    products._ACTIVE["path"] = path
    if path == "stream":
        for m in _linears(modules):
            _compact(m)
    if released:
        trim_memory()
    return released


SETTLE_BATCH = 8
"""Former weights let go together while a path is applied with ``release``: a checkpoint's mapping is read once per
batch (``memory.drop_mapped_pages``), not per weight (120 reads of ``/proc/self/maps`` took 0.3 s of a load)."""


def _let_go(former: list) -> None:
    """Drop the pages of a checkpoint's mapping that ``former`` (weights nothing reads any more) occupy, empty it and
    hand the C heap's free pages back (the stacked copies just released)."""
    drop_mapped_pages(former)
    former.clear()
    trim_memory()


def _compact(m: nn.Module) -> None:
    """Give a linear layer's weight (a fused lead's stacked weight) its exact compact form unless it has a fresh
    one (a follower's rows are its lead's)."""
    if type(m) is FusedFollowerLinear:
        return
    w = m.__dict__.get("_fused_weight") if type(m) is FusedLeadLinear else m.weight
    if w is not None and not _compact_fresh(w):
        compact_weight(w)


_OURS = (nn.Linear, OneDNNLinear, FusedLeadLinear, FusedFollowerLinear)


def path_of(module: nn.Module) -> str:
    """The path ``module``'s linear layers run: "default" unless some were switched to the fast layers, then the
    process's active fast path ("stream" or "onednn")."""
    if not any(isinstance(m, OneDNNLinear) for m in _linears(module)):
        return "default"
    return "stream" if products._ACTIVE["path"] == "stream" else "onednn"


def active_stream_rows() -> int | None:
    """The streaming kernel's row limit this process's passes run with: the last ``use_path`` choice's measured
    limit while the active path is "stream", else None (no "stream" choice applied in this process, or another
    path active). A pass-cost curve measured under another limit is not this process's curve
    (``engine.decoding.pass_cost.cached_pass_cost``)."""
    return extension._STREAM.get("applied_rows") if products._ACTIVE["path"] == "stream" else None


def use_path(modules, choice: ComputePath, release: bool = False) -> ComputePath:
    """Apply ``choice`` to ``modules`` (a model, a draft head, Medusa heads) and return it; on "stream" its
    measured row limit becomes the process's (one limit per process, as one path: the last one applied). With
    ``release`` (a loaded model that will not be trained), on "stream" the fp32 storage of every weight the kernel
    reads from an exact compact form is let go (``dense.release_linear``; ``ComputePath.released_bytes``)."""
    released = apply_path(modules, choice.path, release=release)
    if released != choice.released_bytes:
        choice = replace(choice, released_bytes=released)
    if choice.path == "stream":
        extension._STREAM["max_rows"] = extension._STREAM["applied_rows"] = int(choice.stream_rows)
        extra = compact_bytes(modules)
        if extra != choice.extra_bytes:
            choice = replace(choice, extra_bytes=extra)
        formats = weight_formats(modules)
        if formats != choice.formats:
            choice = replace(choice, formats=formats)
    packable = _packable_bytes(modules) if choice.path != "default" and onednn._REORDER_OP is not None else 0
    if packable != choice.packable_bytes:
        choice = replace(choice, packable_bytes=packable)
    return choice


def compact_bytes(modules) -> int:
    """Bytes of the compact forms (``compact_weight``) held by the linear layers inside ``modules`` (and their
    fused weights)."""
    return sum(c.nbytes for c in _held(modules, COMPACT_ATTR, lambda c: c))


def packed_bytes(modules) -> int:
    """Bytes of the packed copies (``_packed``) the linear layers inside ``modules`` hold now (made on first use)."""
    return sum(entry[2].numel() * 4 for entry in _held(modules, PACKED_ATTR, lambda entry: entry[2]))


def _held(modules, attr: str, key):
    """Each distinct object (by ``id(key(obj))``) kept under ``attr`` on the weights of the linear layers inside
    ``modules``, their fused weights included (the compact forms, the packed copies)."""
    seen = set()
    for m in _linears(modules):
        for w in (m.weight, m.__dict__.get("_fused_weight")):
            obj = None if w is None else w.__dict__.get(attr)
            if obj is not None and id(key(obj)) not in seen:
                seen.add(id(key(obj)))
                yield obj


def weight_formats(modules) -> dict:
    """What a decode step on the streaming kernel reads for the linear layers inside ``modules``: {"count": {form:
    matrices}, "read_bytes": bytes read (each compact form's bytes, else 4 a parameter), "fp32_bytes": the same
    matrices as fp32}; a fused group's stacked weight counts once (its members' rows)."""
    count: dict[str, int] = {}
    read = fp32 = 0
    for m in _linears(modules):
        if type(m) is FusedFollowerLinear:
            continue
        w = m.__dict__.get("_fused_weight") if type(m) is FusedLeadLinear else m.weight
        if w is None:
            continue
        c = w.__dict__.get(COMPACT_ATTR) if _compact_fresh(w) else None
        kind = c.kind if c is not None else "fp32"
        count[kind] = count.get(kind, 0) + 1
        fp32 += w.numel() * 4
        read += c.nbytes if c is not None else w.numel() * 4
    return {"count": count, "read_bytes": read, "fp32_bytes": fp32}


def _packable_bytes(modules) -> int:
    """Bytes of the packed copies ``_packed`` would make for every fast linear layer inside ``modules`` (4 a
    parameter: fp32, oneDNN's blocked layout; a fused group's stacked weight once)."""
    seen, total = set(), 0
    for m in _linears(modules):
        if type(m) is FusedFollowerLinear or type(m) not in (OneDNNLinear, FusedLeadLinear):
            continue
        w = m.__dict__.get("_fused_weight") if type(m) is FusedLeadLinear else m.weight
        if (w is not None and w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous()
                and w.data_ptr() not in seen):
            seen.add(w.data_ptr())
            total += w.numel() * 4
    return total
