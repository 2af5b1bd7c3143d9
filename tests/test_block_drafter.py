"""The DFlash-style block drafter (engine.decoding.block_drafter) and its trainer (engine.training.train_block):
the training mask by hand, the proposer's cached block pass against a from-scratch pass and against the training
forward, exact greedy output (chain, tree, batch, the room scheduler), the sampling law through the lossless
rules, bad input, loading errors, the block-size choice by hand, and training on a tiny random target."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine.decoding.attention import model_mask
from engine.decoding.batch import generate_batch
from engine.decoding.block_drafter import (BlockDrafter, BlockProposer, check_block_size, is_block_folder,
                                           load_block_drafter, save_block_drafter)
from engine.decoding.drafts import make_proposer
from engine.decoding.models import load_model
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import SpeculativeDecoder, generate
from engine.errors import InputError, ModelLoadError
from engine.training.train_block import (block_forward, block_visibility, choose_block, collate, sequences,
                                         slot_accuracy, train_block)
from tests.test_draft_head import exact_joint_2
from tests.test_medusa import PROMPTS, hf_greedy
from tests.test_sampling import g_test_pvalue
from tests.tiny_models import save_tiny_llama

ACC = [[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.0]]  # slot j, rank r


def random_drafter(target_model, vocab_ids, max_block=5, seed=1, scale=0.3) -> BlockDrafter:
    d = BlockDrafter(target_model.config, 1, max_block, vocab_ids)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return d.bind(target_model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random target (hidden 32, 32 ids) and a random block drafter (blocks ≤ 5) over 20 of its ids."""
    root = tmp_path_factory.mktemp("block")
    target = load_model(str(save_tiny_llama(root / "target", vocab_size=32, layers=3, seed=0)), device="cpu")
    drafter = random_drafter(target.model, torch.arange(2, 22))
    save_block_drafter(drafter, root / "block", meta={"target": "tiny", "slot_accuracy": ACC + [[0.1, 0.0, 0.0]]})
    return dict(target=target, dir=root / "block", root=root)


def test_block_visibility_by_hand():
    """4 context entries, anchors 1 and 3, blocks of 2 (DFlash §4.2's rules)."""
    vis = block_visibility(torch.tensor([[1, 3]]), torch.tensor([[True, True]]), ctx_len=4, block=2)[0].int()
    want = torch.tensor([
        # c0 c1 c2 c3 | b1 b1 | b2 b2
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 0, 1, 1, 0, 0],  # block at anchor 1: context entry 0 only, its own two slots
        [1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 1],  # anchor 3: entries 0..2
        [1, 1, 1, 0, 0, 0, 1, 1],
    ])
    assert torch.equal(vis, want)
    pad = block_visibility(torch.tensor([[2, 0]]), torch.tensor([[True, False]]), ctx_len=3, block=2)[0]
    assert not pad[5:, :3].any() and pad[5:, 5:].all()  # a padding block sees only itself


def test_check_block_size():
    assert check_block_size(2, 16) == 2 and check_block_size(16, 16) == 16
    for bad in (0, 1, 17, 2.0, True, "4"):
        with pytest.raises(InputError, match="blocks of 2 to 16"):
            check_block_size(bad, 16)


