"""Medusa heads (engine.decoding.medusa): the tree choice against hand-computed values, the proposer's
chain and static tree against a from-scratch computation, exact greedy output, the chain's sampling law,
loading errors, and training (engine.training.train_medusa) on a tiny random target."""

from __future__ import annotations

import json

import pytest
import torch

from engine.decoding.medusa import (MedusaHeads, MedusaProposer, best_paths, choose_tree, expected_accepted,
                                    is_medusa_folder, load_medusa, path_acceptance, save_medusa,
                                    tree_from_candidates, tree_of_size, validate_choices)
from engine.decoding.models import load_model
from engine.decoding.drafts import make_proposer
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import SpeculativeDecoder, generate
from engine.errors import InputError, ModelLoadError
from tests.test_draft_head import exact_joint_2
from tests.test_sampling import g_test_pvalue
from tests.tiny_models import save_tiny_llama

ACC = [[0.5, 0.2, 0.1], [0.4, 0.1, 0.05], [0.3, 0.1, 0.0]]  # a_k(r): head k+1, rank r


def random_heads(hidden: int, n_heads: int, vocab_ids: torch.Tensor, seed: int = 0, scale: float = 0.5,
                 layers: int = 1) -> MedusaHeads:
    """Heads with random (non-zero) W so that each head differs from the target's own LM head."""
    heads = MedusaHeads(hidden, n_heads, vocab_ids, layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return heads


def test_path_acceptance_and_best_paths_by_hand():
    assert path_acceptance([0], ACC) == pytest.approx(0.5)
    assert path_acceptance([0, 0], ACC) == pytest.approx(0.2)
    assert path_acceptance([1, 0, 0], ACC) == pytest.approx(0.2 * 0.4 * 0.3)
    # scores: [0] .5, [1] .2, [0,0] .2, [2] .1, [1,0] .08, [0,0,0] .06, [0,1] .05, ...; the tie [1] / [0,0]
    # goes to the shorter path
    assert best_paths(ACC, 1) == [[0]]
    assert best_paths(ACC, 3) == [[0], [1], [0, 0]]
    assert best_paths(ACC, 5) == [[0], [1], [2], [0, 0], [1, 0]]
    assert best_paths(ACC, 6) == [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]
    assert expected_accepted(best_paths(ACC, 6), ACC) == pytest.approx(0.5 + 0.2 + 0.1 + 0.2 + 0.08 + 0.06)
    assert best_paths(ACC, 0) == []
    with pytest.raises(InputError):
        best_paths(ACC, 40)  # 3 + 9 + 27 = 39 paths exist
    with pytest.raises(InputError):
        path_acceptance([0, 3], ACC)


def test_choose_tree_maximises_tokens_per_unit_of_pass_time():
    cost = [1.0, 1.1, 1.2, 1.5, 1.5, 1.6, 1.7]  # a pass over m tokens, m = 1..7
    out = choose_tree(ACC, cost)
    # E_n = 1 + Σ best n paths: n=0 1.0/1.0, 1 1.5/1.1=1.364, 2 1.7/1.2=1.417, 3 1.9/1.5, 4 2.0/1.5=1.333,
    # 5 2.08/1.6=1.3, 6 2.14/1.7=1.259 → n = 2
    assert out["nodes"] == 2 and out["medusa_choices"] == [[0], [1]]
    assert out["expected_tokens"] == pytest.approx(1.7)
    assert [r["score"] for r in out["by_size"]][:3] == pytest.approx([1.0, 1.5 / 1.1, 1.7 / 1.2], abs=1e-4)
    flat = choose_tree(ACC, [1.0] * 7)  # free passes: the largest tree wins
    assert flat["nodes"] == 6
    with pytest.raises(InputError):
        choose_tree(ACC, [])


def test_choose_tree_again_rewrites_the_saved_tree_for_another_cost_curve(tmp_path):
    from engine.training.train_medusa import choose_tree_again

    heads = MedusaHeads(8, 3, torch.arange(5))
    save_medusa(heads, tmp_path / "m", meta={"medusa_choices": [[0]], "head_accuracy": ACC})
    (tmp_path / "m" / "train_meta.json").write_text(json.dumps({"tree": {}, "pass_cost": [1.0]}))
    # same curve as above: n = 2 wins (1.7 / 1.2)
    out = choose_tree_again(tmp_path / "m", [1.0, 1.1, 1.2, 1.5, 1.5, 1.6, 1.7], 6)
    cfg = json.loads((tmp_path / "m" / "medusa_config.json").read_text())
    assert out["nodes"] == 2 and cfg["medusa_choices"] == [[0], [1]]
    assert cfg["tree"]["expected_tokens"] == pytest.approx(1.7)
    # passes that cost the same up to 4 tokens: n = 3 (E = 1.9) beats n = 2 (1.7) and n = 0..1
    out = choose_tree_again(tmp_path / "m", [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0], 6)
    assert out["medusa_choices"] == [[0], [1], [0, 0]]
    assert json.loads((tmp_path / "m" / "train_meta.json").read_text())["pass_cost"][4] == 2.0
    save_medusa(heads, tmp_path / "bare")
    with pytest.raises(InputError, match="head_accuracy"):
        choose_tree_again(tmp_path / "bare", [1.0, 1.0], 1)


def test_validate_choices():
    assert validate_choices([[0, 1], [0], [1]], 2) == [[0], [1], [0, 1]]
    for bad in ([[0, 1]], [[0], [0]], [[0, 0, 0]], [[-1]], [[]], "x"):
        with pytest.raises(InputError):
            validate_choices(bad, 2)


def test_tree_from_candidates_is_medusas_cartesian_tree():
    cand = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    t = tree_from_candidates(cand, choices, 40)
    assert t.tokens == [10, 11, 20, 21, 20, 30]
    assert t.parents == [-1, -1, 0, 0, 1, 2]
    assert t.depths == [1, 1, 2, 2, 2, 3]
    assert t.draw == "deterministic"
    assert torch.equal(t.q.argmax(-1), torch.tensor(t.tokens)) and torch.equal(t.q.sum(-1), torch.ones(6))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random target (hidden 32, 32 ids) and random 3-head Medusa heads over 20 of its ids."""
    root = tmp_path_factory.mktemp("medusa")
    target = load_model(str(save_tiny_llama(root / "target", vocab_size=32, layers=3, seed=0)), device="cpu")
    heads = random_heads(32, 3, torch.arange(2, 22), seed=1)
    acc = [[0.5, 0.2, 0.1, 0.05], [0.3, 0.1, 0.05, 0.0], [0.2, 0.1, 0.0, 0.0]]
    # the best 7 paths by Π a_k(r): [0] .5, [1] .2, [0,0] .15, [2] .1, [1,0] .06, [3] .05, [0,1] .05
    choices = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0]]
    assert best_paths(acc, 7) == choices
    save_medusa(heads, root / "heads", meta={"target": "tiny", "medusa_choices": choices, "head_accuracy": acc})
    return dict(target=target, dir=root / "heads", root=root, choices=choices)


def hf_greedy(lm, ids, n):
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    return out[0, len(ids):].tolist()


PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 3, 12, 20, 4, 9, 3, 12, 2], [4, 7]]


def reference_logits(heads, target, seq, first_round=False):
    """Head logits from scratch: one target pass over seq[:-1] (seq in the first round), heads on the last
    hidden state."""
    with torch.no_grad():
        fed = seq if first_round else seq[:-1]
        h = target.model.get_decoder()(input_ids=torch.tensor([fed])).last_hidden_state[0, -1]
        return heads.logits(h).float()


def target_argmax(target, seq):
    """The target's greedy next token after seq, from scratch."""
    with torch.no_grad():
        return int(target.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())


def test_save_load_round_trip(tiny):
    target = tiny["target"]
    heads = load_medusa(tiny["dir"], target.model)
    again = load_medusa(tiny["dir"], target.model)
    for (k, a), (_, b) in zip(heads.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    assert heads.vocab_ids.tolist() == list(range(2, 22))
    assert heads.config["medusa_choices"] == validate_choices(tiny["choices"], 3)
    assert is_medusa_folder(tiny["dir"]) and not is_medusa_folder(tiny["root"])
    assert tree_of_size(heads, 0) == [] and tree_of_size(heads, 3) == [[0], [1], [0, 0]]


def test_chain_and_tree_match_a_fresh_computation(tiny):
    """Every round: the chain is each head's argmax, the tree its static shape over each head's top-r, both
    computed from the target's hidden state at the newest committed position (recomputed from scratch)."""
    target = tiny["target"]
    prop = make_proposer(str(tiny["dir"]), target)
    assert isinstance(prop, MedusaProposer) and prop.is_tree and prop.tree_size == 7
    dec = SpeculativeDecoder(target, prop, PROMPTS[1], gamma=3, max_new_tokens=30, stop_on_eos=False)
    dec.prefill()
    cfg = SamplingConfig()
    checked = 0
    vocab = prop.vocab_ids
    dec.step()  # round 0 drafts from another position: test_first_round_drafts_from_the_last_prompt_position
    while not dec.finished:
        assert not prop.round_zero(dec.seq)
        ref = reference_logits(prop.heads, target, dec.seq)
        chain = prop.propose(dec.seq, 3, cfg, torch.Generator())
        assert chain.tokens == [int(vocab[int(ref[j].argmax())]) for j in range(3)]
        assert torch.allclose(chain.q.sum(-1), torch.ones(3), atol=1e-5)
        assert float(chain.q[:, 22:].abs().sum()) == 0.0 and float(chain.q[:, :2].abs().sum()) == 0.0
        tree = prop.propose_tree(dec.seq, 7, 3, cfg, torch.Generator())
        assert prop.propose_tree(dec.seq, 3, 1, cfg, torch.Generator()).tokens == [int(top_) for top_ in
                                                                                  vocab[ref[0].topk(3).indices]]
        top = vocab[ref.topk(4, dim=-1).indices]
        want = [int(top[len(p) - 1, p[-1]]) for p in prop.choices]
        assert tree.tokens == want and tree.draw == "deterministic"
        assert prop.tree_paths(7, 3) == prop.choices  # the saved tree is the best 7-node tree of its accuracies
        assert tree.draft_probs == pytest.approx(
            [float(torch.softmax(ref, -1)[len(p) - 1, int(ref.topk(4, dim=-1).indices[len(p) - 1, p[-1]])])
             for p in prop.choices], abs=1e-5)
        assert prop.propose(dec.seq, 2, cfg, torch.Generator()).tokens == chain.tokens[:2]
        dec.step()
        checked += 1
    assert checked >= 8


def test_first_round_drafts_from_the_last_prompt_position(tiny):
    """Round 0 (after the prefill fed the whole prompt, length P): the heads read h_{P-1}, the position they
    were trained from (train_medusa.make_examples: t >= P - 1), not h_{P-2}; draft position 1 is the target's
    own greedy token there, position k + 1 head k's pick. From round 1 on they read h_{L-2} again."""
    target = tiny["target"]
    cfg = SamplingConfig()
    for ids in PROMPTS:
        prop = make_proposer(str(tiny["dir"]), target)
        dec = SpeculativeDecoder(target, prop, ids, gamma=3, tree=7, max_new_tokens=12, stop_on_eos=False)
        dec.prefill()
        assert prop.round_zero(dec.seq) and prop.target_lm.hidden.shape[0] == len(ids)
        ref = reference_logits(prop.heads, target, ids, first_round=True)
        wrong = reference_logits(prop.heads, target, ids) if len(ids) > 1 else None
        assert torch.allclose(prop.head_logits(dec.seq), ref, atol=1e-5)
        if wrong is not None:  # today's position would differ: the test pins the position, not a tie
            assert not torch.allclose(ref, wrong, atol=1e-3)
        vocab = prop.vocab_ids
        root = target_argmax(target, ids)
        chain = prop.propose(dec.seq, 3, cfg, torch.Generator())
        assert chain.tokens == [root] + [int(vocab[int(ref[j].argmax())]) for j in range(2)]
        with torch.no_grad():  # q's first row is the target's own distribution there
            p_root = torch.softmax(target.model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
        assert torch.allclose(chain.q[0], p_root, atol=1e-6)
        assert prop.propose(dec.seq, 1, cfg, torch.Generator()).tokens == [root]
        tree = prop.propose_tree(dec.seq, 7, 3, cfg, torch.Generator())
        # the root, then the best 6-node tree of depth <= 2 below it (paths shifted one level down)
        paths = prop.tree_paths(6, 2)
        top = vocab[ref.topk(4, dim=-1).indices]
        assert tree.tokens == [root] + [int(top[len(p) - 1, p[-1]]) for p in paths]
        assert tree.parents == [-1] + [0 if len(p) == 1 else 1 + paths.index(p[:-1]) for p in paths]
        assert tree.draw == "deterministic" and len(tree.draft_probs) == tree.size
        first = dec.step()
        assert first.n_accepted >= 1 and first.drafted[0].token_id == root  # greedy: the target's own token
        assert not prop.round_zero(dec.seq)
        later = reference_logits(prop.heads, target, dec.seq)
        assert torch.allclose(prop.head_logits(dec.seq), later, atol=1e-5)


def test_first_round_under_sampling_accepts_the_targets_own_draw(tiny):
    """Chain, T = 0.9: round 0's first draft token is drawn from the target's own warped distribution, q = p on
    that row, so min(1, p/q) = 1 exactly (the verifier warps the same logits in float64)."""
    target = tiny["target"]
    cfg = SamplingConfig(temperature=0.9, top_p=0.95)
    for seed in range(5):
        prop = make_proposer(str(tiny["dir"]), target)
        prop.choices = []
        dec = SpeculativeDecoder(target, prop, PROMPTS[0], gamma=3, sampling=cfg, seed=seed, max_new_tokens=8,
                                 stop_on_eos=False)
        r = dec.step()
        assert r.drafted[0].accept_prob == 1.0 and r.drafted[0].q == pytest.approx(r.drafted[0].p, abs=1e-12)


def test_batched_rows_draft_their_first_round_from_the_last_prompt_position(tiny):
    """Batched chain rows (engine.decoding.batch): round 0 drafts from h_{P-1} with the target's own token first,
    as alone, and every row's greedy output is plain greedy's."""
    from engine.decoding.batch import generate_batch

    target = tiny["target"]
    props = []
    for _ in PROMPTS:
        p = make_proposer(str(tiny["dir"]), target)
        p.choices = []
        props.append(p)
    res = generate_batch(target, props, PROMPTS, gamma=3, max_new_tokens=16, stop_on_eos=False)
    for ids, r in zip(PROMPTS, res.results):
        assert r.token_ids == hf_greedy(target, ids, 16)
        assert r.rounds[0].drafted[0].token_id == target_argmax(target, ids) and r.rounds[0].n_accepted >= 1


def test_chain_greedy_identical_to_transformers_generate(tiny):
    """--tree 0: each head's top-1 as a chain through the chain decoder, for every γ (γ > K is cut to K)."""
    target = tiny["target"]
    for ids in PROMPTS:
        ref = hf_greedy(target, ids, 24)
        for gamma in (1, 2, 3, 5):
            prop = make_proposer(str(tiny["dir"]), target)
            prop.choices = []
            got = generate(target, prop, ids, gamma=gamma, max_new_tokens=24, stop_on_eos=False)
            assert got.token_ids == ref, gamma
            assert max(r.n_drafted for r in got.rounds[1:]) <= 3 and got.rounds[0].n_drafted <= min(gamma, 4)


def test_tree_greedy_identical_to_transformers_generate(tiny):
    """Tree rounds (engine.decoding.speculative's tree rule) with the static tree: every size and depth
    limit gives plain greedy decoding's output; the trace holds the tree of each round."""
    target = tiny["target"]
    for ids in PROMPTS:
        ref = hf_greedy(target, ids, 24)
        for tree, gamma in ((7, 3), (3, 2), (1, 1), (12, 3), (5, 8)):
            prop = make_proposer(str(tiny["dir"]), target)
            got = generate_tree(target, prop, ids, gamma=gamma, tree=tree, max_new_tokens=24)
            assert got.token_ids == ref, (tree, gamma)
            assert all(r.tree is not None and len(r.tree.nodes) <= tree for r in got.rounds[:-1])
            assert all(max(n.depth for n in r.tree.nodes) <= min(gamma, 3) for r in got.rounds[1:] if r.tree)
            assert max(n.depth for n in got.rounds[0].tree.nodes) <= min(gamma, 4)  # the root + 3 heads
    assert any(r.n_accepted for r in got.rounds)  # random heads still hit sometimes on this tiny target


def generate_tree(target, prop, ids, gamma, tree, max_new_tokens, sampling=None, seed=0, accept="exact"):
    dec = SpeculativeDecoder(target, prop, ids, gamma=gamma, tree=tree, sampling=sampling, seed=seed,
                             max_new_tokens=max_new_tokens, stop_on_eos=False, accept=accept)
    return dec.run()


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=5)])
def test_tree_sampling_preserves_the_distribution(tmp_path, cfg):
    """G-test of the joint law of 2 generated tokens against the exact one, with the Medusa proposer's
    deterministic trees judged by the lossless tree rule (verify_tree_sampling)."""
    words = ["a", "b", "c", "d", "e", "f"]
    target = load_model(str(save_tiny_llama(tmp_path / "t", vocab_size=8, layers=2, seed=4, words=words,
                                            init=0.6)), device="cpu")
    acc = [[0.4, 0.3, 0.2], [0.3, 0.2, 0.1]]
    save_medusa(random_heads(32, 2, torch.tensor([0, 2, 3, 5, 7]), seed=3, scale=0.8), tmp_path / "m",
                meta={"medusa_choices": best_paths(acc, 5), "head_accuracy": acc})
    prompt = [2, 3, 4, 2]
    exact = exact_joint_2(target, prompt, cfg)
    counts: dict[tuple, int] = {}
    runs = 2000
    prop = make_proposer(str(tmp_path / "m"), target)
    for seed in range(runs):
        res = generate_tree(target, prop, prompt, gamma=2, tree=5, sampling=cfg, seed=seed, max_new_tokens=2)
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact), "a pair of tokens with probability 0 was generated"
    big = [c for c in exact if exact[c] * runs >= 5]
    obs = [counts.get(c, 0) for c in big] + [runs - sum(counts.get(c, 0) for c in big)]
    probs = [exact[c] for c in big] + [1 - sum(exact[c] for c in big)]
    pval = g_test_pvalue(torch.tensor(obs, dtype=torch.float64), torch.tensor(probs, dtype=torch.float64))
    assert len(big) >= 5 and pval > 1e-3, (len(big), pval)


