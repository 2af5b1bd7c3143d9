"""The int8 arithmetic (engine/decoding/compute/int8_product.cpp, formats.arithmetic): activations quantized per row in
blocks of 32, GGUF Q4_1 / Q8_0 weights, int8 products. Checked bit for bit against the scalar reference (the formulas
written straight on the weights' original layout), against a torch quantizer, against hand-computed values, across
instruction sets (the portable code, and an AVX2 build where the compiler can make one), and for batch invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.decoding import compute
from engine.decoding.compute import arithmetic, arithmetic_scope
from engine.errors import InputError

compute.stream_kernel()
INT8 = compute.extension._STREAM.get("int8")
needs_int8 = pytest.mark.skipif(INT8 is None, reason="the kernel could not be built here (no C++ compiler)")


def _q41(n, k, gen):
    """A Q4_1 weight as the kernel's exact form holds it: GGUF-packed codes [n, k / 2], fp16-valued scales and mins."""
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    mins = (-torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    return codes, scales, mins


def _q8(n, k, gen):
    values = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    return values, scales


def _dense_q41(codes, scales, mins):
    n = codes.shape[0]
    blocks = codes.view(n, -1, 16)
    q = torch.cat([blocks & 15, blocks >> 4], dim=-1).float()
    return (q * scales[..., None] + mins[..., None]).view(n, -1)


@needs_int8
@pytest.mark.parametrize("n,k", [(200, 576), (49, 64), (16, 32), (33, 1536)])
def test_q41_products_are_the_scalar_reference_bit_for_bit_at_every_row_count(n, k):
    gen = torch.Generator().manual_seed(n + k)
    codes, scales, mins = _q41(n, k, gen)
    packed = INT8["pack_q41"](codes, scales, mins)
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 5, 8, 9, 16, 17, 24):
        x = torch.randn(m, k, generator=gen)
        for b in (None, bias):
            got = INT8["q41x8"](x, *packed, b)
            ref = INT8["reference_q41"](x, codes, scales, mins, b)
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (m, b is None)