def reference_block_logits(drafter, target, seq, block):
    """From scratch: the target's hidden states of seq[:-1], every context entry and the block in one uncached
    drafter pass; the slots' logits."""
    with torch.no_grad():
        h = target.model.get_decoder()(input_ids=torch.tensor([seq[:-1]])).last_hidden_state[0]
        n = len(seq) - 1
        ctx = drafter.fc(h)[None]
        blk = drafter.block_inputs(torch.tensor([seq[-1]]), block, h[-1][None])
        vis = torch.zeros(n + block, n + block, dtype=torch.bool)
        vis[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        vis[n:] = True
        out = drafter(torch.cat([ctx, blk], 1), model_mask(vis[None], drafter.body), torch.arange(n + block)[None])
        return drafter.logits(out[0, n + 1:]).float()


def test_cached_block_pass_matches_a_fresh_computation(tiny):
    """Every round of a greedy run: the proposer's cached pass (new context entries + block, then the block cropped)
    gives the same slot logits as a from-scratch pass; the chain is their argmax; several block sizes."""
    target = tiny["target"]
    prop = make_proposer(str(tiny["dir"]), target)
    assert isinstance(prop, BlockProposer) and prop.max_block == 5
    dec = SpeculativeDecoder(target, prop, PROMPTS[1], gamma=4, max_new_tokens=20, stop_on_eos=False)
    dec.prefill()
    checked = 0
    while not dec.finished:
        for block in (2, 5, 3):
            got = prop.block_logits(dec.seq, block)
            ref = reference_block_logits(prop.drafter, target, dec.seq, block)
            assert torch.allclose(got, ref, atol=1e-4), (len(dec.seq), block)
            checked += 1
        chain = prop.propose(dec.seq, 4, SamplingConfig(), torch.Generator())
        ref = reference_block_logits(prop.drafter, target, dec.seq, 5)
        assert chain.tokens == [int(prop.vocab_ids[int(ref[j].argmax())]) for j in range(4)]
        assert torch.allclose(chain.q.sum(-1), torch.ones(4, dtype=chain.q.dtype), atol=1e-5)
        dec.step()
    assert checked >= 9


def test_training_forward_agrees_with_drafting(tiny):
    """The training pass (many blocks in one pass, DFlash's mask) gives, for each anchor a, the logits the proposer
    computes when drafting after x[:a + 1]: training and inference see the same context and positions."""
    from engine.training.draft_data import Sample

    target = tiny["target"]
    drafter = load_block_drafter(tiny["dir"], target.model)
    x = torch.tensor(PROMPTS[1] + [4, 5, 6, 7, 8, 9])
    P = len(PROMPTS[1])
    with torch.no_grad():
        h = target.model.get_decoder()(input_ids=x[None]).last_hidden_state[0]
    R = len(x) - P
    s = Sample(x[:P], x[P:], torch.zeros(R, 2, dtype=torch.int32), torch.zeros(R, 2, dtype=torch.float16), 0.0)
    seqs = sequences([s], [h])
    batch = collate(seqs, [0], 4, 8, None, drafter.hidden_size)
    with torch.no_grad():
        logits = block_forward(drafter, batch, 4)[0]  # [A, 3, Vd]
    for b in range(int(batch["keep"].sum())):
        a = int(batch["anchors"][0, b])
        ref = reference_block_logits(drafter, target, x[:a + 1].tolist(), 4)
        assert torch.allclose(logits[b].float(), ref, atol=1e-4), a
        assert batch["label"][0, b].tolist() == [int(x[a + j]) if a + j < len(x) else -1 for j in range(1, 4)]


def test_chain_greedy_identical_to_transformers_generate(tiny):
    """Chains of every γ (γ ≥ the trained block is cut to max_block − 1) give plain greedy's output."""
    target = tiny["target"]
    for ids in PROMPTS:
        ref = hf_greedy(target, ids, 24)
        for gamma in (1, 2, 4, 7):
            prop = make_proposer(str(tiny["dir"]), target)
            got = generate(target, prop, ids, gamma=gamma, max_new_tokens=24, stop_on_eos=False)
            assert got.token_ids == ref, gamma
            assert max(r.n_drafted for r in got.rounds) <= min(gamma, 4)


def test_tree_greedy_identical_to_transformers_generate(tiny):
    """Static trees of several sizes and depth limits give plain greedy's output; each round's tree is deterministic
    and no deeper than the block allows."""
    target = tiny["target"]
    for ids in PROMPTS:
        ref = hf_greedy(target, ids, 24)
        for tree, gamma in ((6, 3), (3, 2), (1, 1), (12, 4), (5, 8)):
            prop = make_proposer(str(tiny["dir"]), target)
            got = SpeculativeDecoder(target, prop, ids, gamma=gamma, tree=tree, max_new_tokens=24,
                                     stop_on_eos=False).run()
            assert got.token_ids == ref, (tree, gamma)
            assert all(max(n.depth for n in r.tree.nodes) <= min(gamma, 4)
                       for r in got.rounds if r.tree and r.tree.nodes)


def test_tree_paths_follow_the_slot_accuracies(tiny):
    prop = make_proposer(str(tiny["dir"]), tiny["target"])
    # Π a_j(r): [0] .5, [1] .2, [0,0] .15, [2] .1, [1,0] .06, [0,1] .05, [0,0,0] .03
    assert prop.tree_paths(4, 3) == [[0], [1], [2], [0, 0]]
    assert prop.tree_paths(3, 1) == [[0], [1], [2]]
    assert prop.tree_paths(0, 3) == []


def test_batch_and_room_greedy_identical(tiny):
    """Ragged batches of block drafters (one per row) give each row plain greedy's output."""
    target = tiny["target"]
    for b in (1, 3):
        props = [make_proposer(str(tiny["dir"]), target) for _ in range(b)]
        res = generate_batch(target, props, PROMPTS[:b], gamma=3, max_new_tokens=16, stop_on_eos=False)
        for ids, r in zip(PROMPTS, res.results):
            assert r.token_ids == hf_greedy(target, ids, 16)


def test_room_scheduler_greedy_identical(tiny):
    from engine.decoding.scheduler import Room

    target = tiny["target"]
    room = Room(target, no_draft_above=None)
    try:
        decs = [SpeculativeDecoder(target, make_proposer(str(tiny["dir"]), target), ids, gamma=3, max_new_tokens=12,
                                   stop_on_eos=False) for ids in PROMPTS]
        import threading

        outs = [None] * len(decs)

        def run(i):
            outs[i] = room.run(decs[i])

        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(decs))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        for ids, res in zip(PROMPTS, outs):
            assert res is not None and res.token_ids == hf_greedy(target, ids, 12)
    finally:
        room.close()


