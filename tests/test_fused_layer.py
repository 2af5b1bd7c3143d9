"""The fused decoder layer of batch-invariant decode passes (engine/decoding/compute/fused_layer.cpp, called from
``compute.lean._lean_forward``): within fp32 rounding of the lean layer, every row's bits independent of the rows
beside it, the same bits from a weight's exact compact form as from its fp32 values, biases, and the layers it
leaves to the lean forward."""

from __future__ import annotations

import pytest
import torch

from engine.decoding import compute
from engine.decoding.compute import extension, lean
from engine.decoding.models import load_model
from engine.decoding.proposers import CachedLM
from tests.tiny_models import save_q41_exact_llama as _q41_exact_model
from tests.tiny_models import save_tiny_llama

needs_fused = pytest.mark.skipif(compute.stream_kernel() is None or extension._STREAM.get("fused_layer") is None,
                                 reason=f"no streaming kernel here: {compute.stream_problem()}")

pytestmark = needs_fused

PROMPT = [3, 4, 5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def q41_path(tmp_path_factory):
    return _q41_exact_model(tmp_path_factory.mktemp("fused") / "m")


def _decode_logits(target, widths=(1, 3)):
    """Logits of a prefill and then cached passes of the given widths (each a batch-invariant decode pass)."""
    return _decode_logits_with(CachedLM(target.model, target.device, keep_hidden=True), widths)


def _fused_in_use(target) -> bool:
    layers = target.model.model.layers
    return all((layer.__dict__.get(lean.FUSED_ATTR) or (None, None))[1] is not None for layer in layers)


def test_a_decode_pass_runs_the_fused_layer_within_rounding_of_the_lean_layer(q41_path, monkeypatch):
    t = load_model(str(q41_path), device="cpu", compute="stream")
    fused = _decode_logits(t)
    assert _fused_in_use(t)
    monkeypatch.setitem(extension._STREAM, "fused_layer", None)
    for layer in t.model.model.layers:
        layer.__dict__.pop(lean.FUSED_ATTR, None)
    plain = _decode_logits(t)
    for a, b in zip(fused, plain):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, scale), (a - b).abs().max()


def test_a_verify_pass_gives_each_position_the_bits_of_one_token_passes(q41_path):
    """The property greedy speculative decoding rests on: position i of a pass over several tokens gets exactly the
    logits a 1-token pass gives there."""
    t = load_model(str(q41_path), device="cpu", compute="stream")
    lm = CachedLM(t.model, t.device, keep_hidden=True)
    seq = list(PROMPT)
    lm.logits_for(seq)
    new = [12, 19, 4, 7, 25]
    many = lm.logits_for(seq + new, n_logits=len(new))
    hidden_many = lm.hidden[len(seq):].clone()
    lm.crop(len(seq))
    for i in range(len(new)):
        one = lm.logits_for(seq + new[:i + 1], n_logits=1)[0]
        assert torch.equal(one, many[i]), i
    assert torch.equal(lm.hidden[len(seq):], hidden_many)


