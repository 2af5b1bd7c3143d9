"""The EAGLE-style draft head: exact greedy output, its own KV rollback, the sampling law, loading."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from engine.decoding.draft_head import FeatureHead, is_head_folder, load_head, save_head
from engine.decoding.models import load_model
from engine.decoding.proposers import FeatureHeadProposer
from engine.decoding.drafts import make_proposer
from engine.decoding.sampling import SamplingConfig, warp_probs
from engine.decoding.speculative import SpeculativeDecoder, generate
from engine.errors import InputError, ModelLoadError
from tests.test_sampling import g_test_pvalue
from tests.tiny_models import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random target and a random 1-layer head over 16 of its 32 ids, saved and reloaded."""
    root = tmp_path_factory.mktemp("head")
    target = load_model(str(save_tiny_llama(root / "target", vocab_size=32, layers=3, seed=0)), device="cpu")
    torch.manual_seed(0)
    head = FeatureHead(target.model.config, 1, torch.arange(0, 32, 2))
    head.init_from_target(target.model)
    save_head(head, root / "head", meta={"target": "tiny"})
    return dict(target=target, head_dir=root / "head", root=root)


def hf_greedy(lm, ids, n):
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    return out[0, len(ids):].tolist()


PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 3, 12, 20, 4, 9, 3, 12, 2], [4]]


def test_greedy_identical_to_transformers_generate(tiny):
    target = tiny["target"]
    for ids in PROMPTS:
        ref = hf_greedy(target, ids, 24)
        for gamma in range(1, 9):
            prop = make_proposer(str(tiny["head_dir"]), target)
            got = generate(target, prop, ids, gamma=gamma, max_new_tokens=24, stop_on_eos=False).token_ids
            assert got == ref, gamma


def reference_draft(head, target, seq, k):
    """The head's greedy draft from scratch (no caches): true features of seq[:-1] from one target pass,
    then k head passes over all pairs, appending (ĥ, token) each time."""
    with torch.no_grad():
        h = target.model.get_decoder()(input_ids=torch.tensor([seq[:-1]])).last_hidden_state[0]
        feats, toks, out = list(h), list(seq[1:]), []
        for _ in range(k):
            y = head(torch.tensor([toks]), torch.stack(feats)[None])[0, -1]
            j = int(torch.argmax(head.logits(y)))
            out.append(int(head.vocab_ids[j]))
            feats.append(y)
            toks.append(out[-1])
    return out


def test_head_cache_rollback_matches_a_fresh_computation(tiny):
    """After every round (accepts, rejections, crops of both caches), the head proposes exactly what a
    from-scratch computation over the committed sequence proposes."""
    target = tiny["target"]
    prop = make_proposer(str(tiny["head_dir"]), target)
    dec = SpeculativeDecoder(target, prop, PROMPTS[1], gamma=3, max_new_tokens=30, stop_on_eos=False)
    dec.prefill()
    cfg = SamplingConfig()
    checked = 0
    while not dec.finished:
        got = prop.propose(dec.seq, 3, cfg, torch.Generator())
        assert got.tokens == reference_draft(prop.head, target, dec.seq, 3)
        # q is the head's softmax over its 16 ids, zero elsewhere
        assert torch.allclose(got.q.sum(-1), torch.ones(3), atol=1e-5)
        assert float(got.q[:, 1::2].abs().sum()) == 0.0
        dec.step()
        checked += 1
    assert checked >= 8


