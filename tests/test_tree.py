"""Token trees on a real model: one verify pass over a tree, the accepted path's KV entries gathered into place,
greedy output identical to plain greedy decoding, and the tree rules' distributions (exact vs lossy)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.decoding.attention import tree_depths
from engine.decoding.models import load_model
from engine.decoding.proposers import CachedLM, Proposer, make_proposer
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import SpeculativeDecoder, generate
from engine.decoding.tree import TokenTree, keep_accepted_path, tree_verify_pass
from engine.errors import InputError
from tests.tiny_models import save_tiny_llama

SHAPES = {
    "chain": [-1, 0, 1, 2],
    "star": [-1, -1, -1, -1],
    "binary": [-1, -1, 0, 0, 1, 1, 2, 2],
    "deep-left": [-1, 0, 0, 1, 1, 3, 3, 5, 5, 7],
    "one": [-1],
}


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(-1, i) for i in range(1, n)]


class OracleTreeProposer(Proposer):
    """Trees of a given (or random) shape whose tokens follow a known greedy continuation on some branches
    and are random (repeats included) elsewhere, so acceptance is neither all nor nothing."""

    name = "test oracle tree"

    def __init__(self, ref: list[int], vocab: int, parents=None, seed: int = 0, hit: float = 0.6):
        self.ref, self.vocab, self.parents, self.hit = ref, vocab, parents, hit
        self.rng = random.Random(seed)

    def propose(self, seq, k, cfg, generator):  # pragma: no cover - trees only
        raise NotImplementedError

    def propose_tree(self, seq, max_nodes, max_depth, cfg, generator):
        parents = list(self.parents) if self.parents is not None else random_parents(
            self.rng.randint(1, max_nodes), self.rng)
        parents = parents[:max_nodes]
        depth: list[int] = []
        tokens: list[int] = []
        right: list[bool] = []  # on the reference continuation
        for i, par in enumerate(parents):
            d = 1 if par < 0 else depth[par] + 1
            depth.append(d)
            pos = len(seq) + d - 1
            ok_parent = par < 0 or right[par]
            if ok_parent and pos < len(self.ref) and self.rng.random() < self.hit:
                tokens.append(self.ref[pos])
                right.append(True)
            else:
                tokens.append(self.rng.randrange(self.vocab) if tokens == [] or self.rng.random() < 0.7
                              else tokens[-1])  # sometimes repeat the previous node's token
                right.append(ok_parent and pos < len(self.ref) and tokens[-1] == self.ref[pos])
        q = torch.zeros(len(tokens), self.vocab)
        q[torch.arange(len(tokens)), tokens] = 1.0
        return TokenTree(tokens, parents, q, "deterministic")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    return load_model(str(save_tiny_llama(root / "target", vocab_size=32, layers=3, seed=0)), device="cpu")


PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 3, 12, 20, 4, 9, 3, 12, 2]]


def plain(target, ids, n):
    return generate(target, None, ids, max_new_tokens=n, stop_on_eos=False).token_ids


@pytest.mark.parametrize("shape", list(SHAPES) + ["random"])
def test_greedy_tree_output_identical_to_plain_greedy(tiny, shape):
    n_new = 24
    for ids in PROMPTS:
        ref = plain(tiny, ids, n_new)
        full = ids + ref
        for seed in range(3):
            prop = OracleTreeProposer(full, 32, SHAPES.get(shape), seed=seed)
            dec = SpeculativeDecoder(tiny, prop, ids, gamma=6, max_new_tokens=n_new, stop_on_eos=False, tree=12)
            res = dec.run()
            assert res.token_ids == ref, (shape, seed)
            assert all(r.tree is not None for r in res.rounds[:-1])  # the last may have room for 1 token only
            # the cache holds exactly the sequence minus the last token (fed at the next pass)
            assert dec.target_lm.ids == dec.seq[:len(dec.target_lm.ids)]
    # not vacuous: some rounds accepted several tokens
    deepest = max(tree_depths(SHAPES[shape])) if shape in SHAPES else 2
    assert max(r.n_accepted for r in res.rounds) >= min(2, deepest)


@torch.inference_mode()
def test_kept_path_cache_equals_a_chain_pass(tiny):
    """After the tree pass and the gather, the KV cache equals one of a plain pass over context + path."""
    ids = PROMPTS[0]
    tree = TokenTree([4, 6, 8, 10, 12, 14], [-1, -1, 0, 0, 2, 1], torch.zeros(6, 32))
    lm = CachedLM(tiny.model, tiny.device)
    lm.logits_for(ids, 1)
    logits, fed = tree_verify_pass(lm, ids + [3], tree)
    assert fed == 1 + 6 and logits.shape == (7, 32)
    path = [0, 2, 4]
    keep_accepted_path(lm, len(ids) + 1, path, logits[5])
    ref = CachedLM(tiny.model, tiny.device)
    ref_logits = ref.logits_for(ids + [3, 4, 8, 12], 4)
    assert lm.ids == ref.ids
    for a, b in zip(lm.cache.layers, ref.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    # the tree pass's logits at each path node are the chain's
    torch.testing.assert_close(logits[[0, 1, 3, 5]], ref_logits, rtol=1e-5, atol=1e-5)
    # and the next pass continues from the gathered cache as from the chain's
    torch.testing.assert_close(lm.logits_for(ids + [3, 4, 8, 12, 7], 1), ref.logits_for(ids + [3, 4, 8, 12, 7], 1),
                               rtol=1e-5, atol=1e-5)


def test_tree_trace_records(tiny):
    ids = PROMPTS[1]
    full = ids + plain(tiny, ids, 16)
    dec = SpeculativeDecoder(tiny, OracleTreeProposer(full, 32, SHAPES["binary"], seed=1), ids, gamma=4,
                             max_new_tokens=16, stop_on_eos=False, tree=8)
    res = dec.run()
    for r in res.rounds:
        t = r.tree
        assert [t.nodes[i].verdict for i in t.accepted_path] == ["accepted"] * r.n_accepted
        assert [d.token_id for d in r.drafted[:r.n_accepted]] == [t.nodes[i].token_id for i in t.accepted_path]
        assert r.emitted_ids[:r.n_accepted] == [t.nodes[i].token_id for i in t.accepted_path]
        # drafted = the path + its first rejected node (when the path's last node had children)
        assert len(r.drafted) in (r.n_accepted, r.n_accepted + 1)
        if len(r.drafted) > r.n_accepted:
            assert r.drafted[-1].verdict == "rejected" and r.next_kind == "correction"
        d = r.to_dict()
        assert d["tree"]["parents"] == SHAPES["binary"] and len(d["tree"]["token_ids"]) == 8
        assert d["tree"]["accepted_path"] == t.accepted_path
    assert res.stats.acceptance_rate is not None


def test_tree_needs_a_draft_that_branches(tiny):
    ids = PROMPTS[0]
    with pytest.raises(InputError, match="cannot make token trees"):
        SpeculativeDecoder(tiny, make_proposer("early-exit:1", tiny), ids, tree=4)
    with pytest.raises(InputError, match="needs a draft"):
        SpeculativeDecoder(tiny, None, ids, tree=4)
    for bad in (-1, 65, 10 ** 6, 2.5, True):
        with pytest.raises(InputError, match="tree size"):
            SpeculativeDecoder(tiny, make_proposer("ngram", tiny), ids, tree=bad)
    with pytest.raises(InputError, match="acceptance rule"):
        SpeculativeDecoder(tiny, make_proposer("ngram", tiny), ids, tree=4, accept="nope")
    with pytest.raises(InputError, match="lossy"):
        SpeculativeDecoder(tiny, make_proposer("ngram", tiny), ids, tree=0, accept="typical")


# ---------------------------------------------------------------- the tree drafts: draft head (EAGLE-2), prompt lookup


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, tiny):
    from engine.decoding.draft_head import FeatureHead, save_head

    torch.manual_seed(0)
    head = FeatureHead(tiny.model.config, 1, torch.arange(0, 32, 2))
    head.init_from_target(tiny.model)
    return save_head(head, tmp_path_factory.mktemp("treehead") / "head")


@pytest.mark.parametrize("kind", ["head", "ngram"])
def test_tree_drafts_greedy_identical_to_plain(tiny, head_dir, kind):
    spec = str(head_dir) if kind == "head" else "ngram"
    accepted = 0
    for ids in PROMPTS:
        ref = plain(tiny, ids, 20)
        for size, branching, gamma in [(1, 1, 3), (2, 2, 2), (4, 2, 3), (8, 4, 4), (16, 3, 6), (64, 16, 8)]:
            prop = make_proposer(spec, tiny)
            prop.set_branching(branching)
            res = generate(tiny, prop, ids, gamma=gamma, max_new_tokens=20, stop_on_eos=False, tree=size)
            assert res.token_ids == ref, (kind, size, branching)
            trees = [r.tree for r in res.rounds if r.tree is not None]
            assert all(len(t.nodes) <= size and max(n.depth for n in t.nodes) <= gamma for t in trees)
            accepted += res.stats.accepted
    assert accepted > 0


def head_path_probs(head, target, seq, path_tokens):
    """The head's softmax (T = 1) after each prefix of ``path_tokens``, computed from scratch (no cache, no
    tree mask): true features of seq[:-1], then the head's own ĥ appended per drafted token."""
    with torch.no_grad():
        h = target.model.get_decoder()(input_ids=torch.tensor([seq[:-1]])).last_hidden_state[0]
        feats, toks, out = list(h), list(seq[1:]), []
        y = head(torch.tensor([toks]), torch.stack(feats)[None])[0, -1]
        out.append(torch.softmax(head.logits(y).float(), -1))
        for t in path_tokens:
            feats.append(y)
            toks.append(t)
            y = head(torch.tensor([toks]), torch.stack(feats)[None])[0, -1]
            out.append(torch.softmax(head.logits(y).float(), -1))
    return out


