"""The compute path: which matrix-product kernels a model's linear layers run on this machine.

Why this module exists. Decoding a 135M-parameter model on a CPU is a chain of matrix products with a few
rows (1 token, or the γ + 1 tokens of a verify pass) against large weights: the pass should cost what
reading the weights costs, and a pass over 3 tokens about what a pass over 1 costs (the lesson of the
explainer: verifying is memory-bound). PyTorch's default CPU ``nn.Linear`` calls MKL's sgemm, which on AMD
CPUs takes a slow path for products with few rows: measured on an AMD EPYC, the 49152 × 576 LM head took
11.4 ms for 1 row and 40.7 ms for 3 (``benchmarks/bench_compute.py``). oneDNN, also inside the PyTorch
wheel, picks its kernels by CPU features; ``torch.ops.mkldnn._linear_pointwise`` runs the same product in
6.6 and 7.3 ms there.

Paths:

- ``"default"``: PyTorch's own ``torch.nn.functional.linear`` (MKL sgemm on x86 CPUs, cuBLAS on CUDA).
- ``"onednn"``: ``torch.ops.mkldnn._linear_pointwise(x, W, b, "none", [], "")`` on the layer's own dense
  weight for products of fewer than ``PACK_MIN_ROWS`` (17) rows (measured on the AMD EPYC, a weight packed with
  ``_reorder_linear_weight`` was no faster for 1–3 rows), and on a copy packed once into oneDNN's layout for larger
  ones (a prefill, the room's batched passes: ``_packed``; the same bits, and on an Intel Xeon (Sapphire Rapids) the
  room's 48-row target forward in 190 instead of 290 ms; the copies cost 4 bytes a parameter, made on first use:
  ``packed_bytes``). fp32 math is pinned: ``torch.backends.mkldnn.matmul.fp32_precision`` is set to ``"ieee"``
  (never bf16/tf32 rounding).
- ``"stream"``: products of at most this machine's row limit (``ComputePath.stream_rows``, measured by
  ``measure_stream_rows``; ``STREAM_MAX_ROWS`` = 16 when not measured) rows (a decode step, a verify pass, a draft
  step) run this project's weight-streaming kernel (``small_linear.cpp``, next to this file), larger ones oneDNN. Why:
  on the AMD EPYC oneDNN's few-row kernels read the weights at about half of what a plain sum reads; the
  kernel reads each weight row once per call whatever the row count, 16 floats at a time against every
  input row, with a summation order that does not depend on the row count (a row's output is the same
  whichever rows share the call). It is compiled once per machine with the C++ compiler PyTorch's
  ``torch.utils.cpp_extension`` finds (``-O3 -march=native``, ~40 s, kept in PyTorch's extension cache under
  a name that carries the CPU's feature flags, the torch version and the source's hash); where no compiler
  or headers are present the path is simply not offered, and the reason is kept (``stream_problem``).

Exact compact weights (the "stream" path): a weight whose fp32 values are all fp16 numbers (a draft head, Medusa heads
or the block drafter saved in fp16) or, per block of 32 values, an int8 vector times one scale (the embedded GGUF's
Q8_0 token embedding, which is also the tied LM head) gets a compact copy the kernel reads instead: half, or about
a quarter, of the bytes, and the same fp32 values in the same order, so bit for bit the same outputs
(``compact_weight``; checked value by value when made, and dropped when the weight changes). The fp32 weights stay.
The embedded target's other layers are Q4_1 in the GGUF; they stay fp32.

On both fast paths the siblings q/k/v and gate/up run as one product each (``_fuse_siblings``), every weight still
read from a memory-mapped checkpoint is copied into the process's own memory so the mapping can go (``_own_memory``),
and transformers' Llama decoder layers run one lean forward (``_lean_forward``: the same operations, bit-identical logits, without
the per-submodule Python of transformers' layers).

The choice: ``choose_path`` runs the model's own forward (a 1-token and a 4-token pass after a short
cached context, each path five times, alternating, best of five) and keeps the fastest path; when that is "stream",
it also times 8-, 12-, 16- and 24-token passes on the kernel and on oneDNN to find the row count where oneDNN's
blocked kernels take over (an Intel Xeon: 12; an AMD EPYC: 16). The result is remembered
per machine (CPU model, torch version, threads, model shape, the paths on offer) in the user cache, so the
measurement costs ~1 s once. Before a path is used, ``self_check`` compares it with ``F.linear`` on every distinct weight
shape for 1, 3 and 16 rows; a disagreement beyond fp32 tolerance, or oneDNN's ops missing from this
PyTorch build (they are private and may move), falls back to ``"default"`` and says why.

Override: the environment variable ``SPEEDUP_LAB_COMPUTE`` (``auto``, ``default``, ``onednn`` or ``stream``) or the
CLI's ``--compute``. Nothing outside this module knows about oneDNN: the rest of the engine loads models
through ``engine.decoding.models.load_model`` (which calls ``use_path``) and calls ``linear`` for a bare
weight tensor (a draft head's LM-head rows).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import InputError

ENV_VAR = "SPEEDUP_LAB_COMPUTE"
PATHS = ("default", "onednn", "stream")
STREAM_MAX_ROWS = 16
"""Products of at most this many rows take the streaming kernel on the "stream" path, larger ones oneDNN, unless
``choose_path`` measured this machine's own limit (``ComputePath.stream_rows``; ``measure_stream_rows``)."""
STREAM_ROW_CANDIDATES = (8, 12, 16, 24)
"""Row counts ``measure_stream_rows`` times: the limit is the largest of them up to which the streaming kernel's
passes are not slower than oneDNN's (4 when even 8 rows are: the 4-token pass of the path choice already
showed the kernel ahead there)."""
KERNEL_SOURCE = Path(__file__).with_name("small_linear.cpp")
ATTENTION_SOURCE = Path(__file__).with_name("invariant_attention.cpp")
KERNEL_SOURCES = (KERNEL_SOURCE, ATTENTION_SOURCE)
"""The streaming kernel's extension: the products (``small_linear.cpp``) and the batch-invariant decode attention
(``invariant_attention.cpp``), built together once per machine."""
CHOICES = ("auto",) + PATHS
TOLERANCE = 1e-4
"""Self-check tolerance: max |oneDNN − F.linear| ÷ max(1, max |F.linear|), fp32 (observed ≤ 2e-6 relative)."""