def test_typical_acceptance_runs_and_is_labelled_lossy(tiny):
    target = tiny["target"]
    prop = make_proposer(str(tiny["dir"]), target)
    res = generate_tree(target, prop, PROMPTS[0], gamma=3, tree=7, max_new_tokens=12,
                        sampling=SamplingConfig(temperature=0.7), accept="typical")
    assert len(res.token_ids) == 12 and all(r.tree.rule == "typical (lossy)" for r in res.rounds if r.tree)


def test_zero_initialised_blocks_are_the_identity():
    """Medusa's init (W1 = 0): every head starts as the target's own LM head on h_t."""
    heads = MedusaHeads(8, 3, torch.arange(5))
    h = torch.randn(4, 8)
    assert torch.equal(heads(h), h[None].expand(3, -1, -1))


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=5)])
def test_chain_sampling_preserves_the_distribution(tmp_path, cfg):
    """G-test of the joint law of 2 generated tokens against the exact one; the heads cover only some
    ids (q = 0 where p > 0) and are random (many rejections and residual draws)."""
    words = ["a", "b", "c", "d", "e", "f"]
    target = load_model(str(save_tiny_llama(tmp_path / "t", vocab_size=8, layers=2, seed=4, words=words,
                                            init=0.6)), device="cpu")
    save_medusa(random_heads(32, 2, torch.tensor([0, 2, 3, 5, 7]), seed=3, scale=0.8), tmp_path / "m",
                meta={"medusa_choices": []})
    prompt = [2, 3, 4, 2]
    exact = exact_joint_2(target, prompt, cfg)
    counts: dict[tuple, int] = {}
    runs = 2000
    prop = make_proposer(str(tmp_path / "m"), target)
    for seed in range(runs):
        res = generate(target, prop, prompt, gamma=2, sampling=cfg, seed=seed, max_new_tokens=2, stop_on_eos=False)
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact), "a pair of tokens with probability 0 was generated"
    big = [c for c in exact if exact[c] * runs >= 5]
    obs = [counts.get(c, 0) for c in big] + [runs - sum(counts.get(c, 0) for c in big)]
    probs = [exact[c] for c in big] + [1 - sum(exact[c] for c in big)]
    pval = g_test_pvalue(torch.tensor(obs, dtype=torch.float64), torch.tensor(probs, dtype=torch.float64))
    assert len(big) >= 5 and pval > 1e-3, (len(big), pval)