def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(q41_path):
    """FusedLayer.qkv and .rest on three rows of different lengths in one call (the room's layout: spans into a
    batch cache) equal each row's call alone, bit for bit."""
    t = load_model(str(q41_path), device="cpu", compute="stream")
    layer = t.model.model.layers[0]
    fused = lean._fused_layer(layer)
    assert fused is not None
    gen = torch.Generator().manual_seed(3)
    B, Q, L, H, D = 3, 2, 12, 64, 16
    x = torch.randn(B, Q, H, generator=gen)
    ang = torch.randn(B, Q, D // 2, generator=gen)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    q, k, v = fused.qkv(x, cos, sin)
    cache_k, cache_v = torch.randn(B, 2, L + Q, D, generator=gen), torch.randn(B, 2, L + Q, D, generator=gen)
    cache_k[:, :, L:], cache_v[:, :, L:] = k, v
    starts, fed = [0, 5, 9], [2, 1, 2]  # row r's cached keys are [starts[r], L), then its fed tokens
    spans = compute.invariant._spans(list(zip(starts, fed)), L + Q, Q, L, "cpu")
    out = fused.rest(x, q, cache_k, cache_v, *spans, D ** -0.5)
    for r in range(B):
        qa, ka, va = fused.qkv(x[r:r + 1], cos[r:r + 1], sin[r:r + 1])
        assert torch.equal(qa, q[r:r + 1]) and torch.equal(ka, k[r:r + 1]) and torch.equal(va, v[r:r + 1])
        w = fed[r]
        keys = torch.cat([cache_k[r:r + 1, :, starts[r]:L], k[r:r + 1, :, :w]], 2)
        values = torch.cat([cache_v[r:r + 1, :, starts[r]:L], v[r:r + 1, :, :w]], 2)
        alone_spans = compute.invariant._spans(None, keys.shape[2], w, None, "cpu")
        alone = fused.rest(x[r:r + 1, :w], qa[:, :, :w].contiguous(), keys, values, *alone_spans, D ** -0.5)
        assert torch.equal(alone, out[r:r + 1, :w]), r


@pytest.mark.skipif(compute.stream_kernel() is None or "q41" not in (extension._STREAM.get("compact") or {}),
                    reason="this kernel build reads no compact weights (it needs AVX-512, or AVX2 with F16C and FMA)")
def test_compact_forms_give_the_bits_of_the_fp32_weights(q41_path, monkeypatch):
    monkeypatch.setenv(compute.ARITHMETIC_ENV, "fp32")  # the exact forms: the fp32 arithmetic
    blocks = load_model(str(q41_path), device="cpu", compute="stream")
    kinds = {w.__dict__[compute.COMPACT_ATTR].kind for w in
             (blocks.model.model.layers[0].self_attn.q_proj._fused_weight, blocks.model.model.layers[0].mlp.down_proj.weight)}
    assert kinds == {"q41"}
    got = _decode_logits(blocks, widths=(1, 3, 2))
    monkeypatch.setenv(compute.WEIGHT_FORMAT_ENV, "fp32")
    fp32 = load_model(str(q41_path), device="cpu", compute="stream")
    assert compute.COMPACT_ATTR not in fp32.model.model.layers[0].mlp.down_proj.weight.__dict__
    want = _decode_logits(fp32, widths=(1, 3, 2))
    assert _fused_in_use(blocks) and _fused_in_use(fp32)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_biases_are_added_and_a_changed_weight_makes_the_layer_again(tmp_path, monkeypatch):
    t = load_model(str(_q41_exact_model(tmp_path / "b", seed=2, attention_bias=True, mlp_bias=True)), device="cpu",
                   compute="stream")
    assert t.model.model.layers[0].self_attn.q_proj.bias is not None
    fused = _decode_logits(t)
    assert _fused_in_use(t)
    with monkeypatch.context() as mp:
        mp.setitem(extension._STREAM, "fused_layer", None)
        for layer in t.model.model.layers:
            layer.__dict__.pop(lean.FUSED_ATTR, None)
        plain = _decode_logits(t)
    for a, b in zip(fused, plain):
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max()))
    _decode_logits(t)
    layer = t.model.model.layers[1]
    made = layer.__dict__[lean.FUSED_ATTR][1]
    assert made is not None
    _decode_logits(t)
    assert layer.__dict__[lean.FUSED_ATTR][1] is made  # kept while nothing changed
    with torch.no_grad():
        layer.post_attention_layernorm.weight.mul_(1.5)  # an in-place change: the layer is made again
    changed = _decode_logits(t)
    assert layer.__dict__[lean.FUSED_ATTR][1] is not made
    assert not torch.equal(changed[0], fused[0])