def test_eagle2_tree_matches_a_from_scratch_head(tiny, head_dir):
    """Every node's draft probability is the head's, computed from scratch along the node's path (so one
    batched head call per depth with a tree mask computes each branch as if it were alone); depth 1 is the
    head's top-k; the kept nodes are the best N by path probability; a second round (after rollback) too."""
    prop = make_proposer(str(head_dir), tiny)
    prop.set_branching(3)
    dec = SpeculativeDecoder(tiny, prop, PROMPTS[1], gamma=4, max_new_tokens=12, stop_on_eos=False, tree=10)
    dec.prefill()
    checked = 0
    for _round in range(3):
        tree = prop.propose_tree(dec.seq, 10, 4, SamplingConfig(), torch.Generator())
        assert 0 < tree.size <= 10 and max(tree.depths) <= 4 and max(tree.depths) >= 2
        vocab = prop.vocab_ids
        for i in range(tree.size):
            path = tree.path_to(i)
            probs = head_path_probs(prop.head, tiny, dec.seq, [tree.tokens[j] for j in path[:-1]])[-1]
            j = int((vocab == tree.tokens[i]).nonzero())
            assert tree.draft_probs[i] == pytest.approx(float(probs[j]), abs=1e-5)
            checked += 1
        roots = [tree.tokens[i] for i in tree.children(-1)]
        top = head_path_probs(prop.head, tiny, dec.seq, [])[0].topk(3).indices
        assert roots == [int(vocab[j]) for j in top][:len(roots)]
        value = [float(torch.tensor([tree.draft_probs[j] for j in tree.path_to(i)]).prod()) for i in range(tree.size)]
        assert min(value) >= 0  # and each kept node is at least as likely as its children
        assert all(value[tree.parents[i]] >= value[i] - 1e-6 for i in range(tree.size) if tree.parents[i] >= 0)
        dec.step()
    assert checked >= 20