_LOCK = threading.Lock()
_KERNEL_LOCK = threading.Lock()
_PACK_LOCK = threading.Lock()
_MEMO: dict[str, "ComputePath"] = {}
_ACTIVE = {"path": "default"}


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

    def formats_label(self) -> str:
        """How the streaming kernel reads the weights of a decode step, e.g. "weights read as GGUF Q4_1 blocks
        (120 matrices) and Q8_0 blocks (1 matrix), exactly: 104 MB a token instead of 538 as fp32" ("" when not
        known: off "stream", or a choice not yet applied)."""
        f = self.formats
        if not f or not f.get("read_bytes"):
            return ""
        names = {"q41": "GGUF Q4_1 blocks", "q8": "Q8_0 blocks", "f16": "fp16"}
        parts = [f"{names[k]} ({f['count'][k]} matri{'ces' if f['count'][k] != 1 else 'x'})"
                 for k in ("q41", "q8", "f16") if f["count"].get(k)]
        if not parts:
            return f"weights read as fp32: {f['read_bytes'] / 1e6:.0f} MB a token"
        return (f"weights read as {' and '.join(parts)}, exactly: {f['read_bytes'] / 1e6:.0f} MB a token instead of "
                f"{f['fp32_bytes'] / 1e6:.0f} as fp32")

    @property
    def name(self) -> str:
        """The path's display name."""
        return {"default": "PyTorch default (MKL/cuBLAS)", "onednn": "oneDNN",
                "stream": f"streaming kernel (≤ {self.stream_rows} rows) + oneDNN"}.get(self.path, self.path)

    def label(self) -> str:
        """Short label for pages and result headers, e.g. ``"oneDNN (measured: 1.82× faster than default)"``:
        the name and the reason without its timing details."""
        extra = f"; {self.formats_label()}" if self.formats_label() else ""
        extra += f"; exact compact copies of weights: +{self.extra_bytes / 1e6:.0f} MB" if self.extra_bytes else ""
        if self.packable_bytes:
            extra += (f"; packed copies for products of ≥ {PACK_MIN_ROWS} rows, made on first use: up to "
                      f"+{self.packable_bytes / 1e6:.0f} MB")
        return f"{self.name} ({self.reason.split(' (')[0]}{extra})"

    def to_dict(self) -> dict:
        return asdict(self)


def _cpuinfo(field_name: str) -> str | None:
    """The first ``/proc/cpuinfo`` line's value for ``field_name`` ("model name", "flags"), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(field_name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s "model name", else ``platform.processor()``)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown CPU"


def parse_override(value: str | None) -> str:
    """Validate a compute-path override ("auto", "default", "onednn" or "stream"; case-insensitive; empty = "auto").

    Raises:
        InputError: for any other value, naming the allowed ones.
    """
    v = (value or "auto").strip().lower()
    if v not in CHOICES:
        raise InputError(f"Unknown compute path {value!r} (from --compute or ${ENV_VAR}); use one of "
                         f"{', '.join(CHOICES)}.")
    return v


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


def _pin_fp32() -> None:
    """Keep oneDNN's fp32 products in full fp32 (no implicit bf16/tf32 down-conversion)."""
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    except (AttributeError, RuntimeError, ValueError):  # older builds: fp32 is the only mode
        pass


def _cpu_flags() -> str:
    return _cpuinfo("flags") or platform.machine()


_STREAM: dict = {"tried": False, "op": None, "problem": None, "name": "", "max_rows": STREAM_MAX_ROWS}
STREAM_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]


@functools.lru_cache(maxsize=1)
def kernel_name() -> str:
    """The streaming kernel's build name on this machine: ``speedup_lab_small_linear_<hash>`` of its source, its
    compiler flags, this CPU's flags and the torch version (cheap: nothing is built). Measurements that depend
    on the kernel (the path choice, ``engine.decoding.pass_cost``) are keyed by it, so a changed kernel is
    measured again."""
    import hashlib

    src = "".join(f.read_text() if f.exists() else "" for f in KERNEL_SOURCES)
    key = hashlib.sha1("|".join([src, " ".join(STREAM_CFLAGS), _cpu_flags(), torch.__version__])
                       .encode()).hexdigest()[:12]
    return f"speedup_lab_small_linear_{key}"


def measure_key() -> str:
    """What measurements of this machine's passes depend on, beside the CPU: the streaming kernel's build
    (``kernel_name``) and the row count from which oneDNN products read packed weights (``PACK_MIN_ROWS``). The path
    choice, the verify-cost curve (``engine.decoding.pass_cost``) and the batch curve are keyed by it, so they are
    measured again when either changes."""
    return f"{kernel_name()}|packed>={PACK_MIN_ROWS}|weights={weight_format()}"


WEIGHT_FORMAT_ENV = "SPEEDUP_LAB_WEIGHTS"
WEIGHT_FORMATS = ("blocks", "fp32")


def weight_format() -> str:
    """How the streaming kernel reads weights, from ``SPEEDUP_LAB_WEIGHTS``: "blocks" (default: each weight's exact
    compact form where it has one, ``compact_weight``: the embedded model's GGUF Q4_1 and Q8_0 blocks) or "fp32"
    (every weight as fp32, 4 bytes a value: the same results, more bytes; for measuring what bytes cost).

    Raises:
        InputError: for another value."""
    value = (os.environ.get(WEIGHT_FORMAT_ENV) or "blocks").strip().lower()
    if value not in WEIGHT_FORMATS:
        raise InputError(f"{WEIGHT_FORMAT_ENV} must be one of {', '.join(WEIGHT_FORMATS)}, got {value!r}.")
    return value