def test_first_round_reads_the_pairs_up_to_the_last_prompt_token(tiny):
    """Round 0 (the prefill fed the whole prompt, length P, so the target holds h_0..h_{P-1}): the head's first
    draft comes from the pairs (h_i, x_{i+1}) for i <= P - 2, the last of them (h_{P-2}, x_{P-1}) predicting the
    token at P, which is where its training scores start (train_head.make_items: pairs i >= P - 2). h_{P-1} is
    not read (it belongs to the pair that needs the token at P): no off-by-one as Medusa's first round had."""
    target = tiny["target"]
    cfg = SamplingConfig()
    for ids in PROMPTS[:2]:
        prop = make_proposer(str(tiny["head_dir"]), target)
        dec = SpeculativeDecoder(target, prop, ids, gamma=2, max_new_tokens=8, stop_on_eos=False)
        dec.prefill()
        assert prop.target_lm.hidden.shape[0] == len(ids)
        want = reference_draft(prop.head, target, ids, 2)
        assert prop.propose(dec.seq, 2, cfg, torch.Generator()).tokens == want
        first = prop.last_true.clone()
        assert prop.n_true == len(ids) - 1
        prop.reset()
        prop.target_lm.hidden = prop.target_lm.hidden.clone()
        prop.target_lm.hidden[-1] = 1e3  # h_{P-1} changed: the first round's draft must not move
        assert prop.propose(dec.seq, 2, cfg, torch.Generator()).tokens == want
        assert torch.equal(prop.last_true, first)
        prop.reset()
        prop.target_lm.hidden[-2] = 1e3  # h_{P-2} changed: the newest pair's feature, so ĥ_{P-1} moves
        prop.propose(dec.seq, 2, cfg, torch.Generator())
        assert not torch.allclose(prop.last_true, first, atol=1e-3)


def exact_joint_2(target, prompt, cfg):
    """Exact law of the next 2 tokens of the target under ``cfg`` (enumerate the first token)."""
    with torch.no_grad():
        p1 = warp_probs(target.model(torch.tensor([prompt])).logits[0, -1].double(), cfg)
        V = p1.shape[0]
        seqs = torch.tensor([prompt + [a] for a in range(V)])
        p2 = warp_probs(target.model(seqs).logits[:, -1].double(), cfg)
    return {(a, b): float(p1[a] * p2[a, b]) for a, b in itertools.product(range(V), range(V))
            if p1[a] * p2[a, b] > 0}