def test_prompt_lookup_branches_are_the_distinct_matches():
    from engine.decoding.proposers import PromptLookupProposer

    prop = PromptLookupProposer(32, max_ngram=2, min_ngram=1)
    seq = [5, 6, 7, 8, 9, 5, 6, 3, 4, 2, 6, 3, 9, 11, 5, 6]
    # suffix "5 6": matches at 5 (→ 3 4 2) and 0 (→ 7 8 9); suffix "6": adds 10 (→ 3 9 11) (3 4 2 is there)
    assert prop.lookup_all(seq, 3, 4) == [[3, 4, 2], [7, 8, 9], [3, 9, 11]]
    assert prop.lookup_all(seq, 3, 1) == [prop.lookup(seq, 3)]
    prop.set_branching(3)
    tree = prop.propose_tree(seq, 16, 3, SamplingConfig(), torch.Generator())
    # "3" is shared by two branches: a trie of 8 nodes
    assert tree.tokens == [3, 4, 2, 7, 8, 9, 9, 11] and tree.parents == [-1, 0, 1, -1, 3, 4, 0, 6]
    assert prop.propose_tree(seq, 4, 3, SamplingConfig(), torch.Generator()).tokens == [3, 4, 2, 7]
    with pytest.raises(InputError, match="branching"):
        prop.set_branching(0)
    with pytest.raises(InputError, match="branching"):
        prop.set_branching(17)