def stream_kernel(progress: Callable[[str], None] | None = None) -> Callable | None:
    """The streaming kernel's op (``small_linear(x [M, K], w [N, K], b [N] | None) → [M, N]``), built on first
    use (~40 s; ``progress`` is told before a build), or None where it cannot be built (``stream_problem``
    says why). Built once per machine: the library is kept in ``<PyTorch's extension root>/<name>/``
    (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; the name carries the CPU's flags, the
    torch version and the source's hash) and later processes import it directly. A build lock left by a killed
    build is removed after ``STALE_LOCK_S``."""
    with _KERNEL_LOCK:
        if _STREAM["tried"]:
            return _STREAM["op"]
        _STREAM["tried"] = True
        if platform.system() != "Linux":
            _STREAM["problem"] = "the streaming kernel is built on Linux only"
            return None
        name = kernel_name()
        _STREAM["name"] = name
        try:
            from torch.utils import cpp_extension

            folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
            lib = folder / f"{name}.so"
            mod = None
            if lib.exists():  # built before: import it directly (no ninja run, no build lock to wait on)
                try:
                    mod = _import_library(name, lib)
                except Exception:  # noqa: BLE001 - a half-written library: build it again
                    for f in folder.glob("*.o"):
                        f.unlink(missing_ok=True)
                    lib.unlink(missing_ok=True)
            if mod is None:
                folder.mkdir(parents=True, exist_ok=True)
                lock = folder / "lock"  # PyTorch's build lock; a build killed midway leaves it behind forever
                if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                    lock.unlink(missing_ok=True)
                if progress is not None:
                    progress("Building this CPU's streaming kernel (once per machine, about 40 s)…")
                mod = cpp_extension.load(name=name, sources=[str(f) for f in KERNEL_SOURCES], extra_cflags=STREAM_CFLAGS,
                                         extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
            _STREAM["op"] = mod.small_linear
            _STREAM["attention"] = getattr(mod, "invariant_attention", None)
            if getattr(mod, "compact_supported", lambda: False)():
                _STREAM["compact"] = {"f16": mod.small_linear_f16, "q8": mod.small_linear_q8}
                if hasattr(mod, "small_linear_q41"):
                    _STREAM["compact"]["q41"] = mod.small_linear_q41
                    _STREAM["q41_pack"] = mod.q41_pack
        except Exception as e:  # noqa: BLE001 - no compiler, no headers, a failed build: the path is not offered
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            _STREAM["problem"] = f"the streaming kernel could not be built here ({first[:200]})"
        return _STREAM["op"]


STALE_LOCK_S = 600
"""A build lock older than this (s) is left over from a killed build (a build takes about a minute) and removed."""


def _import_library(name: str, path: Path):
    """Import a compiled extension module from its file (what ``cpp_extension.load`` does once built)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stream_problem() -> str | None:
    """Why the streaming kernel is not available (None when it is, or was not tried yet)."""
    return _STREAM["problem"]


def _stream(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The streaming kernel's product for at most the active row limit (``use_path``: the machine's measured
    ``ComputePath.stream_rows``, else ``STREAM_MAX_ROWS``), else None (the caller takes oneDNN). A weight with an
    exact compact form (``compact_weight``) is read from that form: the same output bits, fewer bytes."""
    op = _STREAM["op"]
    k = x.shape[-1]
    if op is None or k == 0 or not weight.is_contiguous():
        return None
    rows = x.numel() // k
    if rows > _STREAM.get("max_rows", STREAM_MAX_ROWS) and not getattr(_INVARIANT, "on", False):
        return None
    c = weight.__dict__.get(COMPACT_ATTR)
    if c is not None and c.ptr == weight.data_ptr() and c.version == weight._version:  # _compact_fresh, inlined
        return c.op(x.reshape(rows, k), *c.tensors, bias).view(*x.shape[:-1], weight.shape[0])
    return op(x.reshape(rows, k), weight, bias).view(*x.shape[:-1], weight.shape[0])


COMPACT_ATTR = "_stream_compact"
"""The attribute of a weight tensor holding its exact compact form (``CompactWeight``)."""
Q8_BLOCK = 32
"""Values per scale in the "q8" compact form (the GGUF format Q8_0's block)."""


@dataclass(frozen=True)
class CompactWeight:
    """A weight's exact compact storage for the streaming kernel (``compact_weight``).

    Attributes:
        kind: "f16" (the weight's values as fp16), "q8" (int8 values and one fp32 scale per ``Q8_BLOCK``) or
            "q41" (4-bit codes, one fp32 scale and one fp32 minimum per ``Q41_BLOCK``: GGUF's Q4_1).
        tensors: ("f16": [N, K] fp16), ("q8": [N, K] int8, [N, K / 32] fp32 scales) or ("q41": [N, K / 2] uint8
            codes, [N, K / 32] fp32 scales, [N, K / 32] fp32 minimums).
        op: the kernel entry reading this form.
        ptr, version: the fp32 weight's ``data_ptr`` and version counter when the form was made; a weight changed
            since (an in-place update, new data) no longer matches and is read as fp32 again.
    """

    kind: str
    tensors: tuple
    op: Callable
    ptr: int
    version: int

    @property
    def nbytes(self) -> int:
        """Bytes of the compact form (memory it adds beside the fp32 weight)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def compact_weight(weight: torch.Tensor) -> str | None:
    """Give ``weight`` ([N, K] fp32, contiguous, on the CPU) an exact compact form the streaming kernel reads
    instead of its fp32 values, when one exists: "f16" when every value is an fp16 number (a draft head saved in
    fp16 and cast to fp32 at load: half the bytes), else "q8" when every block of 32 values along K is an int8
    vector times one scale (d = the block's largest magnitude ÷ 127; the GGUF format Q8_0, as the embedded model's
    token embedding, which is also its LM head: 1.125 bytes a value instead of 4), else "q41" when every block of 32
    is d · q + m with 4-bit codes (the GGUF format Q4_1, as the embedded model's layers: 0.75 bytes a value;
    ``_exact_q41``). The form is checked value by
    value (each value, its sign bit included, must come back exactly), so the kernel's products are bit for bit
    those on the fp32 weight: the compact form changes the bytes read, never a result. Why: decoding is memory-
    bound, and on an Intel Xeon (Sapphire Rapids) a draft-head call read its 31 MB of fp32 layers at ~10 GB/s.

    The fp32 weight is kept (training, the other paths, the state dict); the compact form costs its bytes
    beside it (``CompactWeight.nbytes``). Inference tensors (made under ``torch.inference_mode``) have no version
    counter, so they are left as they are.

    Returns:
        "f16", "q8", "q41", or None (no exact compact form, ``weight_format()`` "fp32", not fp32/2-D/contiguous/CPU, an inference tensor, an input
        size K that is not a multiple of 16 (the kernel reads compact forms in whole vectors: small_linear.cpp), or
        a kernel build without compact entries: ``_STREAM["compact"]``).
    """
    ops = _STREAM.get("compact")
    if (ops is None or weight_format() == "fp32" or weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or not weight.is_contiguous() or weight.is_inference() or weight.numel() == 0 or weight.shape[1] % 16):
        return None
    with torch.no_grad():
        w = weight.detach()
        kinds = [kind for kind, exact in (("f16", _exact_f16), ("q8", _exact_q8), ("q41", _exact_q41))
                 if kind in ops and exact(w[:1]) not in (False, None)]  # the first row rules most forms out cheaply
        form = None
        for kind in kinds:
            if kind == "f16":
                got = (w.to(torch.float16),) if _exact_f16(w) else None
            else:
                got = (_exact_q8 if kind == "q8" else _exact_q41)(w)
            if got is not None:
                form = CompactWeight(kind, got, ops[kind], weight.data_ptr(), weight._version)
                break
        if form is None:
            return None
    weight.__dict__[COMPACT_ATTR] = form
    return form.kind


def _exact_f16(w: torch.Tensor) -> bool:
    back = w.to(torch.float16).float()
    return torch.equal(back, w) and torch.equal(back.signbit(), w.signbit())


def _exact_q8(w: torch.Tensor, rows: int = 1024):
    """(int8 values [n, k], scales [n, k / 32]) when every block of 32 is exactly int8 × scale, else None.

    Checked ``rows`` rows at a time (cache-sized pieces, stopping at the first piece that fails): the embedded
    LM head (49152 × 576) took 1.3 s as one piece and 0.45 s in pieces of 1024 rows, on one thread of an Intel
    Xeon (Sapphire Rapids), which kept a cached model load near the 3 s bound of tests/test_models.py."""
    n, k = w.shape
    if k % Q8_BLOCK:
        return None
    values = torch.empty((n, k), dtype=torch.int8)
    scales = torch.empty((n, k // Q8_BLOCK), dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    for i in range(0, n, rows):
        blocks = w[i:i + rows].reshape(-1, k // Q8_BLOCK, Q8_BLOCK)
        scale = blocks.abs().amax(-1).div_(127.0)
        # an all-zero block has scale 0: its values divide by the tiniest float to ±0 and come back as ±0 × 0
        q = (blocks / scale.clamp_min(tiny)[..., None]).round_()
        # |q| ≤ 127 by construction; a NaN or an infinity in the block fails the exact comparison below
        back = q * scale[..., None]
        if not (torch.equal(back, blocks) and torch.equal(back.signbit(), blocks.signbit())):
            return None
        values[i:i + rows] = q.view(-1, k)
        scales[i:i + rows] = scale
    return values, scales


Q41_BLOCK = 32
"""Values per scale and minimum in the "q41" compact form (the GGUF format Q4_1's block)."""


def _exact_q41(w: torch.Tensor):
    """(codes [n, k / 2] uint8, scales [n, k / 32], mins [n, k / 32] fp32) when every block of 32 values along k is
    exactly d · q + m with codes q in [0, 15] (the GGUF format Q4_1's dequantization, as the embedded model's layers
    were dequantized: gguf's ``d * q + m`` in fp32), else None. The kernel's ``q41_pack`` finds each block's m (its
    smallest value, code 0) and d (fp16(span ÷ 15) or fp16(span ÷ 14), or an fp16 neighbour of them: what a Q4_1
    quantizer stores) and requires every value back with the same bits (non-finite values never are). Codes are
    packed as the kernel reads them (``small_linear.cpp``, ``Q41``): byte i of each block of 32 holds value i (low
    nibble) and value i + 16 (high nibble). In C++ because the check runs on every load of the embedded model (its
    120 layer weights in ~0.1 s on 2 cores, where the same search in torch ops took 1.6 s)."""
    pack = _STREAM.get("q41_pack")
    if pack is None or w.dim() != 2 or w.shape[1] % Q41_BLOCK:
        return None
    got = pack(w.contiguous())
    return tuple(got) if got else None


def _compact_fresh(weight: torch.Tensor) -> bool:
    c = weight.__dict__.get(COMPACT_ATTR)
    return c is not None and c.ptr == weight.data_ptr() and c.version == weight._version


def compact_bytes(modules) -> int:
    """Bytes of the compact forms (``compact_weight``) held by the linear layers inside ``modules`` (and their
    fused weights)."""
    return sum(c.nbytes for c in _held(modules, COMPACT_ATTR, lambda c: c))


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


def prepare_weight(weight: torch.Tensor) -> None:
    """Give a bare weight tensor used with ``linear`` (a draft head's LM-head rows) its compact form when the
    active path is "stream" (``compact_weight``); nothing otherwise."""
    if _ACTIVE["path"] == "stream":
        compact_weight(weight)


def _fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The active fast path's product (call only when ``_fast_ok``)."""
    if _ACTIVE["path"] == "stream":
        y = _stream(x, weight, bias)
        if y is not None:
            return y
    if _ONEDNN_OP is not None and x.dim() >= 2:
        if x.numel() >= PACK_MIN_ROWS * x.shape[-1]:
            weight = _packed(weight)
        return _ONEDNN_OP(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


PACK_MIN_ROWS = 17
"""Products with at least this many rows run oneDNN on a copy of the weight packed once into oneDNN's blocked layout
(``_packed``); smaller ones on the dense weight. 17: above what a lone reader's verify pass feeds (a chain of γ ≤ 15,
a tree of ≤ 16 nodes), so the copies are made by a prefill of 17+ tokens or the room's batched passes."""
PACKED_ATTR = "_onednn_packed"
"""The attribute of a weight tensor holding its packed copy: (data_ptr, version, packed tensor)."""


def _reorder_op() -> Callable | None:
    """``torch.ops.mkldnn._reorder_linear_weight`` if this PyTorch build has it, else None (private, looked up by
    name, as ``_onednn_op``)."""
    try:
        return getattr(torch.ops.mkldnn, "_reorder_linear_weight") if _onednn_op() is not None else None
    except (AttributeError, RuntimeError):
        return None


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
    with _PACK_LOCK:  # its own lock: a big product can run while _LOCK is held (choose_path measures 24-row passes)
        entry = weight.__dict__.get(PACKED_ATTR)
        if entry is None or entry[0] != weight.data_ptr() or entry[1] != weight._version:
            with torch.inference_mode():
                entry = (weight.data_ptr(), weight._version, _REORDER_OP(weight.detach()))
            weight.__dict__[PACKED_ATTR] = entry
    return entry[2]


def packed_bytes(modules) -> int:
    """Bytes of the packed copies (``_packed``) the linear layers inside ``modules`` hold now (made on first use)."""
    return sum(entry[2].numel() * 4 for entry in _held(modules, PACKED_ATTR, lambda entry: entry[2]))


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
    return F.linear(x, weight, bias)


_ONEDNN_OP = _onednn_op()
_REORDER_OP = _reorder_op()


def _fast_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return ((_ONEDNN_OP is not None or _STREAM["op"] is not None) and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward runs the fast path (oneDNN; on the "stream" path the streaming
    kernel for few rows) with the same parameters and state dict.

    ``use_path`` switches a module's class to this one and back; training (autograd on) and non-CPU or
    non-fp32 inputs take ``F.linear``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102 - nn.Linear's
        if _fast_ok(x, self.weight):
            return _fast(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


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
            return F.linear(x, self.weight, self.bias)
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


def _fuse_siblings(modules) -> int:
    """Fuse each group of ``SIBLINGS`` found in ``modules`` (plain or oneDNN linears, same input size, dtype
    and device, all with or all without bias). Returns the number of groups fused."""
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
                if _still_fused(lead, mods):  # fused before and switched back: the same stacked weight again
                    fused, bias, sizes = lead._fused_weight, lead._fused_bias, lead._fused_sizes
                else:
                    fused, bias, sizes = _stack(mods)
                lead.__class__ = FusedLeadLinear
                lead._fused_weight, lead._fused_bias, lead._fused_sizes = fused, bias, sizes
                lead._followers = mods[1:]
                for m in mods[1:]:
                    m.__class__ = FusedFollowerLinear
                n += 1
    return n


def _stack(mods) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Stack sibling linears' weights (and biases) into one tensor; the siblings' parameters become views into it
    (no extra memory; their parameters and state dict are unchanged). Returns (weight, bias, rows per sibling)."""
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable in training too
        fused = torch.cat([m.weight.detach() for m in mods])
        bias = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods])
        sizes, start = [], 0
        for m in mods:  # the siblings' weights become views into the stacked weight
            rows = m.weight.shape[0]
            m.weight.data = fused[start:start + rows]
            if bias is not None:
                m.bias.data = bias[start:start + rows]
            sizes.append(rows)
            start += rows
    return fused, bias, sizes


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


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What a fast linear layer's forward computes for this weight (``OneDNNLinear.forward``)."""
    if _fast_ok(x, weight):
        return _fast(x, weight, bias)
    return F.linear(x, weight, bias)


_LEAN_CLASSES: dict[type, type] = {}
"""Original decoder-layer class → its lean subclass (``_lean_class``)."""


def _lean_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                  use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
    """transformers' ``LlamaDecoderLayer.forward`` (5.x) with the same tensor operations in the same order, so
    its output is bit for bit the same, but called as one Python function: the fused q/k/v and gate/up products
    (``_fuse_siblings``) are computed here, the norms are computed inline (``_rms_norm``) and q and k get the
    rotary embedding together (one set of element-wise operations on [B, Hq + Hk, Q, D] instead of two),
    instead of through nine submodule calls per layer with their hooks, keyword plumbing and deprecation
    wrappers.

    Why: on the AMD EPYC (2 threads, the embedded target, a 1-token pass after ~50 cached tokens with every
    matrix product replaced by a stub returning zeros), the passes cost 16–17 ms of Python and small operators
    with transformers' layers and 7.7–8.8 ms with these; whole decoding is compared in
    ``benchmarks/bench_compute.py`` (rows "engine, transformers' layers"). The inline norms and the joint
    rotary embedding took another 1.2 ms off that stubbed pass (5.9 → 4.8 ms) and 1.2–1.5 ms off a real 1- or
    3-token pass (22.5 → 21.1 and 24.4 → 22.8 ms, best of 10, median of 12 alternating reps; AMD EPYC,
    2026-12-02). Masked passes over several tokens (a chain's verify pass, a token tree, a padded batch) give SDPA
    the grouped k/v heads (``enable_gqa``) where transformers copies them per query head (``repeat_kv``): same
    bits; A/B in one process (12 alternating reps, medians), a 3-token pass 25.6 → 23.3 ms after 100 cached tokens
    and 30.4 → 25.8 ms after 250, a 9-node tree pass 33.6 → 28.3 ms after 250 (unchanged after 100). Falls back to
    the original forward whenever autograd is on (training), in training mode, when
    attention weights are asked for, when a layer is not fused, or when its norms are not transformers'
    ``LlamaRMSNorm``.

    Args and returns: those of ``LlamaDecoderLayer.forward``: hidden_states [B, Q, H] → [B, Q, H].
    """
    original = _LEAN_CLASSES_INV[type(self)]
    attn, mlp = self.self_attn, self.mlp
    if (self.training or torch.is_grad_enabled() or position_embeddings is None or kwargs.get("output_attentions")
            or type(attn.q_proj) is not FusedLeadLinear or type(mlp.gate_proj) is not FusedLeadLinear
            or type(self.input_layernorm).forward is not _RMS_FORWARD()
            or type(self.post_attention_layernorm).forward is not _RMS_FORWARD()
            or any(size % attn.head_dim for size in attn.q_proj._fused_sizes)):
        return original.forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    from transformers.models.llama import modeling_llama as ml

    residual = hidden_states
    x = _rms_norm(self.input_layernorm, hidden_states)
    lead = attn.q_proj
    head_dim = attn.head_dim
    qkv = _product(x, lead._fused_weight, lead._fused_bias)
    input_shape = qkv.shape[:-1]
    heads = [size // head_dim for size in lead._fused_sizes]
    # q and k side by side ([B, Hq + Hk, Q, D]) get the rotary embedding in one set of operations: the same
    # element-wise operations as transformers' apply_rotary_pos_emb, so the same bits
    qkv = qkv.view(*input_shape, -1, head_dim).transpose(1, 2)
    qk, v = qkv[:, :heads[0] + heads[1]], qkv[:, heads[0] + heads[1]:]
    cos, sin = position_embeddings
    qk = (qk * cos.unsqueeze(1)) + (ml.rotate_half(qk) * sin.unsqueeze(1))
    q, k = qk[:, :heads[0]], qk[:, heads[0]:]
    kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}  # what the attention module gets
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
    if cache is not None and getattr(_INVARIANT, "on", False) and q.device.type == "cpu":
        # a decode pass in the batch-invariant layout (``batch_invariant``): the mask is built from the rows' spans
        out = invariant_attention(q, k, v, attn.scaling, _INVARIANT.rows, _INVARIANT.new_at).transpose(1, 2)
    elif (_GQA_IN_SDPA and attention_mask is not None and q.shape[2] > 1 and attn.config._attn_implementation == "sdpa"
            and getattr(attn, "num_key_value_groups", 1) > 1 and q.device.type == "cpu"):
        # a masked pass over several tokens (a verify pass, a tree, a padded batch): SDPA reads the grouped k and v
        # heads itself (enable_gqa) instead of transformers' repeat_kv copying them per query head, 2 copies per
        # layer of the whole cache; the same kernel and arithmetic, so the same bits (tested against transformers'
        # layers)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, scale=attn.scaling,
                                             is_causal=False, enable_gqa=True).transpose(1, 2)
    else:
        attention = ml.ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                             ml.eager_attention_forward)
        out, _ = attention(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    o = attn.o_proj
    hidden_states = residual + _product(out, o.weight, o.bias)
    residual = hidden_states
    x = _rms_norm(self.post_attention_layernorm, hidden_states)
    lead = mlp.gate_proj
    gate, up = _product(x, lead._fused_weight, lead._fused_bias).split(lead._fused_sizes, dim=-1)
    down = mlp.down_proj
    return residual + _product(mlp.act_fn(gate) * up, down.weight, down.bias)


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
    op = _STREAM.get("attention") if q.device.type == "cpu" and q.dtype == torch.float32 else None
    if op is not None and k.stride(-1) == 1 and v.stride(-1) == 1:
        key = (id(rows), k.shape[2], n_q, new_at)  # one set of spans per pass, not per layer
        if getattr(_INVARIANT, "span_key", None) != key:
            _INVARIANT.spans, _INVARIANT.span_key = _spans(rows, k.shape[2], n_q, new_at, q.device), key
        return op(q, k, v, *_INVARIANT.spans, scale)
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


_GQA_IN_SDPA = True
"""Masked multi-token passes give SDPA the grouped k/v heads (``enable_gqa``) instead of transformers' copies
(``_lean_forward``); False runs transformers' attention function there (for A/B measurements)."""


@functools.lru_cache(maxsize=1)
def _RMS_FORWARD():  # noqa: N802 - a constant looked up once
    """transformers' ``LlamaRMSNorm.forward``: the norm ``_rms_norm`` computes inline."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm.forward


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward`` (5.x): the same operations in the same order, so the same bits,
    called without the module call (``norm`` is a ``LlamaRMSNorm``; x [..., H] → [..., H]). The casts are skipped
    where they are no-ops (fp32 in and out)."""
    dtype = x.dtype
    h = x if dtype == torch.float32 else x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * (h if dtype == torch.float32 else h.to(dtype))


def _lean_class(cls: type) -> type:
    if cls not in _LEAN_CLASSES:
        lean = type("Lean" + cls.__name__, (cls,), {"forward": _lean_forward, "__doc__": _lean_forward.__doc__})
        _LEAN_CLASSES[cls] = lean
        _LEAN_CLASSES_INV[lean] = cls
    return _LEAN_CLASSES[cls]


_LEAN_CLASSES_INV: dict[type, type] = {}


def _lean_layers(modules, on: bool) -> int:
    """Switch every transformers ``LlamaDecoderLayer`` inside ``modules`` to its lean subclass (``on``) or back.
    Other architectures keep transformers' forward. Returns the number of layers switched."""
    try:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    except ImportError:  # pragma: no cover - transformers without Llama
        return 0
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    n = 0
    for root in roots:
        for m in root.modules():
            if on and type(m) is LlamaDecoderLayer:
                m.__class__ = _lean_class(LlamaDecoderLayer)
                n += 1
            elif not on and type(m) in _LEAN_CLASSES_INV:
                m.__class__ = _LEAN_CLASSES_INV[type(m)]
                n += 1
    return n


def _linears(modules) -> list[nn.Linear]:
    if isinstance(modules, nn.Module):
        modules = [modules]
    out, seen = [], set()
    for root in modules:
        for m in root.modules():
            if isinstance(m, nn.Linear) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


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
        if _STREAM["op"] is None:
            return _STREAM["problem"] or "the streaming kernel was not built"
        name = "the streaming kernel"

        def op(x, w, b):
            return _STREAM["op"](x.reshape(-1, x.shape[-1]), w.contiguous(), b).view(*x.shape[:-1], w.shape[0])
    else:
        if _ONEDNN_OP is None:
            return "oneDNN's linear op is not in this PyTorch build"
        name = "oneDNN"

        def op(x, w, b):
            return _ONEDNN_OP(x, w, b, "none", [], "")
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
                try:
                    got = op(x, m.weight, m.bias)
                except RuntimeError as e:
                    return f"{name} failed on a {shape[0]}×{shape[1]} product: {str(e).splitlines()[0]}"
                ref = F.linear(x, m.weight, m.bias)
                err = float((got - ref).abs().max()) / max(1.0, float(ref.abs().max()))
                if not err <= TOLERANCE:
                    return (f"{name} disagreed with F.linear by {err:.1e} (relative) on a {shape[0]}×{shape[1]} "
                            f"product with {r} rows")
    return None


def apply_path(modules, path: str) -> None:
    """Route every ``nn.Linear`` inside ``modules`` through ``path`` ("default", "onednn" or "stream"), in
    place, and make ``path`` the process's active path for ``linear`` and every fast layer (one path per
    process: the last one applied; "stream" builds the kernel if needed and takes oneDNN where it cannot).

    Raises:
        InputError: for an unknown path.
    """
    if path not in PATHS:
        raise InputError(f"Unknown compute path {path!r}; use one of {', '.join(PATHS)}.")
    if path == "stream":
        stream_kernel()
    cls = nn.Linear if path == "default" else OneDNNLinear
    if path != "default":
        _pin_fp32()
    for m in _linears(modules):
        if type(m) in _OURS:  # leave subclasses with their own forward alone
            m.__class__ = cls
            m.__dict__.pop("_pending", None)
    if path != "default":
        _fuse_siblings(modules)
        _own_memory(modules)
    _lean_layers(modules, on=path != "default")
    _ACTIVE["path"] = path
    if path == "stream":
        for m in _linears(modules):
            if type(m) is FusedFollowerLinear:
                continue  # its lead's fused weight holds its rows
            w = m.__dict__.get("_fused_weight") if type(m) is FusedLeadLinear else m.weight
            if w is not None and not _compact_fresh(w):
                compact_weight(w)


def _file_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's memory mapped from checkpoint files (``/proc/self/maps`` lines whose file
    is a ``.safetensors``); empty where that file does not exist (not Linux)."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip().endswith(".safetensors"):
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return ranges


def _own_memory(modules) -> int:
    """Copy into the process's own memory every CPU parameter still read from a memory-mapped checkpoint
    (transformers maps ``.safetensors`` files), so the mapping is released once nothing points into it. Returns
    the bytes copied.

    Why: after ``_fuse_siblings`` the q/k/v and gate/up weights live in their stacked copies, but the mapping stays
    while the other weights (o, down, norms, the embedding) point into it, and every page read from it so far stays
    resident: measured with the embedded model (Intel Xeon, Sapphire Rapids), 381 MB of the checkpoint's mapping were
    resident beside the stacked copies (``/proc/self/smaps``); copying the 0.16 GB still mapped gave it back. Called
    before the compact and packed copies are made (they are keyed by the weight's address)."""
    ranges = _file_ranges()
    if not ranges:
        return 0
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    copied = 0
    # Copies made under ``torch.inference_mode`` (``measure_paths`` applies paths inside it) would be inference
    # tensors, which have no version counter, so ``compact_weight`` leaves them fp32: the copies are plain tensors.
    with torch.inference_mode(False), torch.no_grad():
        for root in roots:
            for prm in root.parameters():
                if prm.device.type != "cpu" or prm.numel() == 0:
                    continue
                ptr = prm.data_ptr()
                if any(lo <= ptr < hi for lo, hi in ranges):
                    prm.data = prm.data.clone()
                    copied += prm.numel() * prm.element_size()
    return copied


_OURS = (nn.Linear, OneDNNLinear, FusedLeadLinear, FusedFollowerLinear)


def lean_layer_count(module: nn.Module) -> int:
    """How many of ``module``'s decoder layers run ``_lean_forward`` (the layers whose decode passes can run in the
    batch-invariant layout: ``batch_invariant``)."""
    return sum(type(m) in _LEAN_CLASSES_INV for m in module.modules())


def path_of(module: nn.Module) -> str:
    """The path ``module``'s linear layers run: "default" unless some were switched to the fast layers, then the
    process's active fast path ("stream" or "onednn")."""
    if not any(isinstance(m, OneDNNLinear) for m in _linears(module)):
        return "default"
    return "stream" if _ACTIVE["path"] == "stream" else "onednn"


def _fingerprint(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    parts = [type(model).__name__]
    for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_key_value_heads"):
        parts.append(str(getattr(cfg, k, "")))
    p = next(model.parameters(), None)
    parts.append(str(p.dtype) if p is not None else "")
    return "/".join(parts)


def _memo_key(model: nn.Module) -> str:
    return "|".join([cpu_model(), torch.__version__, f"threads={torch.get_num_threads()}", _fingerprint(model)])


def _read_store(f: Path | None) -> dict:
    try:
        return json.loads(f.read_text()) if f is not None else {}
    except (OSError, ValueError):
        return {}


def _write_store(f: Path | None, key: str, choice: ComputePath) -> None:
    if f is None:
        return
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        data = _read_store(f)
        data[key] = choice.to_dict()
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, f)
    except OSError:  # a read-only cache only costs a re-measurement next time
        pass


def measure_paths(model: nn.Module, tokens: tuple[int, ...] = (1, 4), reps: int = 5,
                  context: int = 16, paths: tuple[str, ...] | None = None) -> dict[str, dict[int, float]]:
    """Fastest time (ms, best of ``reps``) of the model's forward over ``tokens`` new tokens after
    ``context`` cached ones, for each path, alternating paths rep by rep (the model is left on "default").
    The best of several reps, not the median: another process's load only ever adds time, so the
    minimum is the steadiest estimate of what the kernels cost.

    Args:
        paths: the paths to time (default: "default", and "onednn" where this build has it).

    Returns:
        {path: {tokens: best ms}} for the paths timed.
    """
    from transformers import DynamicCache

    if paths is None:
        paths = tuple(p for p in ("default", "onednn") if p == "default" or _ONEDNN_OP is not None)
    paths = list(paths)
    dev = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 100) or 100)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + max(tokens)), generator=gen).to(dev)
    out: dict[str, dict[int, list[float]]] = {p: {n: [] for n in tokens} for p in paths}
    with torch.inference_mode():
        for rep in range(reps + 1):  # rep 0 warms up
            for p in (paths if rep % 2 else paths[::-1]):
                apply_path(model, p)
                cache = DynamicCache()
                model(ids[:, :context], cache=cache, use_cache=True)
                for n in tokens:
                    t0 = time.perf_counter()
                    model(ids[:, context:context + n], cache=cache, use_cache=True, logits_to_keep=1)
                    if rep:
                        out[p][n].append((time.perf_counter() - t0) * 1e3)
                    cache.crop(-n)
    apply_path(model, "default")
    return {p: {n: min(v) for n, v in d.items()} for p, d in out.items()}


