"""engine.decoding.attention: the 4D mask transformers 5.24 takes, pinned against plain causal passes."""

from __future__ import annotations

import pytest
import torch

from engine.decoding.attention import fed_visibility, model_mask, tree_depths, tree_visibility
from engine.errors import InputError
from tests.tiny_models import save_tiny_llama


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path_factory.mktemp("attn") / "m", layers=2, seed=3, init=0.5)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=request.param,
                                                dtype=torch.float32).eval()


def test_tree_visibility_hand_example():
    # roots 0 and 1; 2 under 0; 3 under 2; 4 under 1
    vis = tree_visibility([-1, -1, 0, 2, 1])
    expect = torch.tensor([[1, 0, 0, 0, 0],
                           [0, 1, 0, 0, 0],
                           [1, 0, 1, 0, 0],
                           [1, 0, 1, 1, 0],
                           [0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(vis, expect)
    assert tree_depths([-1, -1, 0, 2, 1]) == [1, 1, 2, 3, 2]


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-2], [-1, 5]])
def test_tree_parent_must_come_first(bad):
    with pytest.raises(InputError, match="parent"):
        tree_visibility(bad)
    with pytest.raises(InputError, match="parent"):
        tree_depths(bad)


def test_model_mask_formats(tiny):
    vis = torch.tensor([[[True, False], [True, True]]])
    m = model_mask(vis, tiny)
    assert m.shape == (1, 1, 2, 2)
    if tiny.config._attn_implementation == "sdpa":
        assert m.dtype == torch.bool and torch.equal(m[0, 0], vis[0])
    else:
        assert m.dtype == torch.float32
        assert m[0, 0, 0, 0] == 0 and m[0, 0, 0, 1] == torch.finfo(torch.float32).min


def test_model_mask_refuses_other_implementations(tiny):
    class Fake(torch.nn.Module):
        config = type("C", (), {"_attn_implementation": "flash_attention_2"})()

    with pytest.raises(InputError, match="sdpa"):
        model_mask(torch.ones(1, 1, 1, dtype=torch.bool), Fake())


@torch.inference_mode()
def test_tree_pass_equals_each_branch_alone(tiny):
    """One pass over a cached context + a tree gives, at every node, the logits of a plain causal pass over
    context + the node's root-to-node path (the mechanism trees are verified with)."""
    from transformers import DynamicCache

    ctx = [3, 7, 5, 9]
    tokens = [4, 6, 8, 10, 12, 14]
    parents = [-1, -1, 0, 0, 2, 1]
    cache = DynamicCache()
    tiny(input_ids=torch.tensor([ctx]), cache=cache, use_cache=True)
    vis = fed_visibility(tree_visibility(parents), torch.ones(1, len(ctx), dtype=torch.bool))
    pos = torch.tensor([[len(ctx) - 1 + d for d in tree_depths(parents)]])
    out = tiny(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True,
               attention_mask=model_mask(vis, tiny), position_ids=pos).logits[0]
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        ref = tiny(input_ids=torch.tensor([ctx + path])).logits[0, -1]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_holes_in_the_cache_are_invisible(tiny):
    """A cache entry masked out for a row (a rejected token left in place) changes nothing: the row's
    logits equal a pass over the sequence without it, when position ids skip the hole."""
    from transformers import DynamicCache

    seq = [3, 7, 5]
    junk = 11
    cache = DynamicCache()
    tiny(input_ids=torch.tensor([seq + [junk]]), cache=cache, use_cache=True)
    valid = torch.tensor([[True, True, True, False]])
    causal = torch.ones(2, 2, dtype=torch.bool).tril()
    out = tiny(input_ids=torch.tensor([[9, 2]]), cache=cache, use_cache=True,
               attention_mask=model_mask(fed_visibility(causal, valid), tiny),
               position_ids=torch.tensor([[3, 4]])).logits[0]
    ref = tiny(input_ids=torch.tensor([seq + [9, 2]])).logits[0, -2:]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_stack_left_padded_right_aligns_each_row_and_zeroes_the_padding():
    """Each row's entries end at the last column, zeros before them, in every layer, and ``valid`` marks exactly
    the entries; a row holding nothing is all padding. Checked against slicing by hand, bit for bit."""
    from engine.decoding.attention import stack_left_padded

    gen = torch.Generator().manual_seed(0)
    layers, heads, dim = 3, 2, 4
    lens = [5, 0, 2, 5, 1]
    rows = [[(torch.randn(1, heads, n, dim, generator=gen), torch.randn(1, heads, n, dim, generator=gen))
             for _ in range(layers)] if n else None for n in lens]
    cache, valid = stack_left_padded(rows, lens)
    assert valid.tolist() == [[c >= 5 - n for c in range(5)] for n in lens]
    assert len(cache.layers) == layers and cache.get_seq_length() == 5
    for li, layer in enumerate(cache.layers):
        assert layer.keys.shape == layer.values.shape == (len(lens), heads, 5, dim)
        for r, n in enumerate(lens):
            for got, which in ((layer.keys, 0), (layer.values, 1)):
                assert torch.equal(got[r, :, :5 - n], torch.zeros(heads, 5 - n, dim))
                if n:
                    assert torch.equal(got[r, :, 5 - n:], rows[r][li][which][0])
    # layers of different shapes (a model whose layers differ in KV heads): each layer stacked by itself
    mixed = [[(torch.randn(1, 1 + li, n, dim, generator=gen), torch.randn(1, 1 + li, n, dim, generator=gen))
              for li in range(layers)] if n else None for n in lens]
    cache, _ = stack_left_padded(mixed, lens)
    for li, layer in enumerate(cache.layers):
        assert layer.keys.shape == (len(lens), 1 + li, 5, dim)
        assert torch.equal(layer.values[2, :, 3:], mixed[2][li][1][0]) and not layer.values[2, :, :3].any()
    empty, none_valid = stack_left_padded([None, None], [0, 0])
    assert empty.get_seq_length() == 0 and none_valid.shape == (2, 0)


