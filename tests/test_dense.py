"""Released dense weights (engine/decoding/compute/dense.py): a loaded model's weights that the streaming kernel reads
from exact compact forms keep no fp32 storage; every product, the state dict and a switch to another path still see
the same values, bit for bit; weights off the grid and an embedding keep theirs; the embedded model's load peaks well
below a second copy of the model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.decoding import compute
from engine.decoding.compute import dense, extension, memory
from engine.decoding.compute.formats import is_released
from engine.decoding.models import load_model
from engine.decoding.proposers import CachedLM
from tests.conftest import ROOT
from tests.tiny_models import save_q41_exact_llama, save_tiny_llama

pytestmark = pytest.mark.skipif(compute.stream_kernel() is None or not extension._STREAM.get("compact"),
                                reason=f"no streaming kernel with compact forms here: {compute.stream_problem()}")


@pytest.fixture(scope="module")
def q41_path(tmp_path_factory):
    return save_q41_exact_llama(tmp_path_factory.mktemp("dense") / "m")


def _file_weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _layer_linears(model):
    return [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())


def test_loading_releases_every_exact_layer_weight_and_keeps_the_embedding(q41_path):
    t = load_model(str(q41_path), device="cpu", compute="stream")
    linears = _layer_linears(t.model)
    assert linears and all(is_released(m.weight) for m in linears)
    assert t.compute.released_bytes == sum(m.weight.numel() * 4 for m in linears) > 0
    assert dense.released_bytes(t.model) == t.compute.released_bytes
    assert "their fp32 copies not kept" in t.compute.label()
    emb = t.model.get_input_embeddings().weight
    assert emb.is_contiguous() and not is_released(emb)
    assert all(not m.weight.requires_grad for m in linears)


def test_every_pass_gives_the_bits_of_the_fp32_weights(q41_path, monkeypatch):
    """The same model with its fp32 weights back (``restore_dense``): batch-invariant passes (the kernel on both) and
    cached decode passes give identical logits; a prefill on the released model reads the compact forms too. On the
    fp32 arithmetic (the exact forms; the int8 arithmetic changes the numbers by design: tests/test_int8.py)."""
    monkeypatch.setenv(compute.ARITHMETIC_ENV, "fp32")
    released = load_model(str(q41_path), device="cpu", compute="stream")
    kept = load_model(str(q41_path), device="cpu", compute="stream")
    assert dense.restore_dense(kept.model) == released.compute.released_bytes
    assert not any(is_released(m.weight) for m in _layer_linears(kept.model))
    seq = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 4  # 40 tokens: more rows than the kernel's limit for a prefill
    with torch.inference_mode(), compute.batch_invariant():
        a = released.model(torch.tensor([seq])).logits
        b = kept.model(torch.tensor([seq])).logits
    assert torch.equal(a, b)
    outs = []
    for t in (released, kept):
        lm = CachedLM(t.model, t.device, keep_hidden=True)
        lm.logits_for(seq[:8])
        outs.append([lm.logits_for(seq[:9], n_logits=1), lm.logits_for(seq[:12], n_logits=3)])
    for x, y in zip(*outs):
        assert torch.equal(x, y)
    with torch.inference_mode():  # a 40-token prefill: the released model's products all on the kernel
        ref = kept.model(torch.tensor([seq])).logits
        got = released.model(torch.tensor([seq])).logits
    assert float((got - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max()))


def test_the_state_dict_and_the_default_path_see_the_checkpoints_values(q41_path):
    t = load_model(str(q41_path), device="cpu", compute="stream")
    saved = _file_weights(q41_path)
    state = t.model.state_dict()
    for name, value in saved.items():
        assert _same_bits(state[name], value), name
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    lin = t.model.model.layers[0].self_attn.k_proj  # a fused follower: its rows of the stacked weight
    with torch.enable_grad():  # autograd on an input that needs it: the F.linear fallback, on rebuilt values
        y = lin(x.requires_grad_(True))
    assert torch.equal(y.detach(), F.linear(x.detach(), saved["model.layers.0.self_attn.k_proj.weight"]))
    compute.apply_path(t.model, "default")
    for name, p in t.model.named_parameters():
        assert p.is_contiguous() and _same_bits(p.detach(), saved[name]), name
    assert all(m.weight.requires_grad for m in _layer_linears(t.model))
    assert compute.use_path(t.model, t.compute, release=True).released_bytes == t.compute.released_bytes


def test_weights_off_the_grid_keep_their_fp32(tmp_path):
    t = load_model(str(save_tiny_llama(tmp_path / "t", layers=2, seed=3)), device="cpu", compute="stream")
    assert t.compute.released_bytes == 0
    assert not any(is_released(m.weight) for m in _layer_linears(t.model))


def test_dropping_pages_never_touches_memory_outside_a_checkpoint_mapping():
    x = torch.arange(100_000, dtype=torch.float32)
    assert memory.drop_mapped_pages([x]) == 0
    assert torch.equal(x, torch.arange(100_000, dtype=torch.float32))


_PEAK = """
import json
from engine.decoding.models import load_model
t = load_model("embedded", device="cpu")
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
mb = lambda k: int(status[k].split()[0]) // 1024
print(json.dumps({"peak": mb("VmHWM"), "rss": mb("VmRSS"), "released": t.compute.released_bytes,
                  "path": t.compute.path}))
"""


def test_the_embedded_model_loads_without_a_second_copy_of_its_weights():
    """The embedded model's 538 MB of fp32 weights: its layers (425 MB) are released as their Q4_1 forms are made,
    group by group, and the checkpoint's pages go as they are read, so a fresh process's peak stays under 1 GB
    (measured on the AMD EPYC: 763 MB, 645 MB after the load; 1.46 GB peak with the fp32 copies kept)."""
    out = subprocess.run([sys.executable, "-c", _PEAK], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["path"] != "stream":
        pytest.skip(f"the embedded model runs {got['path']} here")
    assert got["released"] > 400e6, got
    assert got["peak"] < 1000, got


def test_a_released_model_stays_right_when_another_model_switches_the_process_path(q41_path, tmp_path):
    """The active path is the process's (the last one applied): a tiny model loaded on "default" after the released
    one sends the released model's products to ``F.linear``, which must read rebuilt values (a fused group's stacked
    weight included), never the placeholder. On the fp32 arithmetic, so before and after are the same numbers."""
    released = load_model(str(q41_path), device="cpu", compute="stream", arithmetic="fp32")
    seq = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.inference_mode():
        before = released.model(seq).logits
    load_model(str(save_tiny_llama(tmp_path / "t", layers=1)), device="cpu", compute="default")
    try:
        with torch.inference_mode():
            after = released.model(seq).logits
        assert torch.isfinite(after).all()
        assert float((after - before).abs().max()) <= 1e-4 * max(1.0, float(before.abs().max()))
    finally:
        compute.use_path(released.model, released.compute, release=True)  # the process's path back to "stream"
