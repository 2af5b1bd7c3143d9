"""The compute path (engine/decoding/compute/): choice, override, self-check, fallback, exactness."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.decoding import compute
from engine.decoding.compute import (ComputePath, OneDNNLinear, apply_path, choose_path, parse_override, path_of,
                                     use_path)
from engine.errors import InputError
from tests.conftest import ROOT
from tests.tiny_models import save_tiny_llama

needs_onednn = pytest.mark.skipif(compute.onednn._ONEDNN_OP is None,
                                  reason="this PyTorch build has no oneDNN linear op")

needs_reorder = pytest.mark.skipif(compute.onednn._REORDER_OP is None or compute.onednn._ONEDNN_OP is None,
                                   reason="this PyTorch build has no oneDNN weight reorder op")


def _lin(out_f=7, in_f=5, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


def test_parse_override_accepts_the_three_choices_and_names_them_on_error():
    assert parse_override(None) == "auto"
    assert parse_override("") == "auto"
    assert parse_override(" OneDNN ") == "onednn"
    assert parse_override("default") == "default"
    with pytest.raises(InputError, match=r"'mkl'.*auto, default, onednn"):
        parse_override("mkl")


@needs_onednn
def test_onednn_linear_matches_f_linear_for_1_to_16_rows_with_and_without_bias():
    for bias in (True, False):
        lin = _lin(bias=bias)
        ref = [F.linear(torch.randn(1, r, 5, generator=torch.Generator().manual_seed(r)), lin.weight, lin.bias)
               for r in (1, 2, 3, 9, 16)]
        apply_path(lin, "onednn")
        assert type(lin) is OneDNNLinear
        with torch.inference_mode():
            got = [lin(torch.randn(1, r, 5, generator=torch.Generator().manual_seed(r))) for r in (1, 2, 3, 9, 16)]
        for a, b in zip(got, ref):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)
        with torch.inference_mode():  # 2D inputs too
            torch.testing.assert_close(lin(torch.ones(3, 5)), F.linear(torch.ones(3, 5), lin.weight, lin.bias))


@needs_onednn
def test_apply_path_switches_back_and_keeps_the_state_dict_and_training():
    lin = _lin()
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    apply_path(lin, "onednn")
    assert path_of(lin) == "onednn"
    assert lin.state_dict().keys() == before.keys()
    # with autograd on, the layer takes F.linear and gradients flow
    x = torch.randn(2, 5)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, x.sum(0).expand(7, 5))
    apply_path(lin, "default")
    assert type(lin) is nn.Linear and path_of(lin) == "default"
    with pytest.raises(InputError):
        apply_path(lin, "fast")


def test_subclasses_with_their_own_forward_are_left_alone():
    class Special(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0

    m = nn.Sequential(Special(3, 3), nn.Linear(3, 3))
    apply_path(m, "onednn")
    assert type(m[0]) is Special
    apply_path(m, "default")


@needs_onednn
def test_self_check_passes_and_reports_a_disagreeing_kernel(monkeypatch):
    m = nn.Sequential(_lin(), _lin(5, 7))
    assert compute.self_check(m) is None
    monkeypatch.setattr(compute.onednn, "_ONEDNN_OP", lambda x, w, b, *a: F.linear(x, w, b) + 1e-2)
    msg = compute.self_check(m)
    assert msg and "disagreed" in msg and "7×5" in msg


def test_missing_onednn_falls_back_to_default_and_says_why(monkeypatch, tmp_path):
    path = save_tiny_llama(tmp_path / "tiny")
    from engine.decoding.models import load_model

    monkeypatch.setattr(compute.onednn, "_ONEDNN_OP", None)
    lm = load_model(str(path), device="cpu", compute="auto")
    assert lm.compute.path == "default" and "fallback" in lm.compute.reason and "oneDNN" in lm.compute.reason
    assert path_of(lm.model) == "default"
    forced = load_model(str(path), device="cpu", compute="onednn")  # even when forced: never a broken path
    assert forced.compute.path == "default"


def test_override_forces_each_path_and_a_bad_one_is_a_clear_error(monkeypatch, tmp_path):
    path = save_tiny_llama(tmp_path / "tiny")
    from engine.decoding.models import load_model

    lm = load_model(str(path), device="cpu", compute="default")
    assert lm.compute.path == "default" and "override" in lm.compute.reason
    assert path_of(lm.model) == "default"
    if compute.onednn._ONEDNN_OP is not None:
        monkeypatch.setenv(compute.ENV_VAR, "onednn")
        lm = load_model(str(path), device="cpu")
        assert lm.compute.path == "onednn" and path_of(lm.model) == "onednn"
    monkeypatch.setenv(compute.ENV_VAR, "turbo")
    with pytest.raises(InputError, match="turbo"):
        load_model(str(path), device="cpu")


@needs_onednn
def test_auto_measures_both_paths_once_and_remembers_the_choice(tmp_path, monkeypatch):
    path = save_tiny_llama(tmp_path / "tiny", hidden=48)  # a shape no other test measures
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    store = tmp_path / "paths.json"
    monkeypatch.setattr(compute.choice, "_MEMO", {})
    calls = []
    real = compute.measure_paths
    monkeypatch.setattr(compute.choice, "measure_paths", lambda m, **kw: calls.append(1) or real(m, **kw))
    choice = choose_path(model, "auto", store=store)
    offered = {"default", "onednn"} | ({"stream"} if compute.stream_kernel() is not None else set())
    assert set(choice.pass_ms) == offered and choice.path in compute.PATHS
    best = min(choice.pass_ms, key=lambda p: sum(choice.pass_ms[p].values()))
    assert choice.path == best and choice.reason.startswith("measured")
    saved = json.loads(store.read_text())
    assert len(saved) == 1 and next(iter(saved.values()))["path"] == choice.path
    assert compute.cpu_model() in next(iter(saved))
    # a new process (empty memo) reads the stored choice instead of measuring again
    monkeypatch.setattr(compute.choice, "_MEMO", {})
    again = choose_path(model, "auto", store=store)
    # the streaming kernel's row limit is timed once more when the kernel won, else not at all
    assert again.path == choice.path and "earlier" in again.reason and len(calls) == 1 + (choice.path == "stream")
    assert again.stream_rows == choice.stream_rows
    if choice.path == "stream":
        assert set(choice.rows_ms) == {"stream", "onednn"} and "rows:" in choice.reason
        assert choice.stream_rows in (4,) + compute.STREAM_ROW_CANDIDATES


def test_non_fp32_and_weightless_models_keep_the_default():
    m = nn.Linear(4, 4).to(torch.bfloat16)
    assert choose_path(m, "onednn").path == "default"
    assert choose_path(nn.ReLU(), "auto").path == "default"


def test_label_is_short_and_names_the_path():
    c = ComputePath("onednn", "measured: 1.82× faster than default (1-/4-token pass: …)", "AMD EPYC", 2)
    assert c.label() == "oneDNN (measured: 1.82× faster than default)"
    assert ComputePath("default", "forced by override", "x", 1).label().startswith("PyTorch default")
    assert ComputePath("stream", "forced by override", "x", 1, extra_bytes=31_850_496).label().endswith(
        "(forced by override; compact copies of weights (the blocks the kernel reads): +32 MB)")
    assert ComputePath("stream", "forced by override", "x", 1, extra_bytes=31_850_496,
                       packable_bytes=538_060_032).label().endswith(
        "(forced by override; compact copies of weights (the blocks the kernel reads): +32 MB; packed copies for products of ≥ 17 rows, "
        "made on first use: up to +538 MB)")
    formats = {"count": {"q41": 120, "q8": 1, "fp32": 0}, "read_bytes": 104_000_000, "fp32_bytes": 538_000_000}
    assert ComputePath("stream", "forced by override", "x", 1, formats=formats).label() == (
        "streaming kernel (≤ 16 rows) + oneDNN (forced by override; weights read as GGUF Q4_1 blocks (120 matrices) "
        "and Q8_0 blocks (1 matrix) rebuilt exactly to fp32 and multiplied in fp32 (the fp32 model's own numbers): 104 MB a token instead of 538 as fp32)")
    assert ComputePath("stream", "x", "x", 1, formats={"count": {"fp32": 3}, "read_bytes": 4_000_000,
                                                       "fp32_bytes": 4_000_000}).formats_label() == (
        "weights read as fp32: 4 MB a token")


@needs_reorder
def test_use_path_says_what_the_packed_copies_would_cost(tmp_path):
    """``use_path`` on a fast path sets ``packable_bytes``: every fast layer's fp32 weight once (a fused group's
    stacked weight once, the tied LM head once); the default path packs nothing."""
    from transformers import AutoModelForCausalLM

    from engine.decoding.compute import use_path

    model = AutoModelForCausalLM.from_pretrained(str(save_tiny_llama(tmp_path / "tiny", layers=2))).eval()
    # every linear's weight: all 2-D parameters but the token embedding, which is the LM head's when tied
    want = 4 * sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    if model.config.tie_word_embeddings:
        want += 4 * model.get_output_embeddings().weight.numel()
    try:
        got = use_path(model, ComputePath("onednn", "forced by override", "x", 1))
        assert got.packable_bytes == want > 0
        with torch.inference_mode():
            model(torch.arange(3, 3 + compute.PACK_MIN_ROWS)[None])  # every layer's big product (the head's last row)
        assert 0 < compute.packed_bytes(model) <= got.packable_bytes
        assert use_path(model, ComputePath("default", "forced by override", "x", 1)).packable_bytes == 0
    finally:
        apply_path(model, "default")


@needs_onednn
def test_greedy_speculative_output_identical_under_each_path(tmp_path):
    """Exactness does not depend on the path: the head-free drafts on a tiny target, both paths."""
    from engine.decoding.models import load_model
    from engine.decoding.drafts import make_proposer
    from engine.decoding.speculative import generate

    path = save_tiny_llama(tmp_path / "tiny", layers=3)
    outs = {}
    for p in compute.PATHS:
        lm = load_model(str(path), device="cpu", compute=p)
        ids = lm.tokenizer.encode("w1 w2 w3 w1 w2", return_tensors="pt")[0].tolist()
        plain = generate(lm, None, ids, gamma=3, max_new_tokens=24).token_ids
        for spec in ("ngram", "early-exit:1"):
            res = generate(lm, make_proposer(spec, lm), ids, gamma=3, max_new_tokens=24)
            assert res.token_ids == plain, (p, spec)
        outs[p] = plain
    assert outs["default"] == outs["onednn"] == outs["stream"]


def test_cli_bad_compute_value_is_one_error_line():
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", "hi", "--compute", "fastest"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: Unknown compute path 'fastest'")
    assert "Traceback" not in r.stderr


@needs_onednn
def test_sibling_fusion_keeps_outputs_weights_and_memory(tmp_path):
    """q/k/v and gate/up run as one product each; the layers' weights are views into it (no extra memory),
    the state dict is unchanged, and the model's logits equal the unfused oneDNN path's within fp32."""
    from transformers import AutoModelForCausalLM

    from engine.decoding.compute import FusedFollowerLinear, FusedLeadLinear

    path = save_tiny_llama(tmp_path / "tiny", layers=2)
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.inference_mode():
        ref = model(ids).logits
    apply_path(model, "onednn")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert type(attn.q_proj) is FusedLeadLinear and type(attn.v_proj) is FusedFollowerLinear
    assert type(mlp.gate_proj) is FusedLeadLinear and type(mlp.up_proj) is FusedFollowerLinear
    assert type(mlp.down_proj) is OneDNNLinear
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj._fused_weight.untyped_storage().data_ptr()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.inference_mode():
        got = model(ids).logits
        # a follower called on another input computes on its own
        x = torch.randn(1, 2, attn.q_proj.in_features)
        attn.q_proj(x)
        y = torch.randn(1, 2, attn.q_proj.in_features)
        torch.testing.assert_close(attn.k_proj(y), F.linear(y, attn.k_proj.weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    stacked = attn.q_proj._fused_weight
    apply_path(model, "onednn")  # applying again is harmless
    apply_path(model, "default")
    assert path_of(model) == "default" and type(attn.q_proj) is nn.Linear
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
    # switching back reuses the stacked weight (no new copy); a weight replaced meanwhile is stacked anew
    apply_path(model, "onednn")
    assert attn.q_proj._fused_weight is stacked
    apply_path(model, "default")
    with torch.no_grad():
        attn.k_proj.weight.data = attn.k_proj.weight.detach().clone() * 2
    apply_path(model, "onednn")
    assert attn.q_proj._fused_weight is not stacked
    q, k = attn.q_proj.out_features, attn.k_proj.out_features
    assert torch.equal(attn.q_proj._fused_weight[q:q + k], stacked[q:q + k] * 2)
    assert attn.k_proj.weight.data_ptr() == attn.q_proj._fused_weight[q].data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.data = stacked[q:q + k].clone()
    apply_path(model, "default")
    apply_path(model, "onednn")
    # training after a fused inference: autograd takes F.linear on the (viewed) weights
    apply_path(model, "onednn")
    model(ids).logits.sum().backward()
    assert attn.k_proj.weight.grad is not None


needs_stream = pytest.mark.skipif(compute.stream_kernel() is None,
                                  reason=f"no streaming kernel here: {compute.stream_problem()}")


@needs_stream
def test_streaming_kernel_matches_f_linear_for_odd_shapes_rows_and_bias():
    """K not a multiple of 16 (the scalar tail), N not a multiple of the weight-row block (3 or 4: the last rows),
    0..24 rows (one pass of 1-12 rows with 3 or 2 weight rows per block; from 13, tiles of 4 weight rows against
    blocks of 6 input rows and the 1-5 row tails, the last N % 4 weight rows one at a time), bias."""
    op = compute.stream_kernel()
    gen = torch.Generator().manual_seed(3)
    for n_out, n_in in ((7, 5), (13, 37), (11, 40), (64, 48), (9, 576), (14, 576)):
        w = torch.randn(n_out, n_in, generator=gen)
        b = torch.randn(n_out, generator=gen)
        for rows in range(25):
            x = torch.randn(rows, n_in, generator=gen)
            for bias in (None, b):
                got = op(x, w, bias)
                assert got.shape == (rows, n_out)
                # fp32 sums of up to 576 products of N(0, 1) values (|y| ~ 24) in another order than MKL's
                torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="fp32"):
        op(torch.ones(1, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64), None)


@needs_stream
def test_streaming_kernel_gives_a_row_the_same_bits_whatever_rows_share_the_call():
    """Batch invariance: row i of a call over 1..24 rows is bit-identical to row i alone (the summation order
    does not depend on the row count, the register blocking chosen for it, or the thread split)."""
    op = compute.stream_kernel()
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(301, 576, generator=gen)
    x = torch.randn(24, 576, generator=gen)
    alone = torch.cat([op(x[i:i + 1], w, None) for i in range(24)])
    for rows in range(2, 25):
        assert torch.equal(op(x[:rows], w, None), alone[:rows]), rows


needs_compact = pytest.mark.skipif(compute.stream_kernel() is None or compute.extension._STREAM.get("compact") is None,
                                   reason="no compact-weight entries in this kernel build (AVX-512, or AVX2 with F16C and FMA)")


def _q8_exact(n, k, gen):
    """A weight that is exactly int8 × one fp16-valued scale per block of 32 (as a dequantized GGUF Q8_0 tensor),
    every block's largest |q| 127; and its (q, scales)."""
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q[..., 0] = torch.where(torch.rand(n, k // 32, generator=gen) < 0.5, -127.0, 127.0)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half().float()
    return (q * d[..., None]).view(n, k), q.to(torch.int8).view(n, k), d


@needs_compact
def test_compact_weights_give_the_fp32_weights_bits_for_every_row_count():
    """The fp16 and int8-block entries compute exactly what the fp32 kernel computes on the weights they hold:
    torch.equal for 0-24 rows (one pass and the blocked schedule), with and without bias. K must be whole vectors of 16
    (a scalar tail compiled for each form added in other orders: K = 40 differed in the last bits)."""
    stream = compute.extension._STREAM
    op, f16, q8 = stream["op"], stream["compact"]["f16"], stream["compact"]["q8"]
    gen = torch.Generator().manual_seed(11)
    for n, k in ((7, 16), (9, 48), (301, 576), (64, 1536)):
        w16 = torch.randn(n, k, generator=gen).half()
        b = torch.randn(n, generator=gen)
        for rows in range(25):
            x = torch.randn(rows, k, generator=gen)
            for bias in (None, b):
                assert torch.equal(f16(x, w16, bias), op(x, w16.float(), bias)), (n, k, rows)
    for n, k in ((5, 32), (301, 576), (64, 1536)):
        w, q, d = _q8_exact(n, k, gen)
        b = torch.randn(n, generator=gen)
        for rows in range(25):
            x = torch.randn(rows, k, generator=gen)
            for bias in (None, b):
                assert torch.equal(q8(x, q, d, bias), op(x, w, bias)), (n, k, rows)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q8(torch.ones(1, 40), torch.zeros(3, 40, dtype=torch.int8), torch.ones(3, 1), None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        f16(torch.ones(1, 40), torch.zeros(3, 40, dtype=torch.half), None)


@needs_compact
def test_q8_check_in_pieces_is_the_whole_check():
    """_exact_q8 checks a weight a few rows at a time: every piece's values and scales land in place, and one
    inexact value in any piece (the last one included) rejects the whole weight."""
    gen = torch.Generator().manual_seed(5)
    w, q, d = _q8_exact(7, 64, gen)
    for rows in (1, 2, 3, 7, 1024):
        got = compute.formats._exact_q8(w, rows=rows)
        assert got is not None and torch.equal(got[0], q) and torch.equal(got[1], d)
        for r in (0, 6):  # the first piece, the last piece
            off = w.clone()
            off[r, 40] += 1e-7 * float(off[r, 40].abs() + 1)
            assert compute.formats._exact_q8(off, rows=rows) is None
    nan = w.clone()
    nan[4, 3] = float("nan")
    assert compute.formats._exact_q8(nan, rows=2) is None
    zero = torch.zeros(3, 32)  # an all-zero block: scale 0, values 0
    got = compute.formats._exact_q8(zero, rows=2)
    assert got is not None and not got[0].any() and not got[1].any()


def _q41_exact(n, k, gen):
    """A weight dequantized from GGUF Q4_1 blocks as gguf does it (fp16 d and m, codes 0-15, ``d * q + m`` in
    fp32), each block holding code 0 (its minimum) and 15 (its maximum) as a Q4_1 quantizer's blocks do; and
    (codes, d, m)."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 3], q[..., 7] = 0, 15
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half().float()
    m = (torch.randn(n, k // 32, generator=gen) * 0.1).half().float()
    return (q * d[..., None] + m[..., None]).view(n, k), q.view(n, k), d, m


def _unpack_q41(codes, k):
    """Codes [n, k / 2] packed as the kernel reads them → [n, k] values 0-15 in order."""
    g = codes.view(codes.shape[0], k // 32, 16)
    return torch.stack([g & 0x0F, g >> 4], 2).view(codes.shape[0], k).float()


@needs_compact
def test_q41_blocks_give_the_fp32_weights_bits_for_every_row_count():
    """The Q4_1 entry computes exactly what the fp32 kernel computes on the weights it holds (torch.equal, 0-24, 33
    and 64 rows, with and without bias): it rebuilds each fp32 weight d · q + m in registers and adds in the same order."""
    op = compute.extension._STREAM["op"]
    q41 = compute.extension._STREAM["compact"]["q41"]
    gen = torch.Generator().manual_seed(41)
    for n, k in ((5, 32), (301, 576), (64, 1536)):
        w, q, d, m = _q41_exact(n, k, gen)
        got = compute.formats._exact_q41(w)
        assert got is not None
        codes, scales, mins = got
        assert torch.equal(_unpack_q41(codes, k) * scales.repeat_interleave(32, 1) + mins.repeat_interleave(32, 1), w)
        b = torch.randn(n, generator=gen)
        for rows in [*range(25), 33, 64]:  # one pass up to 12 rows, tiles above (a room's passes)
            x = torch.randn(rows, k, generator=gen)
            for bias in (None, b):
                assert torch.equal(q41(x, codes, scales, mins, bias), op(x, w, bias)), (n, k, rows)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q41(torch.ones(1, 48), torch.zeros(3, 24, dtype=torch.uint8), torch.ones(3, 1), torch.ones(3, 1), None)


@needs_compact
def test_q41_check_finds_the_blocks_and_rejects_any_value_off_them(monkeypatch):
    monkeypatch.setenv(compute.ARITHMETIC_ENV, "fp32")  # the exact form (the int8 arithmetic's: tests/test_int8.py)
    gen = torch.Generator().manual_seed(4)
    w, q, d, m = _q41_exact(9, 64, gen)
    codes, scales, mins = compute.formats._exact_q41(w)
    assert torch.equal(mins, m) and torch.equal(_unpack_q41(codes, 64), q)
    for r in (0, 8):  # one ulp off the grid in the first row and in the last
        off = w.clone()
        off[r, 40] = torch.nextafter(off[r, 40], torch.tensor(float("inf")))
        assert compute.formats._exact_q41(off) is None
    for bad in (float("nan"), float("inf")):
        off = w.clone()
        off[4, 3] = bad
        assert compute.formats._exact_q41(off) is None
    assert compute.formats._exact_q41(torch.randn(4, 32, generator=gen)) is None
    const = torch.full((2, 32), 0.25)  # a constant block: d 0, every code 0
    got = compute.formats._exact_q41(const)
    assert got is not None and not got[0].any() and torch.equal(got[2], torch.full((2, 1), 0.25))
    assert compute.compact_weight(w) == "q41"
    form = w.__dict__[compute.COMPACT_ATTR]
    assert form.nbytes == 9 * 64 // 2 + 2 * 9 * 2 * 4  # 0.75 bytes a value


def test_compact_form_is_found_only_where_exact_and_dropped_when_the_weight_changes(monkeypatch):
    monkeypatch.setenv(compute.ARITHMETIC_ENV, "fp32")  # the exact forms (the int8 arithmetic's: tests/test_int8.py)
    gen = torch.Generator().manual_seed(12)
    exact16 = torch.randn(9, 48, generator=gen).half().float()
    exact8, q, d = _q8_exact(6, 64, gen)
    assert compute.compact_weight(exact16) == "f16"
    assert compute.compact_weight(exact8) == "q8"
    form = exact8.__dict__[compute.COMPACT_ATTR]
    assert torch.equal(form.tensors[0], q) and torch.equal(form.tensors[1], d) and form.nbytes == 6 * 64 + 6 * 2 * 4
    not_exact = exact8.clone()
    not_exact[3, 17] += 1e-7 * float(not_exact[3, 17].abs() + 1)  # one value off the int8 grid
    assert compute.compact_weight(not_exact) is None
    assert compute.compact_weight(torch.randn(4, 32, generator=gen)) is None
    assert compute.compact_weight(exact16[:, :40].contiguous()) is None  # K = 40: not whole vectors of 16
    signed_zero = torch.zeros(2, 32)
    signed_zero[1, 5] = -0.0
    assert compute.compact_weight(signed_zero) == "f16"  # -0.0 is an fp16 value, sign kept
    with torch.inference_mode():
        assert compute.compact_weight(torch.ones(2, 32)) is None  # no version counter to watch
    # a layer on the stream path reads its compact form, and its fp32 weight again once the weight changes
    lin = nn.Linear(48, 9)
    with torch.no_grad():
        lin.weight.copy_(exact16)
    monkeypatch.setitem(compute.extension._STREAM, "max_rows", 16)
    apply_path(lin, "stream")
    try:
        assert lin.weight.__dict__[compute.COMPACT_ATTR].kind == "f16"
        assert compute.compact_bytes(lin) == 9 * 48 * 2
        calls = []
        real = compute.extension._STREAM["compact"]["f16"]
        monkeypatch.setitem(compute.extension._STREAM, "compact", {**compute.extension._STREAM["compact"],
                                                                   "f16": lambda *a: calls.append(1) or real(*a)})
        lin.weight.__dict__[compute.COMPACT_ATTR] = compute.CompactWeight(
            "f16", lin.weight.__dict__[compute.COMPACT_ATTR].tensors, compute.extension._STREAM["compact"]["f16"],
            lin.weight.data_ptr(), lin.weight._version)
        x = torch.randn(3, 48, generator=gen)
        with torch.inference_mode():
            assert torch.equal(lin(x), compute.extension._STREAM["op"](x, exact16, lin.bias)) and calls == [1]
        with torch.no_grad():
            lin.weight.mul_(1.5)  # the compact form is stale now
        with torch.inference_mode():
            assert torch.equal(lin(x), compute.extension._STREAM["op"](x, exact16 * 1.5, lin.bias)) and calls == [1]
    finally:
        apply_path(lin, "default")


@needs_stream
def test_stream_path_routes_few_rows_to_the_kernel_and_more_to_onednn(monkeypatch):
    lin = _lin(9, 20)
    apply_path(lin, "stream")
    try:
        assert type(lin) is OneDNNLinear and path_of(lin) == "stream"
        calls = []
        real = compute.extension._STREAM["op"]
        # an earlier load may have left its measured limit
        monkeypatch.setitem(compute.extension._STREAM, "max_rows", 16)
        monkeypatch.setitem(compute.extension._STREAM, "op", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
        with torch.inference_mode():
            for rows in (1, 16, 17, 40):
                x = torch.randn(1, rows, 20)
                torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compute.linear(torch.ones(20), lin.weight), lin.weight.sum(1))  # 1-D input
        assert calls == [1, 16, 1]
        assert compute.self_check(lin, kernel="stream") is None
        monkeypatch.setitem(compute.extension._STREAM, "op", lambda x, w, b: real(x, w, b) + 1e-2)
        msg = compute.self_check(lin, kernel="stream")
        assert msg and "streaming kernel disagreed" in msg
    finally:
        apply_path(lin, "default")


def test_stream_row_limit_is_the_largest_candidate_where_the_kernel_is_not_slower(monkeypatch):
    """``measure_stream_rows``'s rule on given timings (ms by tokens in the pass), and the limit it measures under
    (every candidate on the kernel) put back afterwards."""
    seen = []

    def timings(stream, onednn):
        def fake(model, tokens, reps, paths):
            seen.append(compute.extension._STREAM["max_rows"])
            return {"stream": dict(zip(tokens, stream)), "onednn": dict(zip(tokens, onednn))}
        return fake

    monkeypatch.setitem(compute.extension._STREAM, "max_rows", 16)
    cases = [  # (stream ms at 8, 12, 16, 24 tokens; oneDNN ms) → limit
        ((40.0, 52.6, 58.9, 80.5), (51.1, 54.2, 58.3, 63.9), 12),  # the Intel Xeon's (compute_xeon.md)
        ((30.0, 35.0, 40.0, 50.0), (31.0, 36.0, 41.0, 51.0), 24),  # never slower: the most tried
        ((30.0, 35.0, 40.0, 50.0), (29.0, 34.0, 39.0, 49.0), 4),   # slower at every candidate: 4 rows (the 4-token pass)
        ((30.0, 35.0, 40.0, 50.0), (29.0, 36.0, 41.0, 49.0), 16),  # the largest win counts, not the first
        ((30.0, 37.0, 40.0, 50.0), (31.0, 36.0, 41.0, 51.0), 24),  # one noisy loss (12) does not cut the limit
        ((74.8, 143.8, 131.2, 146.6), (126.0, 132.4, 138.5, 183.0), 24),  # a noisy day on an Intel Xeon
        ((30.0, 36.0, 40.0, 60.0), (31.0, 36.0, 39.0, 51.0), 12),  # a tie keeps the kernel; 16 and 24 lost
    ]
    for stream, onednn, want in cases:
        monkeypatch.setattr(compute.choice, "measure_paths", timings(stream, onednn))
        rows, ms = compute.measure_stream_rows(nn.Linear(2, 2))
        assert rows == want, (stream, onednn)
        assert ms["stream"][24] == stream[3]
    assert seen == [24] * len(cases) and compute.extension._STREAM["max_rows"] == 16


@needs_stream
def test_use_path_applies_the_measured_row_limit(monkeypatch):
    """A "stream" choice with a row limit of 3 sends 3-row products to the kernel and 4-row ones to oneDNN; the
    label names the limit."""
    lin = _lin(9, 20)
    monkeypatch.setitem(compute.extension._STREAM, "max_rows", 16)
    choice = ComputePath("stream", "measured: test", "cpu", 2, stream_rows=3)
    assert "≤ 3 rows" in choice.label()
    use_path(lin, choice)
    try:
        calls = []
        real = compute.extension._STREAM["op"]
        monkeypatch.setitem(compute.extension._STREAM, "op", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
        with torch.inference_mode():
            for rows in (1, 3, 4, 16):
                x = torch.randn(rows, 20)
                torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        assert calls == [1, 3] and compute.extension._STREAM["max_rows"] == 3
    finally:
        apply_path(lin, "default")


def test_stream_path_that_cannot_be_built_falls_back_and_says_why(monkeypatch, tmp_path):
    path = save_tiny_llama(tmp_path / "tiny")
    from engine.decoding.models import load_model

    monkeypatch.setattr(compute.extension, "_STREAM", {"tried": True, "op": None, "problem": "no C++ compiler (test)"})
    lm = load_model(str(path), device="cpu", compute="stream")
    assert lm.compute.path in ("onednn", "default") and "no C++ compiler (test)" in lm.compute.reason
    assert parse_override("STREAM") == "stream"


@needs_stream
def test_built_kernel_is_imported_directly_and_a_stale_build_lock_is_removed(monkeypatch, tmp_path):
    """Once built, a process imports the library without a build (no progress message); a build lock left by a
    killed build (older than STALE_LOCK_S) is removed before building, instead of waiting on it forever."""
    import os
    import time
    from types import SimpleNamespace

    from torch.utils import cpp_extension

    msgs = []
    monkeypatch.setattr(compute.extension, "_STREAM", {"tried": False, "op": None, "problem": None, "name": ""})
    assert compute.stream_kernel(msgs.append) is not None and msgs == []
    name = compute.extension._STREAM["name"]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / name / "lock"
    lock.parent.mkdir()
    lock.touch()
    old = time.time() - compute.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    seen = []
    monkeypatch.setattr(cpp_extension, "load",
                        lambda **kw: seen.append(lock.exists()) or SimpleNamespace(small_linear=F.linear))
    monkeypatch.setattr(compute.extension, "_STREAM", {"tried": False, "op": None, "problem": None, "name": ""})
    assert compute.stream_kernel(msgs.append) is F.linear
    assert seen == [False] and len(msgs) == 1 and msgs[0].startswith("Building")


def _passes(model):
    """Logits of the passes the engine runs: a prefill, cached 1- and 3-token passes, a token tree under a
    custom 4D mask, and a padded batch of two rows."""
    from transformers import DynamicCache

    from engine.decoding.attention import fed_visibility, model_mask, tree_visibility

    out = []
    with torch.inference_mode():
        cache = DynamicCache()
        out.append(model(torch.tensor([[3, 4, 5, 6, 7, 8]]), cache=cache, use_cache=True).logits)
        out.append(model(torch.tensor([[9]]), cache=cache, use_cache=True).logits)
        out.append(model(torch.tensor([[10, 11, 12]]), cache=cache, use_cache=True).logits)
        cached = cache.get_seq_length()
        vis = fed_visibility(tree_visibility([-1, 0, 0, 1]), torch.ones(1, cached, dtype=torch.bool))
        pos = torch.tensor([[cached, cached + 1, cached + 1, cached + 2]])
        out.append(model(torch.tensor([[5, 6, 7, 8]]), cache=cache, use_cache=True, position_ids=pos,
                         attention_mask=model_mask(vis, model)).logits)
        mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
        out.append(model(torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]]), attention_mask=mask).logits)
    return out


@pytest.mark.parametrize("path,attn", [("onednn", "sdpa"), ("onednn", "eager"), ("stream", "sdpa")])
def test_lean_decoder_layers_give_the_same_bits_as_transformers_layers(tmp_path, path, attn):
    """On the fast paths Llama decoder layers run ``_lean_forward``: the same operations as transformers'
    layer in one function. Every pass the engine runs (prefill, cached chain, tree mask, padded batch) must
    give exactly the logits of transformers' own layers on the same fused products; the default path, and
    training on a fast path, keep transformers' forward."""
    from transformers import AutoModelForCausalLM

    if path == "stream" and compute.stream_kernel() is None:
        pytest.skip(f"no streaming kernel here: {compute.stream_problem()}")
    model = AutoModelForCausalLM.from_pretrained(str(save_tiny_llama(tmp_path / "tiny", layers=3)),
                                                 attn_implementation=attn).eval()
    apply_path(model, path)
    layer = model.model.layers[0]
    assert type(layer).__name__ == "LeanLlamaDecoderLayer" and type(layer).forward.__name__ == "_lean_forward"
    lean = _passes(model)
    assert compute.lean._lean_layers(model, on=False) == 3  # transformers' layers, same fused products
    assert type(layer).__name__ == "LlamaDecoderLayer"
    ref = _passes(model)
    for got, want in zip(lean, ref):
        assert torch.equal(got, want)
    compute.lean._lean_layers(model, on=True)
    # training on a fast path: transformers' forward, gradients reach the weights
    model.train()
    model(torch.tensor([[3, 4, 5]])).logits.sum().backward()
    assert layer.self_attn.k_proj.weight.grad is not None and layer.mlp.up_proj.weight.grad is not None
    model.eval()
    apply_path(model, "default")
    assert type(layer).__name__ == "LlamaDecoderLayer" and path_of(model) == "default"


@needs_stream
def test_streaming_kernel_without_avx512_is_correct_and_batch_invariant():
    """The kernel's other blocking (1 weight row × 6 input rows, for CPUs without AVX-512, e.g. AVX2-only Intel and AMD
    machines) cannot run on CI's AVX-512 machine as built for it: build it for Haswell (AVX2, F16C and FMA, no AVX-512)
    and check it as the native build is checked: within fp32 tolerance of ``F.linear`` for row tails of both
    blockings, a row's bits do not depend on which rows share the call, and its compact weights (fp16, Q8_0, Q4_1)
    give exactly its fp32 bits. (Its bits may differ from the AVX-512 build's: each machine uses one build.)"""
    import hashlib
    import platform
    from pathlib import Path

    from torch.utils import cpp_extension

    flags = (compute.extension._cpu_flags() or "").split()
    if platform.machine() not in ("x86_64", "AMD64") or "avx2" not in flags or "fma" not in flags:
        pytest.skip("not an x86 CPU with AVX2 and FMA")
    name = "speedup_lab_small_linear_avx2_" + hashlib.sha256(
        b"".join(f.read_bytes() for f in (*compute.KERNEL_SOURCES, *compute.extension.KERNEL_HEADERS))
        + torch.__version__.encode()).hexdigest()[:12]
    folder = Path(cpp_extension.get_default_build_root()) / name
    folder.mkdir(parents=True, exist_ok=True)
    mod = cpp_extension.load(name=name, sources=[str(f) for f in compute.KERNEL_SOURCES], build_directory=str(folder),
                             extra_cflags=["-O3", "-march=haswell", "-fopenmp"], extra_ldflags=["-fopenmp"])
    gen = torch.Generator().manual_seed(0)
    for n, k in [(7, 5), (13, 576), (15, 577), (960, 576), (576, 1536)]:
        w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        for m in (1, 3, 5, 9, 16):
            x = torch.randn(m, k, generator=gen)
            for bias in (None, b):
                y = mod.small_linear(x, w, bias)
                ref = F.linear(x, w, bias)
                assert float((y - ref).abs().max()) / max(1.0, float(ref.abs().max())) <= compute.TOLERANCE
                for i in range(m):
                    assert torch.equal(mod.small_linear(x[i:i + 1], w, bias)[0], y[i])
    # the compact weights of the same build (AVX2 with F16C and FMA reads them too): each form gives exactly the fp32
    # weights' bits of this build, for the row counts of a step, a verify pass, one pass of rows and blocks of rows
    assert mod.compact_supported()
    for n, k in [(13, 64), (300, 576), (64, 1536)]:
        w41, *_ = _q41_exact(n, k, gen)
        codes, scales, mins = mod.q41_pack(w41)
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
        q[..., 5] = 127  # each block's largest magnitude, as a Q8_0 quantizer's scale is chosen
        w8 = (q * torch.rand(n, k // 32, 1, generator=gen).half().float()).view(n, k)
        q8, s8 = compute.formats._exact_q8(w8)
        w16 = torch.randn(n, k, generator=gen).half()
        b = torch.randn(n, generator=gen)
        for m in (1, 2, 3, 5, 6, 7, 9, 16):
            x = torch.randn(m, k, generator=gen)
            for bias in (None, b):
                assert torch.equal(mod.small_linear_q41(x, codes, scales, mins, bias), mod.small_linear(x, w41, bias))
                assert torch.equal(mod.small_linear_q8(x, q8, s8, bias), mod.small_linear(x, w8, bias))
                assert torch.equal(mod.small_linear_f16(x, w16, bias), mod.small_linear(x, w16.float(), bias))
    # the decode attention of the same build: a row's bits alone equal its bits beside other rows
    for dim in (8, 64):
        q, k, v = (torch.randn(3, 6, 3, dim, generator=gen), torch.randn(3, 2, 40, dim, generator=gen),
                   torch.randn(3, 2, 40, dim, generator=gen))
        cols = torch.stack([torch.arange(40), torch.arange(40).flip(0), torch.randperm(40, generator=gen)])
        n_cols, n_fed = torch.tensor([40, 23, 9]), torch.tensor([3, 1, 2])
        out = mod.invariant_attention(q, k, v, cols, n_cols, n_fed, dim ** -0.5)
        for r in range(3):
            c, w = cols[r, :n_cols[r]], int(n_fed[r])
            alone = mod.invariant_attention(q[r:r + 1, :, :w], k[r:r + 1, :, c], v[r:r + 1, :, c],
                                            torch.arange(len(c))[None], n_cols[r:r + 1], n_fed[r:r + 1], dim ** -0.5)
            assert torch.equal(out[r:r + 1, :, :w], alone)


@needs_reorder
def test_big_products_run_on_a_packed_copy_with_the_dense_weights_bits(monkeypatch):
    """Products of ≥ PACK_MIN_ROWS rows read a packed copy made once (oneDNN's own layout): bit for bit what oneDNN
    gives on the dense weight; smaller products use the dense weight; a changed weight is packed again; inference
    tensors (no version counter) are never packed."""
    lin = _lin(96, 64, seed=3)
    apply_path(lin, "onednn")
    try:
        made = []
        real = compute.onednn._REORDER_OP
        monkeypatch.setattr(compute.onednn, "_REORDER_OP", lambda w: made.append(tuple(w.shape)) or real(w))
        dense = compute.onednn._ONEDNN_OP
        with torch.inference_mode():
            for rows in (compute.PACK_MIN_ROWS - 1, compute.PACK_MIN_ROWS, 48, 130):
                x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
                want = dense(x, lin.weight, lin.bias, "none", [], "")
                assert torch.equal(lin(x), want), rows
                assert torch.equal(lin(x[None]), want[None]), rows  # [1, rows, in] as the model calls it
        assert made == [(96, 64)]  # packed once, at the first big product
        assert compute.packed_bytes(lin) == 96 * 64 * 4
        with torch.no_grad():
            lin.weight.mul_(2)  # an in-place change: the copy is stale and made again
        with torch.inference_mode():
            x = torch.randn(40, 64)
            assert torch.equal(lin(x), dense(x, lin.weight, lin.bias, "none", [], ""))
        assert made == [(96, 64), (96, 64)]
        with torch.inference_mode():
            w = torch.randn(8, 64)  # an inference tensor
            x = torch.randn(32, 64)
            assert torch.equal(compute.linear(x, w), dense(x, w, None, "none", [], ""))
        assert len(made) == 2 and compute.PACKED_ATTR not in w.__dict__
    finally:
        apply_path(lin, "default")


@needs_onednn
def test_weights_mapped_from_the_checkpoint_are_copied_into_own_memory(tmp_path):
    """transformers maps .safetensors files; on a fast path every weight ends in the process's own memory (the
    mapping can go), with the same values and logits."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "tiny", layers=2)
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    ranges = compute.memory._file_ranges()
    mapped = [n for n, p in model.named_parameters() if any(lo <= p.data_ptr() < hi for lo, hi in ranges)]
    if not mapped:
        pytest.skip("this transformers build did not map the checkpoint")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.inference_mode():
        ref = model(ids).logits
    apply_path(model, "onednn")
    ranges = compute.memory._file_ranges()
    assert not [n for n, p in model.named_parameters() if any(lo <= p.data_ptr() < hi for lo, hi in ranges)]
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-4, atol=1e-4)
    assert compute.memory._own_memory(model) == 0  # nothing left to copy
    apply_path(model, "default")


@needs_compact
def test_a_path_applied_under_inference_mode_keeps_every_exact_compact_form(tmp_path):
    """The path choice times each path under ``torch.inference_mode`` (``measure_paths``), and applying a path copies
    weights still mapped from the checkpoint into own memory (``_own_memory``). Those copies must stay plain tensors:
    an inference tensor has no version counter, so ``compact_weight`` would leave it fp32, and the process that
    measured the path (the first load on a machine: ``python -m engine prepare``) would time its pass-cost curve on
    weights the later processes read in fewer bytes."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "tiny", layers=2, hidden=64)
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        for prm in model.parameters():  # fp16-exact values: every matrix has the exact "f16" compact form
            prm.copy_(prm.half().float())
    model.save_pretrained(tmp_path / "f16")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "f16")).eval()
    try:
        with torch.inference_mode():
            apply_path(model, "stream")
        assert not [n for n, p in model.named_parameters() if p.is_inference()]
        f = compute.weight_formats(model)
        assert f["count"].get("f16") and not f["count"].get("fp32"), f
    finally:
        apply_path(model, "default")


@needs_compact
@pytest.mark.slow
def test_the_embedded_models_layers_are_read_as_their_gguf_blocks(embedded):
    """On the stream path every layer matrix of the embedded model (Q4_1 in its GGUF) is read as its Q4_1 blocks and
    its LM head (Q8_0) as its Q8_0 blocks, in the forms of the process's arithmetic (int8: the repacked forms; fp32:
    the exact forms), about a fifth of the bytes (weight_formats)."""
    t = embedded
    if t.compute.path != "stream":  # the formats are the stream path's; another path makes no claim about them
        pytest.skip(f"this machine chose {t.compute.path} for the embedded model: {t.compute.reason}")
    f = compute.weight_formats(t.model)
    layers = t.config.num_hidden_layers
    x8 = "x8" if compute.arithmetic() == "int8" else ""
    assert f["count"].get(f"q41{x8}") == 4 * layers and f["count"].get(f"q8{x8}") == 1, f  # qkv, o, gate+up, down
    assert t.compute.arithmetic == compute.arithmetic()
    assert f["read_bytes"] < 0.25 * f["fp32_bytes"]
    assert "GGUF Q4_1 blocks" in t.compute.label()


def test_weights_read_as_fp32_on_request(monkeypatch):
    """``SPEEDUP_LAB_WEIGHTS=fp32`` reads every weight as fp32 (no compact form), for measuring what bytes cost; the
    measurements of this machine's passes are keyed by it; another value is a clear error."""
    gen = torch.Generator().manual_seed(7)
    exact16 = torch.randn(4, 32, generator=gen).half().float()
    monkeypatch.setenv(compute.WEIGHT_FORMAT_ENV, "fp32")
    assert compute.weight_format() == "fp32" and compute.compact_weight(exact16) is None
    assert "|weights=fp32|" in compute.measure_key()
    monkeypatch.setenv(compute.WEIGHT_FORMAT_ENV, "q2")
    with pytest.raises(InputError, match="SPEEDUP_LAB_WEIGHTS must be one of blocks, fp32"):
        compute.weight_format()
    monkeypatch.delenv(compute.WEIGHT_FORMAT_ENV)
    assert compute.weight_format() == "blocks" and "|weights=blocks|" in compute.measure_key()
    monkeypatch.setenv(compute.ARITHMETIC_ENV, "fp32")  # the arithmetic keys the measurements too
    assert compute.measure_key().endswith("|arithmetic=fp32")