def test_stacking_in_place_gives_the_same_pass_bit_for_bit(tiny):
    """``stack_left_padded(room=width)`` (StaticLayers the pass writes into) and the DynamicCache the pass
    concatenates onto give the same hidden states and the same cache afterwards, bit for bit: the room's target
    pass (``scheduler.Room._stacked``) depends on it. Rows of 5, 2, 0 and 4 cached tokens, feeds of 3, 1, 3, 2."""
    from engine.decoding.attention import KVScratch, stack_left_padded

    prompts, feeds = [[3, 4, 5, 6, 7], [8, 9], [], [10, 11, 12, 13]], [[14, 15, 16], [17], [18, 19, 20], [21, 22]]
    rows, lens = [], []
    with torch.inference_mode():
        for pr in prompts:
            if pr:
                out = tiny(input_ids=torch.tensor([pr]), use_cache=True)
                rows.append([(layer.keys, layer.values) for layer in out.past_key_values.layers])
            else:
                rows.append(None)
            lens.append(len(pr))
        width, c_max = max(map(len, feeds)), max(lens)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        real = torch.stack([torch.arange(width) < len(f) for f in feeds])
        new_vis = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool)[None]
        inp = torch.tensor([f + [0] * (width - len(f)) for f in feeds])
        pos = torch.tensor([[n + i for i in range(width)] for n in lens])
        results = []
        scratch = KVScratch()
        scratch.take("keys", (1 << 20,), torch.empty(0)).fill_(float("nan"))  # reused memory holds anything
        scratch.take("values", (1 << 20,), torch.empty(0)).fill_(float("nan"))
        # the same rows as CachedLM.kv_block gives them: every layer in one [layers, 1, heads, n, d] tensor each
        blocks = [(torch.stack([k for k, _ in r]), torch.stack([v for _, v in r])) if r else None for r in rows]
        for room, sc, given in ((0, None, rows), (width, None, rows), (width, scratch, rows), (width, scratch, rows),
                                (width, scratch, blocks), (0, None, blocks)):
            cache, valid = stack_left_padded(given, lens, room=room, scratch=sc)
            assert cache.get_seq_length() == c_max
            mask = model_mask(fed_visibility(new_vis, valid), tiny)
            h = tiny.get_decoder()(input_ids=inp, attention_mask=mask, position_ids=pos, cache=cache,
                                   use_cache=True).last_hidden_state
            results.append((h, valid, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]))
    h0, v0, kv0 = results[0]
    # in place in new memory, then twice in a scratch's (NaN-filled, then used) memory, then from blocks (in place, and
    # concatenated onto)
    for h1, v1, kv1 in results[1:]:
        assert torch.equal(v0, v1)
        assert torch.equal(h0, h1)
        for (k0, va0), (k1, va1) in zip(kv0, kv1):
            assert k0.shape == k1.shape == (4, k0.shape[1], c_max + width, k0.shape[3])
            assert torch.equal(k0, k1) and torch.equal(va0, va1)
