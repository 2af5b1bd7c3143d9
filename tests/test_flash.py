"""engine.explain.flash: tiled attention == standard attention, the running statistics, the traffic model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.errors import InputError
from engine.explain.flash import (
    HARDWARE_PRESETS,
    block_sizes,
    flash_report,
    flash_traffic,
    measure_attention,
    paper_comparison,
    sram_elements,
    standard_attention,
    standard_traffic,
    tiled_attention,
    trace_tiled_attention,
    traffic_curve,
)


def _qkv(shape_q, n_k=None, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    *lead, n, d = shape_q
    n_k = n if n_k is None else n_k
    q = torch.randn(*lead, n, d, generator=g, dtype=dtype)
    k = torch.randn(*lead, n_k, d, generator=g, dtype=dtype)
    v = torch.randn(*lead, n_k, d, generator=g, dtype=dtype)
    return q, k, v


def _softmax_reference(q, k, v, causal):
    """Attention written out row by row in float64 numpy, independent of the engine."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    n, d = q.shape
    out = np.zeros((n, v.shape[1]))
    for r in range(n):
        s = k @ q[r] / math.sqrt(d)
        if causal:
            s = s[: r + 1]
        w = np.exp(s - s.max())
        out[r] = (w / w.sum()) @ v[: len(w)]
    return out


# ------------------------------------------------------------------------------------------ exactness