def test_confidence_cut_stops_the_chain_and_keeps_the_output(tiny):
    target = tiny["target"]
    ids = PROMPTS[0]
    ref = hf_greedy(target, ids, 20)
    prop = make_proposer(str(tiny["dir"]), target)
    prop.confidence_threshold = 0.2
    got = generate(target, prop, ids, gamma=4, max_new_tokens=20, stop_on_eos=False)
    assert got.token_ids == ref
    assert min(r.n_drafted for r in got.rounds) < 4  # random slots are unsure: some rounds were cut
    with pytest.raises(InputError, match="confidence cut"):
        prop.confidence_threshold = 1.0


@pytest.mark.slow
@pytest.mark.parametrize("tree", [0, 4])
def test_sampling_preserves_the_distribution(tmp_path, tree):
    """G-test of the joint law of 2 generated tokens against the exact one, chain (the slots' own draws, q = each
    slot's warped distribution) and static tree (deterministic picks, the lossless tree rule)."""
    cfg = SamplingConfig(temperature=0.9, top_k=6)
    words = ["a", "b", "c", "d", "e", "f"]
    target = load_model(str(save_tiny_llama(tmp_path / "t", vocab_size=8, layers=2, seed=4, words=words,
                                            init=0.6)), device="cpu")
    save_block_drafter(random_drafter(target.model, torch.tensor([0, 2, 3, 5, 7]), max_block=3, seed=3, scale=0.8),
                       tmp_path / "b", meta={"slot_accuracy": [[0.4, 0.3, 0.2], [0.3, 0.2, 0.1]]})
    prompt = [2, 3, 4, 2]
    exact = exact_joint_2(target, prompt, cfg)
    counts: dict[tuple, int] = {}
    runs = 2000
    prop = make_proposer(str(tmp_path / "b"), target)
    for seed in range(runs):
        res = SpeculativeDecoder(target, prop, prompt, gamma=2, tree=tree, sampling=cfg, seed=seed, max_new_tokens=2,
                                 stop_on_eos=False).run()
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact), "a pair of tokens with probability 0 was generated"
    big = [c for c in exact if exact[c] * runs >= 5]
    obs = [counts.get(c, 0) for c in big] + [runs - sum(counts.get(c, 0) for c in big)]
    probs = [exact[c] for c in big] + [1 - sum(exact[c] for c in big)]
    pval = g_test_pvalue(torch.tensor(obs, dtype=torch.float64), torch.tensor(probs, dtype=torch.float64))
    assert len(big) >= 5 and pval > 1e-3, (len(big), pval)