def measure_stream_rows(model: nn.Module, candidates: tuple[int, ...] = STREAM_ROW_CANDIDATES,
                        reps: int = 5) -> tuple[int, dict[str, dict[int, float]]]:
    """This machine's row limit for the streaming kernel: the model's forward over each candidate number of
    tokens, on oneDNN and on the kernel without a limit (alternating, best of ``reps``, as ``measure_paths``).
    The kernel streams each weight row once against every input row, so it wins while a product is bound by
    reading the weights and loses once it is bound by arithmetic, where oneDNN's blocked kernels are better; that
    crossover depends on the CPU (measured: at 32 rows on the AMD EPYC, about 12 on the Intel Xeon of
    ``benchmarks/results/compute_xeon.md``).

    Returns:
        (the largest candidate whose stream pass was no slower than oneDNN's, or 4 when none was; {path: {tokens:
        best ms}}). The largest such candidate, not the end of the first run of them: the choice is remembered for
        the machine, and one noisy candidate must not cut the limit for good (measured on the Intel Xeon, session
        23: 8 tokens 74.8 against oneDNN's 126.0 ms, 12 tokens 143.8 against 132.4, 16 tokens 131.2 against 138.5,
        24 tokens 146.6 against 183.0; the 12-token pass was slower than the 16-token one, so noise, and the
        first-run rule stopped at 8 rows, sending every 9-node tree pass to oneDNN: 2.16× one token against 1.25×
        the day before).
    """
    old = _STREAM["max_rows"]
    _STREAM["max_rows"] = max(candidates)
    try:
        ms = measure_paths(model, tokens=tuple(candidates), reps=reps, paths=("onednn", "stream"))
    finally:
        _STREAM["max_rows"] = old
    wins = [n for n in candidates if ms["stream"][n] <= ms["onednn"][n]]
    return max(wins, default=4), ms