def test_confidence_threshold_stops_the_draft_where_the_head_is_unsure(tiny):
    """With a threshold, each round proposes the longest prefix of the unthresholded draft whose tokens
    all have head confidence (max softmax at T = 1) ≥ the threshold; output stays identical."""
    target = tiny["target"]
    ids = PROMPTS[1]
    ref = hf_greedy(target, ids, 24)
    cfg = SamplingConfig()
    stopped = full = 0
    for thr in (0.08, 0.12, 0.2):
        prop = make_proposer(str(tiny["head_dir"]), target)
        prop.confidence_threshold = thr
        plain = make_proposer(str(tiny["head_dir"]), target)
        dec = SpeculativeDecoder(target, prop, ids, gamma=4, max_new_tokens=24, stop_on_eos=False)
        plain.attach(dec.target_lm)
        dec.prefill()
        while not dec.finished:
            got = prop.propose(dec.seq, 4, cfg, torch.Generator())
            want = plain.propose(dec.seq, 4, cfg, torch.Generator())
            conf = [float(want.q[i].max()) for i in range(len(want.tokens))]  # greedy q: softmax at T = 1
            n = next((i for i, c in enumerate(conf) if c < thr), len(conf))
            assert got.tokens == want.tokens[:n], (thr, conf)
            stopped += n < 4
            full += n == 4
            dec.step()
        assert dec.seq[len(ids):] == ref
    assert stopped and full  # both cases occurred
    prop = make_proposer(str(tiny["head_dir"]), target)
    prop.confidence_threshold = 0.999  # nothing is confident: every round is a plain step
    res = generate(target, prop, ids, gamma=4, max_new_tokens=12, stop_on_eos=False)
    assert res.token_ids == ref[:12] and res.stats.drafted == 0
    with pytest.raises(InputError, match="confidence"):
        FeatureHeadProposer(prop.head, target, confidence_threshold=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("cfg,threshold", [(SamplingConfig(temperature=1.0), 0.0),
                                           (SamplingConfig(temperature=0.8, top_k=5, top_p=0.95), 0.0),
                                           (SamplingConfig(temperature=1.0), 0.3)])
def test_distribution_preserved_with_head(tmp_path, cfg, threshold):
    """G-test of the joint law of 2 generated tokens against the exact one; the head covers only some
    ids (q = 0 where p > 0) and is random (many rejections and residual draws)."""
    words = ["a", "b", "c", "d", "e", "f"]
    target = load_model(str(save_tiny_llama(tmp_path / "t", vocab_size=8, layers=2, seed=4, words=words,
                                            init=0.6)), device="cpu")
    torch.manual_seed(1)
    head = FeatureHead(target.model.config, 1, torch.tensor([0, 2, 3, 5, 7]))
    head.init_from_target(target.model)
    save_head(head, tmp_path / "h")
    prompt = [2, 3, 4, 2]
    exact = exact_joint_2(target, prompt, cfg)
    counts: dict[tuple, int] = {}
    runs = 2000
    prop = make_proposer(str(tmp_path / "h"), target)
    prop.confidence_threshold = threshold  # stopping on the head's own confidence keeps the law
    for seed in range(runs):
        res = generate(target, prop, prompt, gamma=2, sampling=cfg, seed=seed, max_new_tokens=2,
                       stop_on_eos=False)
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact), "a pair of tokens with probability 0 was generated"
    # cells with an expected count under 5 are pooled into one (the G-test's usual validity rule)
    big = [c for c in exact if exact[c] * runs >= 5]
    obs = [counts.get(c, 0) for c in big] + [runs - sum(counts.get(c, 0) for c in big)]
    probs = [exact[c] for c in big] + [1 - sum(exact[c] for c in big)]
    pval = g_test_pvalue(torch.tensor(obs, dtype=torch.float64), torch.tensor(probs, dtype=torch.float64))
    assert len(big) >= 5 and pval > 1e-3, (len(big), pval)  # enough cells for the test to have power


def test_save_load_round_trip(tiny):
    target = tiny["target"]
    head = load_head(tiny["head_dir"], target.model)
    again = load_head(tiny["head_dir"], target.model)
    for (k, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    assert head.vocab_ids.tolist() == list(range(0, 32, 2))
    assert json.loads((tiny["head_dir"] / "head_config.json").read_text())["target"] == "tiny"
    assert is_head_folder(tiny["head_dir"]) and not is_head_folder(tiny["root"])


def test_head_for_another_target_is_refused(tiny, tmp_path):
    other = load_model(str(save_tiny_llama(tmp_path / "o", vocab_size=32, layers=1, hidden=48)), device="cpu")
    with pytest.raises(ModelLoadError, match="hidden size"):
        make_proposer(str(tiny["head_dir"]), other)
    cfg = json.loads((tiny["head_dir"] / "head_config.json").read_text())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "head_config.json").write_text(json.dumps({**cfg, "format": "other"}))
    with pytest.raises(ModelLoadError):
        make_proposer(str(tmp_path / "bad"), tiny["target"])
    # repeated ids would make q (scattered over vocab_ids) differ from the distribution sampled from
    dup = FeatureHead(tiny["target"].model.config, 1, torch.tensor([1, 1, 2]))
    save_head(dup, tmp_path / "dup")
    with pytest.raises(ModelLoadError, match="distinct"):
        load_head(tmp_path / "dup", tiny["target"].model)
    (tmp_path / "dup" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="Cannot read"):
        load_head(tmp_path / "dup", tiny["target"].model)


def test_embedded_head_needs_the_embedded_target(tiny):
    with pytest.raises(InputError, match="embedded target"):
        make_proposer("embedded-head", tiny["target"])


