"""Exact compact weights: the forms the streaming kernel reads instead of a weight's fp32 values when they hold exactly
the same values (fp16, Q8_0 blocks, GGUF Q4_1 blocks: ``compact_weight``), and ``SPEEDUP_LAB_WEIGHTS``, which has every
weight read as fp32 instead (``weight_format``). What a model's compact forms add and save is counted where paths are
applied (``engine.decoding.compute.apply``: ``compact_bytes``, ``weight_formats``).
"""

from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch

from engine.decoding.compute import extension
from engine.errors import InputError

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


ARITHMETIC_ENV = "SPEEDUP_LAB_ARITHMETIC"
ARITHMETICS = ("int8", "fp32")
_ARITHMETIC: contextvars.ContextVar[str | None] = contextvars.ContextVar("speedup_lab_arithmetic", default=None)


def arithmetic() -> str:
    """How the streaming kernel multiplies GGUF block weights (Q4_1, Q8_0): "int8" (the default: the activations of
    each product quantized per row in blocks of 32 to int8 with one scale each, int8 products summed in int32 and
    scaled per block, as llama.cpp computes them; ``int8_product.cpp``) or "fp32" (every weight rebuilt exactly to fp32
    and multiplied in fp32: bit for bit the fp32 model's products, the reference). From ``arithmetic_scope`` while one
    is open (a model loaded for one lane of a race), else ``SPEEDUP_LAB_ARITHMETIC``.

    "int8" changes the model's numbers (its activations are rounded to 8 bits per block): a lossy property of the
    compute path, measured against "fp32" by ``engine.decoding.agreement``. Speculative decoding stays lossless
    against whichever path runs the target: every row of a pass is computed alone (batch-invariant by construction).

    Raises:
        InputError: for another value."""
    value = _ARITHMETIC.get() or (os.environ.get(ARITHMETIC_ENV) or "int8").strip().lower()
    if value not in ARITHMETICS:
        raise InputError(f"{ARITHMETIC_ENV} must be one of {', '.join(ARITHMETICS)}, got {value!r}.")
    return value


@contextmanager
def arithmetic_scope(value: str | None) -> Iterator[None]:
    """Within the block, ``arithmetic()`` is ``value`` (None: the process's setting) for this thread or task: the
    compact forms made meanwhile (a model's load) use it, and keep it for their life.

    Raises:
        InputError: for a value not in ``ARITHMETICS``."""
    if value is not None and value not in ARITHMETICS:
        raise InputError(f"The arithmetic must be one of {', '.join(ARITHMETICS)}, got {value!r}.")
    token = _ARITHMETIC.set(value)
    try:
        yield
    finally:
        _ARITHMETIC.reset(token)


INT8_KINDS = ("q41x8", "q8x8")
"""The compact forms of the "int8" arithmetic (``int8_product.cpp``): Q4_1 or Q8_0 weights × int8 activations."""

COMPACT_ATTR = "_stream_compact"
"""The attribute of a weight tensor holding its exact compact form (``CompactWeight``)."""
Q8_BLOCK = 32
"""Values per scale in the "q8" compact form (the GGUF format Q8_0's block)."""