def test_save_load_round_trip_and_loader_errors(tiny, tmp_path):
    target = tiny["target"]
    d = load_block_drafter(tiny["dir"], target.model)
    again = load_block_drafter(tiny["dir"], target.model)
    for (k, a), (_, b) in zip(d.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    assert d.max_block == 5 and d.vocab_ids.tolist() == list(range(2, 22))
    assert is_block_folder(tiny["dir"]) and not is_block_folder(tiny["root"]) and not is_block_folder(None)
    with pytest.raises(ModelLoadError, match="Cannot read"):
        load_block_drafter(tmp_path / "nowhere", target.model)
    bad = tmp_path / "bad"
    save_block_drafter(d, bad)
    cfg = json.loads((bad / "block_config.json").read_text())
    (bad / "block_config.json").write_text(json.dumps({**cfg, "format": "other/1"}))
    with pytest.raises(ModelLoadError, match="format"):
        load_block_drafter(bad, target.model)
    (bad / "block_config.json").write_text(json.dumps({**cfg, "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="another target"):
        load_block_drafter(bad, target.model)
    (bad / "block_config.json").write_text(json.dumps({**cfg, "max_block": 1}))
    with pytest.raises(ModelLoadError, match="bad config"):
        load_block_drafter(bad, target.model)
    with pytest.raises(InputError, match="embedded target only"):
        make_proposer("embedded-block", target)


def test_block_size_past_the_trained_maximum_is_a_clear_error(tiny):
    target = tiny["target"]
    prop = make_proposer(str(tiny["dir"]), target)
    dec = SpeculativeDecoder(target, prop, PROMPTS[0], gamma=2, max_new_tokens=4, stop_on_eos=False)
    dec.prefill()
    with pytest.raises(InputError, match="blocks of 2 to 5"):
        prop.block_logits(dec.seq, 6)
    with pytest.raises(InputError, match="blocks of 2 to 5"):
        prop.block_logits(dec.seq, 1)


def test_choose_block_by_hand():
    acc = {1: 0.6, 2: 0.9, 3: 1.0}  # mean accepted draft tokens with γ = 1, 2, 3
    block_ms = {2: 5.0, 3: 5.0, 4: 6.0}
    pass_cost = [1.0, 1.2, 1.3, 1.6]
    out = choose_block(acc, block_ms, 50.0, pass_cost)
    # B=2: 1.6 / (0.1 + 1.2) = 1.2308; B=3: 1.9 / (0.1 + 1.3) = 1.3571; B=4: 2.0 / (0.12 + 1.6) = 1.1628
    assert out["block"] == 3
    assert [r["score"] for r in out["by_block"]] == pytest.approx([1.2308, 1.3571, 1.1628], abs=1e-4)
    with pytest.raises(InputError):
        choose_block({}, block_ms, 50.0, pass_cost)


def test_training_fits_a_tiny_targets_answers_and_keeps_the_best_epoch(tmp_path):
    """150 steps on the tiny target's own greedy answers: slot-1 top-1 on them rises well above the untrained
    drafter's; slot_accuracy's fields are consistent; with a validation set the drafter ends at the best epoch."""
    from engine.training.draft_data import Sample

    target = load_model(str(save_tiny_llama(tmp_path / "t", vocab_size=32, layers=2, seed=2, init=0.5)), device="cpu")
    rng = random.Random(0)
    samples, feats = [], []
    for i in range(24):
        prompt = [rng.randrange(2, 32) for _ in range(4)]
        ans = hf_greedy(target, prompt, 12)
        x = torch.tensor(prompt + ans)
        with torch.no_grad():
            top = torch.log_softmax(target.model(input_ids=x[None]).logits[0, len(prompt) - 1:-1], -1).topk(4)
            feats.append(target.model.get_decoder()(input_ids=x[None]).last_hidden_state[0])
        samples.append(Sample(torch.tensor(prompt), torch.tensor(ans), top.indices.int(), top.values.half(), 0.0))
    seqs = sequences(samples, feats)
    drafter = BlockDrafter(target.model.config, 1, 4, torch.arange(32))
    drafter.init_from_target(target.model)
    drafter.bind(target.model)
    before = slot_accuracy(drafter, seqs, 4)
    log = train_block(drafter, seqs, 32, minutes=10, blocks=[2, 4], lr=3e-3, batch=8, n_anchors=8, max_steps=150,
                      seed=0, val=seqs[:8], log_every=50)
    after = slot_accuracy(drafter, seqs, 4)
    assert len(after["acc"]) == 3 and all(len(a) == 10 for a in after["acc"])
    assert after["top1"] == [a[0] for a in after["acc"]]
    assert after["accepted_by_gamma"][1] <= after["accepted_by_gamma"][3] <= 3
    assert after["top1"][0] > before["top1"][0] + 0.2, (before["top1"], after["top1"])
    vals = [sum(r["val_top1"][:4]) / len(r["val_top1"][:4]) for r in log if "val_top1" in r]
    final = slot_accuracy(drafter, seqs[:8], 4, ranks=1, greedy_only=False)
    assert len(vals) >= 2 and sum(final["top1"]) / 3 == pytest.approx(max(vals), abs=1e-3)


def test_cli_block_drafter_runs_and_refuses_a_block_past_its_maximum(tiny, capsys):
    """`generate --draft <block folder>`: γ = block − 1 runs with plain greedy's output; γ 0 or a block past the
    trained maximum, and --tree-branching on its static tree, are one error line and exit status 2."""
    from engine.__main__ import main

    tgt, block = str(tiny["root"] / "target"), str(tiny["dir"])
    base = ["generate", "--target", tgt, "--draft", block, "--no-chat", "--prompt", "w1 w2 w3 w1 w2",
            "--max-new-tokens", "10"]
    assert main(base + ["--gamma", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main(["generate", "--target", tgt, "--draft", "none", "--no-chat", "--prompt", "w1 w2 w3 w1 w2",
                 "--max-new-tokens", "10", "--json"]) == 0
    assert out["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    for args, msg in ((["--gamma", "5"], "blocks of 2 to 5"), (["--gamma", "0"], "γ"),
                      (["--tree", "4", "--tree-branching", "2"], "static tree")):
        assert main(base + args) == 2, args
        assert msg in capsys.readouterr().err, args