def choose_path(model: nn.Module, override: str | None = None, store: Path | None = None,
                progress: Callable[[str], None] | None = None) -> ComputePath:
    """Pick the compute path for ``model`` on this machine (see the module docstring).

    Args:
        model: a transformers causal LM (or any module with ``nn.Linear`` layers; then only an override
            or a remembered choice applies, no measurement).
        override: "auto" (measure), "default", "onednn" or "stream"; None reads ``$SPEEDUP_LAB_COMPUTE``.
        store: a JSON file remembering measured choices across processes (``load_model`` passes
            ``<user cache>/compute_paths.json``); measured choices are always remembered in memory.
        progress: told (one message) before the streaming kernel is built, the first time on a machine.

    Returns:
        the choice, not yet applied (``use_path`` applies it).

    Raises:
        InputError: an override that is not one of ``CHOICES``.
    """
    want = parse_override(os.environ.get(ENV_VAR) if override is None else override)
    cpu, threads = cpu_model(), torch.get_num_threads()
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu":
        return ComputePath("default", "not on a CPU: PyTorch's own kernels" if p is not None else "no weights",
                           cpu, threads)
    if p.dtype != torch.float32:
        return ComputePath("default", f"{str(p.dtype).removeprefix('torch.')} weights: the oneDNN path is "
                           "for fp32 only", cpu, threads)
    if want == "default":
        return ComputePath("default", f"forced by override ({ENV_VAR} or --compute)", cpu, threads)
    problem = self_check(model)
    if want == "onednn" or (problem and want == "auto"):
        if problem:
            return ComputePath("default", f"fallback: {problem}", cpu, threads)
        return ComputePath("onednn", f"forced by override ({ENV_VAR} or --compute)", cpu, threads)
    stream_kernel(progress)
    stream_bad = self_check(model, kernel="stream")
    if want == "stream":
        if not stream_bad:
            return ComputePath("stream", f"forced by override ({ENV_VAR} or --compute)", cpu, threads)
        return ComputePath("default" if problem else "onednn", f"fallback: {stream_bad}", cpu, threads)
    offered = ("default", "onednn") + (() if stream_bad else ("stream",))
    key = _memo_key(model) + "|paths=" + ",".join(offered) + ("" if stream_bad else f"|kernel={_STREAM.get('name', '')}"
                                                               "|rows=largest-win") + f"|packed>={PACK_MIN_ROWS}|weights={weight_format()}"
    with _LOCK:
        if key in _MEMO:
            return _MEMO[key]
        stored = _read_store(store).get(key)
        if stored:
            try:
                choice = ComputePath(**stored)
                choice.reason = choice.reason.replace("measured:", "measured on this machine earlier:", 1)
                _MEMO[key] = choice
                return choice
            except TypeError:
                pass
        if not hasattr(model, "config"):
            return ComputePath("onednn", "self-check passed (no model to time)", cpu, threads)
        ms = measure_paths(model, paths=offered)
        total = {path: sum(d.values()) for path, d in ms.items()}
        best = min(total, key=total.get)
        runner_up = min((p for p in total if p != best), key=total.get)
        ratio = total[runner_up] / total[best] if total[best] > 0 else 1.0
        detail = ", ".join(f"{path} {d[1]:.1f}/{d[4]:.1f} ms" for path, d in ms.items())
        pass_ms = {k: {str(n): round(v, 2) for n, v in d.items()} for k, d in ms.items()}
        rows, rows_note, rows_ms = STREAM_MAX_ROWS, "", {}
        if best == "stream" and "onednn" in offered:
            rows, wide = measure_stream_rows(model)
            rows_ms = {k: {str(n): round(v, 2) for n, v in d.items()} for k, d in wide.items()}
            rows_note = ("; kernel up to " + str(rows) + " rows: "
                         + ", ".join(f"{n} tokens {wide['stream'][n]:.1f} vs oneDNN {wide['onednn'][n]:.1f} ms"
                                     for n in sorted(wide["stream"])))
        choice = ComputePath(best, f"measured: {ratio:.2f}× faster than {runner_up} (1-/4-token pass: {detail}"
                             f"{rows_note})", cpu, threads, pass_ms, stream_rows=rows, rows_ms=rows_ms)
        _MEMO[key] = choice
        _write_store(store, key, choice)
        return choice