def test_layers_it_cannot_compute_keep_the_lean_forward(tmp_path):
    """An activation other than SiLU (here GELU): the lean forward runs the layer, with the same results as
    transformers' layers give in the batch-invariant layout."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "g", layers=2, seed=4)
    m = AutoModelForCausalLM.from_pretrained(str(path))
    m.config.hidden_act = "gelu"
    m.save_pretrained(path)
    t = load_model(str(path), device="cpu", compute="stream")
    _decode_logits(t)
    assert all(layer.__dict__[lean.FUSED_ATTR][1] is None for layer in t.model.model.layers)


def test_the_models_direct_loop_gives_the_layers_bits(q41_path, monkeypatch):
    """``_lean_model_forward``'s direct loop (the fused calls, keys and values written into the cache's block in place)
    and the model's own forward through the layers give the same logits, hidden states and cache entries; with the
    block's in-place writes off (``BlockLayer.IN_PLACE``), the cache's own update gives them too."""
    from engine.decoding import proposers

    t = load_model(str(q41_path), device="cpu", compute="stream")

    def run():
        lm = CachedLM(t.model, t.device, keep_hidden=True)
        got = _decode_logits_with(lm)
        return got, lm.hidden.clone(), [(la.keys.clone(), la.values.clone()) for la in lm.cache.layers]

    calls = []
    real = t.model.model.layers[0].__class__.forward
    monkeypatch.setattr(t.model.model.layers[0].__class__, "forward",
                        lambda *a, **k: calls.append(getattr(compute.invariant._INVARIANT, "on", False))
                        or real(*a, **k))
    direct = run()
    assert not calls  # every pass, the prefill too (batch-invariant: CachedLM._feed), took the direct loop
    monkeypatch.setattr(lean, "DIRECT_MODEL", False)
    layered = run()
    assert any(calls)
    monkeypatch.setattr(lean, "DIRECT_MODEL", True)
    monkeypatch.setattr(proposers.block_layer_class(), "IN_PLACE", False)
    updated = run()
    for other in (layered, updated):
        assert all(torch.equal(a, b) for a, b in zip(direct[0], other[0]))
        assert torch.equal(direct[1], other[1])
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(direct[2], other[2]))


def _decode_logits_with(lm, widths=(1, 3, 2)):
    seq = list(PROMPT)
    lm.logits_for(seq)
    out = []
    for i, w in enumerate(widths):
        seq = seq + [11 + (3 * i + j) % 17 for j in range(w)]
        out.append(lm.logits_for(seq, n_logits=w))
    return out


def test_a_pass_over_rows_in_their_own_caches_checks_every_block():
    """``RaggedPass`` (the room's pass over readers in their own caches, ``lean.fused_decode_rows``) addresses each
    row's block directly, so it refuses blocks it could write past or misread: no room for the pass's tokens, more fed
    tokens than the pass's width, another dtype, other heads."""
    make = extension._STREAM["ragged_pass"]
    k = torch.zeros(2, 1, 3, 8, 16)
    v = torch.zeros_like(k)
    make([k, k.clone()], [v, v.clone()], [4, 6], [2, 1], 2)  # 4 + 2 and 6 + 2 ≤ 8 slots
    with pytest.raises(RuntimeError, match="room"):
        make([k], [v], [7], [1], 2)
    with pytest.raises(RuntimeError, match="room"):
        make([k], [v], [4], [3], 2)  # feeds 3 tokens in a pass 2 wide
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        make([k], [v.double()], [4], [1], 2)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        make([k, k[:, :, :2].contiguous()], [v, v[:, :, :2].contiguous()], [4, 4], [1, 1], 2)
    with pytest.raises(RuntimeError, match="one keys block"):
        make([k], [v, v], [4], [1], 2)


def test_a_tree_pass_gives_each_node_the_bits_of_a_chain_pass_over_its_path(q41_path, monkeypatch):
    """A token tree's verify pass runs the fused layers with each node a row over its own keys
    (``compute.fused_visible_pass``): node i's logits and hidden state are bit for bit what a chain pass over the
    context and i's path gives its last token, and within fp32 rounding of the masked model's pass it replaced."""
    from engine.decoding import tree as tree_mod
    from engine.decoding.tree import TokenTree, keep_accepted_path, tree_verify_pass

    t = load_model(str(q41_path), device="cpu", compute="stream")
    seq = list(PROMPT)
    # root 12 with children 19 and 4; 19 has a child 7; a second root 25
    tr = TokenTree(tokens=[12, 19, 4, 7, 25], parents=[-1, 0, 0, 1, -1], q=torch.zeros(5, 8))
    calls = []
    real = tree_mod._fused_tree_pass
    monkeypatch.setattr(tree_mod, "_fused_tree_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    lm = CachedLM(t.model, t.device, keep_hidden=True)
    lm.logits_for(seq)
    logits, fed = tree_verify_pass(lm, seq, tr)
    assert calls and fed == tr.size  # the context's last logits are kept: only the nodes are fed
    hidden = lm.hidden[len(seq):].clone()
    assert logits.shape[0] == tr.size + 1
    for node in range(tr.size):
        path = tr.path_to(node)
        chain = CachedLM(t.model, t.device, keep_hidden=True)
        chain.logits_for(seq)
        one = chain.logits_for(seq + [tr.tokens[i] for i in path], n_logits=len(path))
        assert torch.equal(one[-1], logits[1 + node]), node
        assert torch.equal(chain.hidden[-1], hidden[node]), node
    # the masked model's pass (the path it replaced): within rounding
    monkeypatch.setattr(tree_mod, "_fused_tree_pass", lambda *a, **k: None)
    lm2 = CachedLM(t.model, t.device, keep_hidden=True)
    lm2.logits_for(seq)
    masked, _ = tree_verify_pass(lm2, seq, tr)
    assert float((masked - logits).abs().max()) <= 1e-4 * max(1.0, float(masked.abs().max()))
    # the accepted path's cache is then the chain's
    keep_accepted_path(lm, len(seq), [0, 1, 3], logits[1 + 3])
    assert lm.ids == seq + [12, 19, 7]