def test_loader_errors_are_clear(tiny, tmp_path):
    target = tiny["target"]
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_medusa(tmp_path / "nowhere", target.model)
    other = load_model(str(save_tiny_llama(tmp_path / "o", vocab_size=32, layers=1, hidden=48)), device="cpu")
    with pytest.raises(ModelLoadError, match="hidden size"):
        make_proposer(str(tiny["dir"]), other)
    small = load_model(str(save_tiny_llama(tmp_path / "s", vocab_size=16, layers=1, words=[f"w{i}" for i in range(10)])),
                       device="cpu")
    with pytest.raises(ModelLoadError, match="another target"):
        load_medusa(tiny["dir"], small.model)  # vocab_ids up to 21 ≥ 16 ids
    cfg = json.loads((tiny["dir"] / "medusa_config.json").read_text())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes((tiny["dir"] / "model.safetensors").read_bytes())
    (tmp_path / "bad" / "medusa_config.json").write_text(json.dumps({**cfg, "format": "other"}))
    with pytest.raises(ModelLoadError, match="format"):
        make_proposer(str(tmp_path / "bad"), target)
    heads = random_heads(32, 2, torch.arange(4))
    save_medusa(heads, tmp_path / "tree", meta={"medusa_choices": [[0, 0]]})
    with pytest.raises(ModelLoadError, match="prefix"):
        load_medusa(tmp_path / "tree", target.model)
    (tmp_path / "tree" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="Cannot read"):
        load_medusa(tmp_path / "tree", target.model)
    with pytest.raises(InputError, match="embedded target"):
        make_proposer("embedded-medusa", target)
    prop = make_proposer(str(tiny["dir"]), target)
    with pytest.raises(InputError, match="ranks beyond"):
        prop.choices = [[25]]