SHAPES = [
    # (q shape, N_k, Br, Bc)
    ((16, 8), None, 4, 4),        # N a multiple of both blocks
    ((37, 8), None, 5, 7),        # N a multiple of neither
    ((10, 4), None, 10, 10),      # a single block
    ((10, 4), None, 32, 64),      # blocks larger than N: still one block
    ((9, 3), None, 1, 1),         # 1×1 tiles
    ((1, 5), None, 3, 2),         # N = 1
    ((2, 3, 33, 16), None, 8, 16),  # batch × heads leading dims
    ((20, 8), 13, 6, 4),          # cross attention, N_k ≠ N
    ((64, 64), None, 16, 32),     # realistic head dim
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape_q,n_k,br,bc", SHAPES)
def test_tiled_equals_standard_fp32(shape_q, n_k, br, bc, causal):
    q, k, v = _qkv(shape_q, n_k, seed=hash((shape_q, br, bc)) % 1000)
    tiled = tiled_attention(q, k, v, br, bc, causal=causal)
    std = standard_attention(q, k, v, causal=causal)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert tiled.shape == q.shape[:-1] + (v.shape[-1],)
    assert (tiled - std).abs().max().item() < 1e-5
    assert (tiled - sdpa).abs().max().item() < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_matches_rowwise_float64_reference(causal):
    q, k, v = _qkv((23, 6), dtype=torch.float64, seed=3)
    tiled = tiled_attention(q, k, v, 4, 5, causal=causal).numpy()
    assert np.abs(tiled - _softmax_reference(q, k, v, causal)).max() < 1e-12


def test_causal_first_row_is_first_value():
    # Row 0 may only see key 0, so its softmax weight is 1 and the output row is exactly v[0].
    q, k, v = _qkv((12, 4), seed=5)
    out = tiled_attention(q, k, v, 5, 3, causal=True)
    assert torch.allclose(out[0], v[0], atol=1e-6)
    # Without the mask row 0 is a real average: differs from v[0].
    assert (tiled_attention(q, k, v, 5, 3)[0] - v[0]).abs().max() > 1e-3


def test_large_scores_do_not_overflow():
    # Scores around 1000: exp(1000) overflows fp32; the running max keeps everything finite.
    q, k, v = _qkv((17, 4), seed=7)
    q = q * 300.0
    out = tiled_attention(q, k, v, 4, 4)
    assert torch.isfinite(out).all()
    assert (out - standard_attention(q, k, v)).abs().max().item() < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_final_statistics_equal_full_row_max_and_sum(causal):
    q, k, v = _qkv((29, 8), seed=11)
    _, m, l = tiled_attention(q, k, v, 6, 4, causal=causal, return_stats=True)
    s = (q @ k.T) / math.sqrt(8)
    if causal:
        s = s.masked_fill(torch.triu(torch.ones(29, 29, dtype=torch.bool), 1), float("-inf"))
    row_max = s.max(dim=-1).values
    row_sum = torch.exp(s - row_max[:, None]).sum(dim=-1)
    assert torch.allclose(m, row_max, atol=1e-6)
    assert torch.allclose(l, row_sum, rtol=1e-5)


# ------------------------------------------------------------------------------------------ the trace


@pytest.mark.parametrize("order", ["kv_outer", "q_outer"])
@pytest.mark.parametrize("causal", [False, True])
def test_trace_exact_and_statistics(order, causal):
    q, k, v = _qkv((13, 4), seed=2)
    tr = trace_tiled_attention(q, k, v, 4, 3, causal=causal, order=order)
    assert tr.max_abs_diff < 1e-5
    assert np.allclose(tr.m_final, tr.row_max, atol=1e-6)
    assert np.allclose(tr.l_final, tr.row_sum, rtol=1e-5)
    # T_r = ⌈13/4⌉ = 4, T_c = ⌈13/3⌉ = 5.
    assert (tr.t_r, tr.t_c) == (4, 5)
    # Visited tiles agree with the traffic model's count (both derived independently).
    assert len(tr.steps) == flash_traffic(13, 4, 4, 3, causal=causal).tiles
    assert (tr.grid >= 0).sum() == len(tr.steps)


def test_trace_causal_skips_upper_tiles():
    # N = 8, Br = Bc = 4: tiles (0,0), (1,0), (1,1) visited; (0,1) has rows 0–3 vs cols 4–7, all masked.
    q, k, v = _qkv((8, 2), seed=1)
    tr = trace_tiled_attention(q, k, v, 4, 4, causal=True, order="q_outer")
    assert tr.grid.tolist() == [[0, -1], [1, 2]]


def test_trace_steps_follow_online_softmax():
    q, k, v = _qkv((10, 3), seed=4)
    tr = trace_tiled_attention(q, k, v, 5, 4, order="q_outer")
    for st in tr.steps:
        # m_new = max(m_old, m̃) and ℓ_new = e^{m_old−m_new} ℓ_old + e^{m̃−m_new} ℓ̃ (Algorithm 1, line 11).
        assert np.allclose(st.m_after, np.maximum(st.m_before, st.m_tile))
        with np.errstate(invalid="ignore"):
            expect_l = (np.nan_to_num(np.exp(st.m_before - st.m_after)) * st.l_before
                        + np.exp(st.m_tile - st.m_after) * st.l_tile)
        assert np.allclose(st.l_after, expect_l, rtol=1e-6)
        # In q_outer order, after K/V block j the rows hold exact attention over columns 0 … c1−1.
        r0, r1 = st.rows
        c1 = st.cols[1]
        partial = _softmax_reference(q[r0:r1], k[:c1], v[:c1], causal=False)
        # _softmax_reference scales by √d of q's width, which is the same d = 3.
        assert np.abs(st.out_after - partial).max() < 1e-5


def test_trace_kv_outer_order_visits_k_blocks_outside():
    q, k, v = _qkv((6, 2), seed=0)
    tr = trace_tiled_attention(q, k, v, 3, 2, order="kv_outer")
    assert [(s.i, s.j) for s in tr.steps] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    tr2 = trace_tiled_attention(q, k, v, 3, 2, order="q_outer")
    assert [(s.i, s.j) for s in tr2.steps] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert np.allclose(tr.output, tr2.output, atol=1e-6)


# ------------------------------------------------------------------------------------------ traffic


def test_standard_traffic_hand_computed():
    # N = 4, d = 2: Nd = 8, N² = 16.
    # reads: Q 8 + K 8 + S 16 + P 16 + V 8 = 56; writes: S 16 + P 16 + O 8 = 40; total 96 elements.
    t = standard_traffic(4, 2, bytes_per_element=2)
    assert t.read_elements == 56 and t.write_elements == 40
    assert t.elements == 96 and t.bytes == 192
    assert t.extra_elements == 32 and t.extra_bytes == 64  # S and P: 2·16


def test_flash_traffic_hand_computed_noncausal():
    # N = 4, d = 2, Br = Bc = 2: T_r = T_c = 2, 4 tiles of 2 rows.
    # init writes O 8, m/ℓ 8; K, V read once: 8 + 8;
    # per tile: read Q 4, O 4, m/ℓ 4; write O 4, m/ℓ 4.
    # reads = 16 (Q) + 8 + 8 + 16 (O) + 16 (m,ℓ) = 64; writes = (8+16) + (8+16) = 48; total 112.
    # Closed form 3Nd + 2N + T_c(3Nd + 4N) = 24 + 8 + 2·(24 + 16) = 112.
    t = flash_traffic(4, 2, 2, 2)
    assert t.reads == {"Q": 16, "K": 8, "V": 8, "O": 16, "m, ℓ": 16}
    assert t.writes == {"O": 24, "m, ℓ": 24}
    assert t.elements == 112 and t.bytes == 224 and t.tiles == 4
    assert t.extra_elements == 8  # m and ℓ: 2N


def test_flash_traffic_hand_computed_causal_uneven():
    # N = 5, d = 1, Br = 2, Bc = 3. Q blocks rows {0,1}, {2,3}, {4}; K/V blocks cols {0,1,2}, {3,4}.
    # j = 0: all three Q blocks (5 rows). j = 1 (cols from 3): block {0,1} fully masked, skip;
    # {2,3} and {4} visited (3 rows). Visited rows 8, tiles 5.
    # reads: Q 8, K 5, V 5, O 8, m/ℓ 16 = 42; writes: O 5 + 8 = 13, m/ℓ 10 + 16 = 26 → 39; total 81.
    t = flash_traffic(5, 1, 2, 3, causal=True)
    assert t.tiles == 5
    assert t.read_elements == 42 and t.write_elements == 39 and t.elements == 81
    assert t.bytes == 81 * 2


def _flash_traffic_by_loops(n, d, br, bc, causal):
    """Algorithm 1 executed literally, counting every load and store (independent of the engine)."""
    total = n * d + 2 * n  # line 2
    for j in range(math.ceil(n / bc)):
        c0 = j * bc
        total += 2 * (min(c0 + bc, n) - c0) * d  # line 6
        for i in range(math.ceil(n / br)):
            r0, r1 = i * br, min((i + 1) * br, n)
            if causal and r1 - 1 < c0:
                continue
            rows = r1 - r0
            total += 2 * rows * d + 2 * rows  # line 8
            total += rows * d + 2 * rows      # lines 12–13
    return total


@pytest.mark.parametrize("n,d,br,bc", [(1, 1, 1, 1), (7, 3, 2, 5), (100, 16, 16, 25), (129, 64, 64, 96),
                                       (50, 8, 64, 64), (33, 4, 1, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_traffic_closed_form_matches_loops(n, d, br, bc, causal):
    assert flash_traffic(n, d, br, bc, causal=causal).elements == _flash_traffic_by_loops(n, d, br, bc, causal)


def test_noncausal_flash_total_formula():
    # 3Nd + 2N + T_c(3Nd + 4N) with N = 1000, d = 32, Bc = 96 → T_c = ⌈1000/96⌉ = 11.
    # 96000 + 2000 + 11·(96000 + 4000) = 1,198,000.
    assert flash_traffic(1000, 32, 32, 96).elements == 1_198_000


def test_block_sizes_paper_formula():
    assert block_sizes(98304, 64) == (64, 384)   # ⌈98304/256⌉ = 384; Br = min(384, 64)
    assert block_sizes(1000, 64) == (4, 4)       # ⌈1000/256⌉ = 4
    assert block_sizes(10000, 8) == (8, 313)     # ⌈10000/32⌉ = 313 (312.5 rounded up)
    with pytest.raises(InputError):
        block_sizes(32, 64)                      # M < d: not one row fits


def test_sram_elements():
    assert sram_elements(192 * 1024, 2) == 98304
    assert sram_elements(192 * 1024, 4) == 49152


def test_paper_example_numbers():
    pc = paper_comparison()
    # A100 192 KiB in fp16 → M = 98304, Br = 64, Bc = 384 (T_c = 3, T_r = 16).
    assert (pc.flash.block_q, pc.flash.block_k) == (64, 384)
    # Standard per head: 4Nd + 4N² = 262,144 + 4,194,304 = 4,456,448 elements.
    assert pc.standard.elements == 4_456_448
    # Flash per head: 3Nd + 2N + 3(3Nd + 4N) = 196,608 + 2,048 + 3·200,704 = 800,768 elements.
    assert pc.flash.elements == 800_768
    # × 2 bytes × 1024 heads (16 heads × batch 64).
    assert pc.heads_total == 1024
    assert pc.model_standard_gb == pytest.approx(4_456_448 * 2 * 1024 / 1e9)  # 9.13 GB
    assert pc.model_flash_gb == pytest.approx(800_768 * 2 * 1024 / 1e9)       # 1.64 GB
    assert (pc.paper_standard_gb, pc.paper_flash_gb) == (40.3, 4.4)
    assert pc.model_ratio == pytest.approx(4_456_448 / 800_768)


def test_traffic_grows_quadratic_vs_linear_memory():
    c = traffic_curve([1024, 2048, 4096], 64, 192 * 1024, 2, batch_heads=3)
    # Extra memory: standard 2N²·2 B·3 heads, flash 2N·2 B·3 heads.
    assert c.standard_extra_bytes == [2 * n * n * 2 * 3 for n in (1024, 2048, 4096)]
    assert c.flash_extra_bytes == [2 * n * 2 * 3 for n in (1024, 2048, 4096)]
    assert c.standard_bytes[0] == standard_traffic(1024, 64).bytes * 3
    assert all(r > 1 for r in c.ratio)


def test_causal_flash_moves_less():
    assert flash_traffic(4096, 64, 64, 384, causal=True).elements < flash_traffic(4096, 64, 64, 384).elements


def test_presets_have_sources():
    a100 = HARDWARE_PRESETS["NVIDIA A100 (SXM4 40GB)"]
    assert a100.sram_kib == 192 and a100.sram_bytes == 196608
    for p in HARDWARE_PRESETS.values():
        assert p.source and p.max_shared_kib <= p.sram_kib


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n=8, d=4, block_q=16, block_k=4), "larger than the sequence length"),
    (dict(n=8, d=4, block_q=4, block_k=0), "between 1 and"),
    (dict(n=0, d=4, block_q=1, block_k=1), "Sequence length"),
    (dict(n=8, d=99, block_q=4, block_k=4), "Head dimension"),
    (dict(n=8, d=4, block_q=4, block_k=4, preset="TPU"), "Unknown hardware preset"),
    (dict(n=8, d=4, block_q=4, block_k=4, sram_kib=0), "positive"),
    (dict(n=8, d=4, block_q=4, block_k=4, sram_kib=1, curve_d=256), "does not fit"),
    (dict(n=8, d=4, block_q=4, block_k=4, order="diagonal"), "order"),
])
def test_flash_report_bad_input(kwargs, needle):
    with pytest.raises(InputError, match=needle):
        flash_report(**kwargs)