@needs_int8
@pytest.mark.parametrize("n,k", [(200, 576), (49152 // 64, 576), (17, 64)])
def test_q8_products_are_the_scalar_reference_bit_for_bit(n, k):
    gen = torch.Generator().manual_seed(n * 3 + k)
    values, scales = _q8(n, k, gen)
    packed = INT8["pack_q8"](values, scales)
    for m in (1, 4, 9, 16, 23):
        x = torch.randn(m, k, generator=gen) * 3
        assert torch.equal(INT8["q8x8"](x, *packed, None), INT8["reference_q8"](x, values, scales, None))


@needs_int8
def test_portable_code_gives_the_same_bits_as_this_cpus_code():
    gen = torch.Generator().manual_seed(5)
    codes, scales, mins = _q41(72, 576, gen)
    values, s8 = _q8(40, 576, gen)
    p41, p8 = INT8["pack_q41"](codes, scales, mins), INT8["pack_q8"](values, s8)
    x = torch.randn(13, 576, generator=gen)
    native = (INT8["q41x8"](x, *p41, None), INT8["q8x8"](x, *p8, None))
    INT8["force_portable"](True)
    try:
        assert INT8["impl"]() == "portable"
        portable = (INT8["q41x8"](x, *p41, None), INT8["q8x8"](x, *p8, None))
    finally:
        INT8["force_portable"](False)
    assert torch.equal(native[0], portable[0]) and torch.equal(native[1], portable[1])


@needs_int8
def test_a_row_alone_equals_the_same_row_in_passes_of_2_to_24_rows():
    gen = torch.Generator().manual_seed(7)
    codes, scales, mins = _q41(96, 576, gen)
    packed = INT8["pack_q41"](codes, scales, mins)
    row = torch.randn(1, 576, generator=gen)
    alone = INT8["q41x8"](row, *packed, None)
    for m in (2, 3, 7, 8, 9, 16, 24):
        x = torch.randn(m, 576, generator=gen)
        at = int(torch.randint(0, m, (1,), generator=gen))
        x[at] = row[0]
        assert torch.equal(INT8["q41x8"](x, *packed, None)[at], alone[0]), m


@needs_int8
def test_quantizer_is_llama_cpps_q8_1_blocks_as_torch_computes_them():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 128, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 1e-3, 4.0])[:, None]
    x[1, :32] = 0.0  # an all-zero block: d 0, every q 0
    q, d, s, sq = INT8["quantize_rows"](x)
    blocks = x.view(5, 4, 32)
    dd = blocks.abs().amax(-1) / 127.0
    inv = torch.where(dd != 0, 1.0 / dd, torch.zeros_like(dd))
    q_ref = torch.round(blocks * inv[..., None]).clamp(-127, 127)  # round half to even, as the kernel
    assert torch.equal(q.view(5, 4, 32).float(), q_ref)
    assert torch.equal(d, dd.half().float())
    assert torch.equal(sq, q_ref.sum(-1).int())
    assert torch.equal(s, (q_ref.sum(-1) * dd).half().float())
    assert not q[1, :32].any() and d[1, 0] == 0


@needs_int8
def test_a_hand_computed_q41_block():
    # one block: x_0 = 1.27, the rest 0 → amax 1.27, d = 0.01, q_0 = 127; every weight code 3, scale 0.5, min −1
    # (each weight 0.5): isum = 3 · 127 = 381, y = 381 · (0.5 · fp16(d)) + (−1) · fp16(d · 127)
    x = torch.zeros(1, 32)
    x[0, 0] = 1.27
    codes = torch.full((1, 16), 3 | (3 << 4), dtype=torch.uint8)
    scales, mins = torch.tensor([[0.5]]), torch.tensor([[-1.0]])
    d = np.float32(np.float32(1.27) / np.float32(127.0))
    d16, s16 = float(np.float16(d)), float(np.float16(np.float32(127.0) * d))
    expected = 381 * 0.5 * d16 - s16
    got = INT8["q41x8"](x, *INT8["pack_q41"](codes, scales, mins), None)
    assert abs(float(got) - expected) < 1e-6
    assert abs(float(got) - 0.635) < 2e-3  # the fp32 product 0.5 · 1.27, within the 8-bit activation's rounding


@needs_int8
def test_int8_products_stay_within_the_quantization_error_of_the_fp32_product():
    gen = torch.Generator().manual_seed(3)
    codes, scales, mins = _q41(64, 576, gen)
    x = torch.randn(4, 576, generator=gen)
    exact = x.double() @ _dense_q41(codes, scales, mins).double().T
    got = INT8["q41x8"](x, *INT8["pack_q41"](codes, scales, mins), None).double()
    # each activation rounds by at most d / 2 = amax / 254; summed over K with the weights' magnitudes
    bound = (x.view(4, 18, 32).abs().amax(-1) / 254).repeat_interleave(32, -1).double() @ \
        _dense_q41(codes, scales, mins).abs().double().T
    assert bool(((got - exact).abs() <= bound * 1.01 + 1e-5).all())
    assert float((got - exact).abs().max()) > 0  # int8 really changes the numbers: a lossy path


@needs_int8
def test_packs_refuse_scales_that_are_not_fp16_values_and_q8_values_of_minus_128():
    gen = torch.Generator().manual_seed(1)
    codes, scales, mins = _q41(16, 64, gen)
    assert INT8["pack_q41"](codes, scales + 1e-7, mins) == []
    values, s8 = _q8(16, 64, gen)
    values[3, 5] = -128
    assert INT8["pack_q8"](values, s8) == []


@needs_int8
def test_compact_weight_picks_the_int8_form_under_int8_and_the_exact_form_under_fp32():
    gen = torch.Generator().manual_seed(2)
    codes, scales, mins = _q41(40, 64, gen)
    codes.view(40, 2, 16)[:, :, 0] = 0 | (15 << 4)  # each block holds codes 0 and 15, as a quantizer's blocks do
    for mode, kind in (("int8", "q41x8"), ("fp32", "q41")):
        w = _dense_q41(codes, scales, mins).clone()
        with arithmetic_scope(mode):
            assert arithmetic() == mode
            assert compute.compact_weight(w) == kind
        form = w.__dict__[compute.COMPACT_ATTR]
        # the form's values rebuilt are the weight's, bit for bit (a released weight rebuilds from them)
        assert torch.equal(compute.formats.rebuild(form).view(torch.int32), w.view(torch.int32))
        assert torch.equal(compute.formats.rebuild(form, slice(17, 35)).view(torch.int32), w[17:35].view(torch.int32))
    values, s8 = _q8(33, 64, gen)
    values[:, ::32] = 127  # each block's largest magnitude is 127 · scale, as Q8_0's are
    w = (values.float().view(33, 2, 32) * s8[..., None]).view(33, 64)
    with arithmetic_scope("int8"):
        assert compute.compact_weight(w) == "q8x8"
    assert torch.equal(compute.formats.rebuild(w.__dict__[compute.COMPACT_ATTR], slice(3, 20)), w[3:20])


def test_arithmetic_setting_names_its_values_on_error(monkeypatch):
    monkeypatch.setenv(compute.ARITHMETIC_ENV, "int4")
    with pytest.raises(InputError, match="int8, fp32"):
        arithmetic()
    monkeypatch.setenv(compute.ARITHMETIC_ENV, " FP32 ")
    assert arithmetic() == "fp32"
    with arithmetic_scope("int8"):
        assert arithmetic() == "int8"
    assert arithmetic() == "fp32"
    with pytest.raises(InputError):
        with arithmetic_scope("bf16"):
            pass


AVX2_WRAP = """#include "{src}"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ register_int8(m); }}
"""


@needs_int8
@pytest.mark.slow
@pytest.mark.parametrize("flags", [["-mavx2", "-mfma", "-mf16c"], ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"]],
                         ids=["avx2", "avx2-vnni"])
def test_an_avx2_build_gives_the_same_bits(flags, tmp_path):
    """The int8 products built for a CPU without AVX-512 (AVX2, with and without AVX-VNNI; built here from the same
    source when the compiler can target them) give the scalar reference's bits, so the tests mean the same there."""
    import hashlib
    import os
    from pathlib import Path

    from torch.utils import cpp_extension

    src = Path(compute.extension.INT8_SOURCE)
    key = hashlib.sha1((src.read_text() + " ".join(flags) + torch.__version__).encode()).hexdigest()[:10]
    name = f"speedup_lab_int8_{flags[-1].strip('-m').replace('-', '_')}_{key}"
    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    folder.mkdir(parents=True, exist_ok=True)
    wrap = folder / "wrap.cpp"
    wrap.write_text(AVX2_WRAP.format(src=src))
    try:
        mod = cpp_extension.load(name=name, sources=[str(wrap)], extra_cflags=["-O3", *flags],
                                 extra_include_paths=[str(src.parent)], build_directory=str(folder), verbose=False)
    except Exception as e:  # noqa: BLE001 - a compiler that cannot target these flags
        pytest.skip(f"cannot build for {' '.join(flags)} here: {str(e).splitlines()[0][:200]}")
    assert mod.int8_impl() in ("avx2", "avx2-vnni")
    gen = torch.Generator().manual_seed(9)
    codes, scales, mins = _q41(40, 576, gen)
    values, s8 = _q8(24, 576, gen)
    p41, p8 = mod.int8_pack_q41(codes, scales, mins), mod.int8_pack_q8(values, s8)
    bias = torch.randn(40, generator=gen)
    for m in (1, 3, 8, 13):
        x = torch.randn(m, 576, generator=gen)
        assert torch.equal(mod.small_linear_q41x8(x, *p41, bias), INT8["reference_q41"](x, codes, scales, mins, bias))
        assert torch.equal(mod.small_linear_q8x8(x, *p8, None), INT8["reference_q8"](x, values, s8, None))
        # and this build's own products (AVX-512 here): the same bits on either instruction set
        assert torch.equal(mod.small_linear_q41x8(x, *p41, bias), INT8["q41x8"](x, *INT8["pack_q41"](codes, scales, mins), bias))