def active_stream_rows() -> int | None:
    """The streaming kernel's row limit this process's passes run with: the last ``use_path`` choice's measured
    limit while the active path is "stream", else None (no "stream" choice applied in this process, or another
    path active). A pass-cost curve measured under another limit is not this process's curve
    (``engine.decoding.pass_cost.cached_pass_cost``)."""
    return _STREAM.get("applied_rows") if _ACTIVE["path"] == "stream" else None


def use_path(modules, choice: ComputePath) -> ComputePath:
    """Apply ``choice`` to ``modules`` (a model, a draft head, Medusa heads) and return it; on "stream" its
    measured row limit becomes the process's (one limit per process, as one path: the last one applied)."""
    apply_path(modules, choice.path)
    if choice.path == "stream":
        _STREAM["max_rows"] = _STREAM["applied_rows"] = int(choice.stream_rows)
        extra = compact_bytes(modules)
        if extra != choice.extra_bytes:
            choice = replace(choice, extra_bytes=extra)
        formats = weight_formats(modules)
        if formats != choice.formats:
            choice = replace(choice, formats=formats)
    packable = _packable_bytes(modules) if choice.path != "default" and _REORDER_OP is not None else 0
    if packable != choice.packable_bytes:
        choice = replace(choice, packable_bytes=packable)
    return choice


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
        if w is not None and w.device.type == "cpu" and w.dtype == torch.float32 and w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            total += w.numel() * 4
    return total