# ------------------------------------------------------------------------------------------- training

def test_examples_label_head_k_with_the_token_at_t_plus_k_plus_1():
    from engine.training.draft_data import Sample
    from engine.training.train_medusa import make_examples

    # x = [10, 11, 12 | 20, 21, 22, 23] (P = 3, R = 4); positions t = 2..5 (t ≥ P − 1, t + 2 ≤ 6)
    top = torch.tensor([[20, 1], [21, 1], [29, 1], [23, 1]], dtype=torch.int32)  # argmax at 22's slot is 29
    s = Sample(torch.tensor([10, 11, 12]), torch.tensor([20, 21, 22, 23]), top,
               torch.log(torch.tensor([[0.7, 0.1]] * 4, dtype=torch.float16)), 0.0)
    h = torch.arange(7, dtype=torch.float16)[:, None].repeat(1, 4)
    ex = make_examples([s], [h], 3)
    assert ex["h"][:, 0].tolist() == [2, 3, 4]  # t = 2, 3, 4 (t = 5 would label head 1 with x[7])
    # head 1 → x[t+2], head 2 → x[t+3], head 3 → x[t+4]
    assert ex["token"].tolist() == [[21, 22, 23], [22, 23, -1], [23, -1, -1]]
    assert ex["argmax"].tolist() == [[21, 29, 23], [29, 23, -1], [23, -1, -1]]
    assert ex["top_ids"][0, 1].tolist() == [29, 1] and ex["greedy"].all()