def test_head_without_features_proposes_nothing(tiny):
    """A one-token prompt has no target feature yet: the first round is a plain step, then drafting starts."""
    target = tiny["target"]
    prop = make_proposer(str(tiny["head_dir"]), target)
    assert isinstance(prop, FeatureHeadProposer)
    dec = SpeculativeDecoder(target, prop, [4], gamma=3, max_new_tokens=10, stop_on_eos=False)
    first = dec.step()
    assert first.drafted == []
    second = dec.step()
    assert len(second.drafted) == 3


def test_grow_adds_layers_that_start_as_the_identity(tiny, tmp_path):
    """A grown head computes what the original computes; its new layer is in the path (changing its output
    projection changes the result); it saves and reloads with the new depth and stays exact as a draft."""
    target = tiny["target"]
    head = load_head(tiny["head_dir"], target.model)
    big = head.grow(2, target.model)
    assert big.n_layers == 2 and len(big.body.layers) == 2
    torch.manual_seed(1)
    tok, feats = torch.randint(0, 32, (2, 9)), torch.randn(2, 9, target.model.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(head(tok, feats), big(tok, feats))
        assert torch.equal(big.vocab_ids, head.vocab_ids)
        big.body.layers[1].self_attn.o_proj.weight.normal_(0, 0.5)
        assert not torch.allclose(head(tok, feats), big(tok, feats))
    save_head(big, tmp_path / "big")
    again = load_head(tmp_path / "big", target.model)
    assert again.n_layers == 2
    ids = PROMPTS[1]
    got = generate(target, make_proposer(str(tmp_path / "big"), target), ids, gamma=3, max_new_tokens=16,
                   stop_on_eos=False).token_ids
    assert got == hf_greedy(target, ids, 16)
    with pytest.raises(ValueError, match="more than"):
        head.grow(1, target.model)


def test_with_vocab_keeps_the_features_and_proposes_only_the_new_ids(tiny):
    target = tiny["target"]
    head = load_head(tiny["head_dir"], target.model)
    small = head.with_vocab(torch.tensor([3, 5, 7]), target.model)
    torch.manual_seed(2)
    tok, feats = torch.randint(0, 32, (1, 6)), torch.randn(1, 6, target.model.config.hidden_size)
    with torch.no_grad():
        y = head(tok, feats)
        assert torch.equal(y, small(tok, feats))
        w = target.model.get_output_embeddings().weight
        assert torch.allclose(small.logits(y), y @ w[[3, 5, 7]].T)
    prop = FeatureHeadProposer(small, target)
    ids = PROMPTS[0]
    res = generate(target, prop, ids, gamma=3, max_new_tokens=12, stop_on_eos=False)
    drafted = {d.token_id for r in res.rounds for d in r.drafted}
    assert drafted and drafted <= {3, 5, 7}
    assert res.token_ids == hf_greedy(target, ids, 12)


@pytest.mark.parametrize("path", ["default", "onednn"])
def test_direct_draft_steps_are_the_body_forward_bit_for_bit(tiny, path):
    """Draft steps skip LlamaModel.forward (``FeatureHead._step``): the same rotary embedding, layers and norm with
    the mask LlamaModel would build, so the same bits as the body's own forward and the same cache, on PyTorch's path
    and on a fast path (lean layers), after caches of several lengths: one pair (no mask), several pairs (the causal
    mask, compared with ``create_causal_mask``'s) and a token tree's prepared 4D mask."""
    import copy

    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask

    from engine.decoding import compute
    from engine.decoding.attention import model_mask

    if path == "onednn" and compute.onednn._ONEDNN_OP is None:
        pytest.skip("this PyTorch build has no oneDNN linear op")
    target = tiny["target"]
    head = FeatureHead(target.model.config, 2, torch.arange(0, 32, 2))
    head.init_from_target(target.model)
    head.eval().bind(target.model)
    compute.apply_path(head, path)
    gen = torch.Generator().manual_seed(1)
    H = head.hidden_size
    checked = []
    try:
        with torch.inference_mode():
            for n_cached in (1, 5, 17):
                for kind, n in (("one pair", 1), ("causal", 3), ("tree", 3)):
                    cache = DynamicCache()
                    head(torch.randint(0, 32, (1, n_cached), generator=gen),
                         torch.randn(1, n_cached, H, generator=gen), position_ids=torch.arange(n_cached)[None],
                         cache=cache)
                    tok = torch.randint(0, 32, (1, n), generator=gen)
                    feat = torch.randn(1, n, H, generator=gen)
                    pos = torch.arange(n_cached, n_cached + n)[None]
                    mask = None
                    if kind == "tree":  # node 0 and its two children: each sees the cache, its ancestors, itself
                        vis = torch.zeros(1, n, n_cached + n, dtype=torch.bool)
                        vis[..., :n_cached] = True
                        for r, anc in enumerate(([0], [0, 1], [0, 2])):
                            vis[0, r, [n_cached + a for a in anc]] = True
                        mask = model_mask(vis, head.body)
                        pos = torch.tensor([[n_cached, n_cached + 1, n_cached + 1]])
                    direct = head._direct_mask(feat, mask, pos, cache)
                    want = create_causal_mask(config=head.body.config, inputs_embeds=feat, attention_mask=mask,
                                              cache=copy.deepcopy(cache), position_ids=pos)
                    assert direct is not False
                    assert (direct is None and want is None) or torch.equal(direct, want), kind
                    other = copy.deepcopy(cache)
                    fast = head(tok, feat, attention_mask=mask, position_ids=pos, cache=cache)
                    FeatureHead.DIRECT_STEP = False
                    slow = head(tok, feat, attention_mask=mask, position_ids=pos, cache=other)
                    FeatureHead.DIRECT_STEP = True
                    assert torch.equal(fast, slow), kind
                    for a, b in zip(cache.layers, other.layers):
                        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                    checked.append(kind)
    finally:
        FeatureHead.DIRECT_STEP = True
        compute.apply_path(head, "default")
    assert len(checked) == 9
    # an empty cache with several pairs, a 2D padding mask, autograd: the body's forward as before
    assert head._direct_mask(torch.zeros(1, 2, H), None, torch.tensor([[0, 1]]), DynamicCache()) is False
    assert head._direct_mask(torch.zeros(1, 1, H), torch.ones(1, 1), torch.tensor([[0]]), DynamicCache()) is False
    assert head._direct_mask(torch.zeros(1, 1, H), None, torch.tensor([[0]]), DynamicCache()) is False


def test_q8_0_blocks_hand_computed():
    """One block by hand: max |w| = 1.27 gives d = fp16(0.01) rounded down, and every value comes back as d · q."""
    from engine.decoding.draft_head import q8_0_blocks, q8_0_values

    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 1.27, -0.5, 0.004
    q, d = q8_0_blocks(w)
    d16 = torch.tensor(0.01, dtype=torch.float16)
    if d16.float() > torch.tensor(1.27) / 127:  # fp16(0.01) is above 0.01: the number below it
        d16 = (d16.view(torch.int16) - 1).view(torch.float16)
    assert d.dtype == torch.float16 and float(d[0, 0]) == float(d16)
    assert q.dtype == torch.int8 and q[0, 0] == 127  # the largest magnitude gets 127 exactly
    assert q[0, 1] == round(-0.5 / float(d16)) and q[0, 2] == round(0.004 / float(d16)) and q[0, 3:].eq(0).all()
    back = q8_0_values(q, d)
    assert torch.equal(back, q.float() * d.float())
    assert (back - w).abs().max() <= float(d16) / 2 + 1.27 * 2 ** -11
    # a block of zeros, and one whose scale underflows fp16, come back as zeros
    z = torch.zeros(2, 32)
    z[1] = 1e-7
    q, d = q8_0_blocks(z)
    assert q.eq(0).all() and torch.equal(q8_0_values(q, d), torch.zeros(2, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_blocks(torch.zeros(2, 16))
    with pytest.raises(ValueError, match="non-finite"):
        q8_0_blocks(torch.full((1, 32), float("nan")))


def test_q8_0_head_is_the_kernels_exact_q8_form(tiny, monkeypatch):
    """A head saved as Q8_0 loads with every matrix at its Q8_0 values, the streaming kernel finds their exact "q8"
    form (the kernel's own check, which recomputes each scale; on the fp32 arithmetic, pinned here), and it still
    decodes exactly as plain greedy."""
    monkeypatch.setenv("SPEEDUP_LAB_ARITHMETIC", "fp32")
    from safetensors.torch import load_file

    from engine.decoding import compute
    from engine.decoding.draft_head import q8_0_values

    target = tiny["target"]
    head = load_head(tiny["head_dir"], target.model)
    folder = save_head(head, tiny["root"] / "head-q8", weights="q8_0")
    stored = load_file(str(folder / "model.safetensors"))
    matrices = [k for k in head.state_dict() if k.endswith(".weight") and head.state_dict()[k].dim() == 2]
    assert matrices and all(stored[k + ".q8"].dtype == torch.int8 and k not in stored for k in matrices)
    assert json.loads((folder / "head_config.json").read_text())["weights"] == "q8_0"
    q8 = load_head(folder, target.model)
    for k in matrices:
        assert torch.equal(q8.state_dict()[k], q8_0_values(stored[k + ".q8"], stored[k + ".d"])), k
        assert not torch.equal(q8.state_dict()[k], head.state_dict()[k]), k  # it was quantized
    if compute.stream_kernel() is not None:
        try:
            compute.apply_path(q8, "stream")
            formats = compute.weight_formats([q8])
            # every matrix (fused groups counted once) read as Q8_0: ~1.125 bytes a value
            assert set(formats["count"]) == {"q8"}, formats
            assert formats["read_bytes"] * 3 < formats["fp32_bytes"], formats
        finally:
            compute.apply_path(q8, "default")
    for ids in PROMPTS:
        ref = hf_greedy(target, ids, 16)
        prop = make_proposer(str(folder), target)
        assert generate(target, prop, ids, gamma=3, max_new_tokens=16, stop_on_eos=False).token_ids == ref


def test_q8_0_head_with_broken_blocks_is_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_head(load_head(tiny["head_dir"], tiny["target"].model), tmp_path / "q8", weights="q8_0")
    state = load_file(str(folder / "model.safetensors"))
    key = next(k for k in state if k.endswith(".d"))
    state[key] = state[key][:, :0].contiguous()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="Q8_0"):
        load_head(folder, tiny["target"].model)
    with pytest.raises(ValueError, match="Unknown head weight format"):
        save_head(load_head(tiny["head_dir"], tiny["target"].model), tmp_path / "x", weights="q4")


def test_quantize_head_command_writes_what_save_head_writes(tiny, tmp_path):
    """``python -m engine.training.quantize_head`` on a saved fp16 head gives the tensors ``save_head(…, "q8_0")``
    gives, keeps the folder's other files, and refuses a head that is Q8_0 already."""
    from safetensors.torch import load_file

    from engine.training.quantize_head import main

    src = tmp_path / "src"
    save_head(load_head(tiny["head_dir"], tiny["target"].model), src, meta={"target": "tiny"})
    (src / "README.md").write_text("card")
    assert main([str(src), "--out", str(tmp_path / "q")]) == 0
    want = load_file(str(save_head(load_head(src, tiny["target"].model), tmp_path / "want", weights="q8_0")
                         / "model.safetensors"))
    got = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    cfg = json.loads((tmp_path / "q" / "head_config.json").read_text())
    assert cfg["weights"] == "q8_0" and cfg["quantized_from"] == "f16" and cfg["target"] == "tiny"
    assert (tmp_path / "q" / "README.md").read_text() == "card"
    assert main([str(tmp_path / "q"), "--out", str(tmp_path / "again")]) == 2