@dataclass(frozen=True)
class CompactWeight:
    """A weight's exact compact storage for the streaming kernel (``compact_weight``).

    Attributes:
        kind: "f16" (the weight's values as fp16), "q8" (int8 values and one fp32 scale per ``Q8_BLOCK``),
            "q41" (4-bit codes, one fp32 scale and one fp32 minimum per ``Q41_BLOCK``: GGUF's Q4_1), or the "int8"
            arithmetic's forms of the last two, "q8x8" and "q41x8" (``INT8_KINDS``: the same values repacked in groups of
            16 rows for int8 products, fp16 scales; ``int8_product.cpp``).
        tensors: ("f16": [N, K] fp16), ("q8": [N, K] int8, [N, K / 32] fp32 scales), ("q41": [N, K / 2] uint8
            codes, [N, K / 32] fp32 scales, [N, K / 32] fp32 minimums), ("q41x8": [G, K / 32, 256] uint8 codes,
            [G, K / 32, 16] fp16 scales and minimums (as int16), [2] int64 (N, K)) or ("q8x8": [G, K / 32, 512] uint8
            values + 128, [G, K / 32, 16] fp16 scales (as int16), [2] int64 (N, K)); G = ⌈N / 16⌉.
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
    ops = dict(extension._STREAM.get("compact") or {})
    int8 = extension._STREAM.get("int8") if arithmetic() == "int8" else None
    if ((not ops and int8 is None) or weight_format() == "fp32" or weight.dim() != 2 or weight.dtype != torch.float32
            or weight.device.type != "cpu" or not weight.is_contiguous() or weight.is_inference() or weight.numel() == 0
            or weight.shape[1] % 16):
        return None
    with torch.no_grad():
        w = weight.detach()
        offered = [kind for kind in ("f16", "q8", "q41") if kind in ops or (int8 is not None and kind != "f16")]
        kinds = [kind for kind, exact in (("f16", _exact_f16), ("q8", _exact_q8), ("q41", _exact_q41))
                 if kind in offered and exact(w[:1]) not in (False, None)]  # the first row rules most forms out cheaply
        form = None
        for kind in kinds:
            if kind == "f16":
                got = (w.to(torch.float16),) if _exact_f16(w) else None
            else:
                got = (_exact_q8 if kind == "q8" else _exact_q41)(w)
            if got is not None and int8 is not None and kind in ("q8", "q41"):
                packed = int8[f"pack_{kind}"](*got)  # [] where a scale is not an fp16 value
                if packed:
                    form = CompactWeight(f"{kind}x8", tuple(packed), int8[f"{kind}x8"], weight.data_ptr(),
                                         weight._version)
                    break
            if got is not None and kind in ops:
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
    pack = extension._STREAM.get("q41_pack")
    if pack is None or w.dim() != 2 or w.shape[1] % Q41_BLOCK:
        return None
    got = pack(w.contiguous())
    return tuple(got) if got else None


def _compact_fresh(weight: torch.Tensor) -> bool:
    c = weight.__dict__.get(COMPACT_ATTR)
    return c is not None and c.ptr == weight.data_ptr() and c.version == weight._version


DENSE_FROM_ATTR = "_dense_from"
"""On a released weight (``dense.release_linear``): (the tensor holding the compact form, its first row, rows, whether
the weight required gradients before): where its values are rebuilt from."""


def rebuild(form, rows: slice | None = None) -> torch.Tensor:
    """The fp32 values [N, K] of a compact form (``CompactWeight``; ``rows``: only those rows), with the kernel's
    arithmetic, so exactly the values each form's check compared when it was made (``compact_weight``): fp16 values
    widened; Q8_0 int8 · scale (one product, as ``_exact_q8``); Q4_1 d · q + m (d · q exact in fp32, one rounding of
    the sum, as ``small_linear.cpp``'s ``Q41`` and ``q41_pack``). Byte i of a Q4_1 block of 32 holds value i (low
    nibble) and value i + 16 (high nibble)."""
    if rows is not None and form.kind not in INT8_KINDS:
        form = replace(form, tensors=tuple(t[rows] for t in form.tensors))
    if form.kind == "f16":
        return form.tensors[0].float()
    if form.kind == "q8":
        values, scales = form.tensors
        n, k = values.shape
        return (values.float().view(n, k // 32, 32) * scales[..., None]).view(n, k)
    if form.kind in INT8_KINDS:
        return _rebuild_int8(form, rows)
    if form.kind == "q41":
        codes, scales, mins = form.tensors
        n = codes.shape[0]
        blocks = codes.view(n, -1, 16)
        q = torch.cat([blocks & 15, blocks >> 4], dim=-1).float()  # [n, K / 32, 32]
        return (q * scales[..., None] + mins[..., None]).view(n, -1)
    raise ValueError(f"no rebuild for compact form {form.kind!r}")


def _rebuild_int8(form, rows: slice | None) -> torch.Tensor:
    """The fp32 values of an int8 form's rows (``rebuild``), unpacked from its groups of 16 rows (``int8_product.cpp``:
    Q4_1 byte (L, r, i) of a block's 256 holds value 4L + i of row r in its low nibble and 4(L + 4) + i in its high;
    Q8_0 byte (j, r, i) of 512 holds value 4j + i of row r plus 128): the same values the exact form held."""
    codes, scales = form.tensors[0], form.tensors[1]
    n_rows, k = (int(v) for v in form.tensors[-1])
    start, stop, _ = (rows or slice(None)).indices(n_rows)
    g0, g1 = start // 16, max(start // 16, -(-stop // 16))
    codes, scales = codes[g0:g1], scales[g0:g1].view(torch.float16).float()
    g, nb = codes.shape[0], codes.shape[1]
    if form.kind == "q41x8":
        c = codes.view(g, nb, 4, 16, 4)
        q = torch.cat([c & 15, c >> 4], dim=2)  # [g, nb, 8 steps, 16 rows, 4]
    else:
        q = codes.view(g, nb, 8, 16, 4).to(torch.int16) - 128
    q = q.permute(0, 3, 1, 2, 4).reshape(g * 16, nb, 32).float()  # [rows, blocks, 32]
    d = scales.permute(0, 2, 1).reshape(g * 16, nb, 1)
    if form.kind == "q41x8":
        m = form.tensors[2][g0:g1].view(torch.float16).float().permute(0, 2, 1).reshape(g * 16, nb, 1)
        values = q * d + m  # d · q exact in fp32, one rounding of the sum: the exact form's arithmetic
    else:
        values = q * d
    first = start - g0 * 16
    return values.view(g * 16, k)[first:first + (stop - start)]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two fp32 tensors hold the same bits (signed zeros and NaN payloads included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def is_released(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s fp32 storage was released (``dense.release_linear``) and not replaced since."""
    return DENSE_FROM_ATTR in weight.__dict__ and weight.dim() == 2 and weight.stride() == (0, 0)


def dense_values(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` itself, or for a released one its fp32 values rebuilt from the compact form (a new tensor, not
    kept): what ``F.linear`` and a state dict need."""
    if not is_released(weight):
        return weight
    holder, start, rows, _ = weight.__dict__[DENSE_FROM_ATTR]
    return rebuild(holder.__dict__[COMPACT_ATTR])[start:start + rows]