def test_training_raises_heldout_accuracy_on_a_tiny_target(tmp_path):
    from engine.training.draft_data import generate_samples
    from engine.training.train_head import compute_features, draft_vocabulary
    from engine.training.train_medusa import empirical_path_acceptance, make_examples, rank_accuracy, train_medusa

    target = load_model(str(save_tiny_llama(tmp_path / "t", vocab_size=32, layers=2, seed=0, init=0.5)),
                        device="cpu")
    prompts = [{"prompt": " ".join(f"w{(i * 7 + j) % 30}" for j in range(6)), "category": "chat"}
               for i in range(12)]
    samples = generate_samples(target.model, target.tokenizer, prompts, {0}, max_new_tokens=16, batch_size=6,
                               top_k=8, greedy_fraction=1.0, progress=None)
    ex = make_examples(samples, compute_features(target.model, samples), 3)
    heads = MedusaHeads(32, 3, draft_vocabulary(samples, 24, 32)).bind(target.model)
    before = rank_accuracy(heads, ex, ranks=4)
    log = train_medusa(heads, ex, 32, minutes=5, max_steps=80, lr=1e-2, batch=64, log_every=20, bf16=False)
    after = rank_accuracy(heads, ex, ranks=4)
    assert log and all("loss" in r for r in log[:1])
    assert sum(after["top1"]) > sum(before["top1"]) + 0.1, (before["top1"], after["top1"])
    # a_k(r) sums over ranks to the top-r accuracy; the empirical acceptance of [0] is head 1's top-1
    assert after["topk"] == pytest.approx([sum(a) for a in after["acc"]], abs=1e-3)
    emp = empirical_path_acceptance(after["ranks_of_target"], after["scored"], [[0], [0, 0]])
    assert emp[0] == pytest.approx(after["top1"][0], abs=1e-3) and emp[1] <= emp[0]
    # early stopping: with a validation set the heads end at the best epoch's weights
    heads2 = MedusaHeads(32, 3, draft_vocabulary(samples, 24, 32)).bind(target.model)
    log2 = train_medusa(heads2, ex, 32, minutes=5, max_steps=80, lr=1e-2, batch=64, log_every=20, bf16=False,
                        heldout=ex)
    vals = [sum(r["val_top1"]) / 3 for r in log2 if "val_top1" in r]
    final = rank_accuracy(heads2, ex, greedy_only=False)
    assert len(vals) >= 2 and sum(final["top1"]) / 3 == pytest.approx(max(vals), abs=1e-3)