def test_trace_too_many_tiles():
    q, k, v = _qkv((64, 2))
    with pytest.raises(InputError, match="too many"):
        trace_tiled_attention(q, k, v, 1, 1)


def test_shape_errors():
    q, k, v = _qkv((8, 4))
    with pytest.raises(InputError):
        tiled_attention(q, k[:, :3], v[:, :3], 2, 2)
    with pytest.raises(InputError):
        tiled_attention(q, k, v[:5], 2, 2)
    with pytest.raises(InputError):
        tiled_attention(q, k, v, 0, 2)
    with pytest.raises(InputError):
        standard_traffic(0, 4)


def test_flash_report_ok():
    r = flash_report(20, 8, 6, 7, causal=True, curve_n_max=4096)
    assert r.trace.max_abs_diff < 1e-5
    assert r.curve.ns == [128, 256, 512, 1024, 2048, 4096]
    assert r.standard_at_n.n == 4096


# ------------------------------------------------------------------------------------------ measurement


def test_measure_attention_small():
    ms = measure_attention([32, 64], d=16, heads=1, repeats=1)
    assert [(m.n, m.method) for m in ms] == [(32, "naive"), (32, "fused"), (64, "naive"), (64, "fused")]
    assert all(m.ms > 0 and m.max_abs_diff < 1e-5 for m in ms)
    # naive predicted extra: S and P 2·N²·4 B + output N·d·4 B = 2·4096·4 + 64·16·4 = 36,864 for N = 64.
    assert ms[2].predicted_extra_bytes == 36_864


def test_measure_attention_stops_before_memory_limit():
    # N = 64 needs 2·64²·4 + 64·4·4 = 33,792 B; N = 4096 would need ~134 MB > 1 MB limit: stop.
    ms = measure_attention([64, 4096], d=4, heads=1, repeats=1, memory_limit_bytes=1_000_000)
    assert {m.n for m in ms} == {64}


def test_measured_memory_follows_the_model():
    # N = 512, 2 heads, d = 16: naive keeps S and P alive, 2·2·512²·4 B = 4,194,304 B (+ 65,536 B output);
    # the fused kernel only allocates the output, 2·512·16·4 = 65,536 B.
    ms = measure_attention([512], d=16, heads=2, repeats=1)
    naive, fused = ms
    assert naive.predicted_extra_bytes == 4_194_304 + 65_536
    assert 0.8 * naive.predicted_extra_bytes < naive.peak_extra_bytes < 1.2 * naive.predicted_extra_bytes
    assert fused.peak_extra_bytes < naive.peak_extra_bytes / 4