# -------------------------------------------------------------------------- the shipped heads (slow)

def _shipped() -> bool:
    from engine.decoding.models import EMBEDDED_MEDUSA_DIR

    return is_medusa_folder(EMBEDDED_MEDUSA_DIR)


@pytest.mark.slow
@pytest.mark.skipif(not _shipped(), reason="no shipped Medusa heads")
def test_shipped_heads_exact_on_the_embedded_target(embedded):
    """fp32 greedy: the shipped tree, a chain (tree 0) and a larger tree all give plain greedy's output; the
    heads agree with the target far more often than chance (49k-way guesses)."""
    from engine.decoding.models import EMBEDDED_MEDUSA_DIR
    from engine.decoding.speculative import encode_prompt
    from engine.training.draft_data import build_prompts

    cfg = json.loads((EMBEDDED_MEDUSA_DIR / "medusa_config.json").read_text())
    assert cfg["target"] == "embedded" and cfg["n_heads"] >= 3 and cfg["medusa_choices"]
    size = sum(f.stat().st_size for f in EMBEDDED_MEDUSA_DIR.iterdir())
    assert size < 20 * 2 ** 20, size
    accepted = passes = 0
    for p in build_prompts(2, "heldout", seed=0):
        ids = encode_prompt(embedded.tokenizer, p["prompt"])
        ref = generate(embedded, None, ids, max_new_tokens=32).token_ids
        for tree in (len(cfg["medusa_choices"]), 0, 10):
            prop = make_proposer("embedded-medusa", embedded)
            res = SpeculativeDecoder(embedded, prop, ids, gamma=cfg["n_heads"], tree=tree, max_new_tokens=32).run()
            assert res.token_ids == ref, tree
            if tree:
                accepted += sum(r.n_accepted for r in res.rounds)
                passes += len(res.rounds)
    assert accepted / passes > 0.2, accepted / passes


@pytest.mark.slow
@pytest.mark.skipif(not _shipped(), reason="no shipped Medusa heads")
def test_shipped_heads_first_round_root_is_not_the_prompts_last_token(embedded):
    """"Tell me a short story." with the chat template: round 0 drafts from h_{P-1}, so the tree
    root is the target's own token and the heads' next guess is read there too. Drafted from h_{P-2} (outside the
    heads' training range) head 1 repeats the prompt's last token '\\n', whose target probability is ~0, and
    round 0 accepts nothing."""
    from engine.decoding.speculative import encode_prompt

    ids = encode_prompt(embedded.tokenizer, "Tell me a short story.")
    assert embedded.tokenizer.decode([ids[-1]]) == "\n"
    prop = make_proposer("embedded-medusa", embedded)
    # a tree of several nodes whatever this machine's pass-cost curve makes the shipped tree (a steep curve can
    # shrink it to its root alone)
    dec = SpeculativeDecoder(embedded, prop, ids, gamma=prop.heads.n_heads, tree=max(4, prop.tree_size),
                             max_new_tokens=8)
    r = dec.step()
    root = r.tree.nodes[0]
    assert root.text != "\n" and root.p > 0.1, (root.text, root.p)
    assert r.n_accepted >= 1
    # the heads below it read h_{P-1} (the old position gave a different, wrong guess)
    with torch.no_grad():
        h = embedded.model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0]
    want = int(prop.vocab_ids[int(prop.heads.logits(h[-1])[0].float().argmax())])
    assert len(r.tree.nodes) >= 2 and r.tree.nodes[1].token_id == want
    assert want != int(prop.vocab_ids[int(prop.heads.logits(h[-2])[0].float().argmax())])
