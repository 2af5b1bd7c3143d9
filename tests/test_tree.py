"""Token trees on a real model: one verify pass over a tree, the accepted path's KV entries gathered into place,
greedy output identical to plain greedy decoding, and the tree rules' distributions (exact vs lossy)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.decoding.compute import batch_invariant

from engine.decoding.attention import tree_depths
from engine.decoding.models import load_model
from engine.decoding.proposers import CachedLM, Proposer
from engine.decoding.drafts import make_proposer
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


@torch.inference_mode()
@pytest.mark.parametrize("path", [[], [0], [1], [0, 2, 4], [1, 5], [0, 3]])
def test_kept_path_moves_exactly_the_path_entries(tiny, path):
    """The gather keeps the context's entries untouched and puts the path's nodes' entries (keys, values, hidden
    states) right after them, bit for bit: what index_select over context + path gives."""
    ids = PROMPTS[0]
    tree = TokenTree([4, 6, 8, 10, 12, 14], [-1, -1, 0, 0, 2, 1], torch.zeros(6, 32))
    lm = CachedLM(tiny.model, tiny.device, keep_hidden=True)
    lm.logits_for(ids, 1)
    ctx = len(ids) + 1
    tree_verify_pass(lm, ids + [3], tree)
    keep = torch.tensor(list(range(ctx)) + [ctx + i for i in path])
    want_k = [layer.keys.index_select(-2, keep).clone() for layer in lm.cache.layers]
    want_v = [layer.values.index_select(-2, keep).clone() for layer in lm.cache.layers]
    want_h = lm.hidden.index_select(0, keep).clone()
    keep_accepted_path(lm, ctx, path)
    assert lm.ids == ids + [3] + [tree.tokens[i] for i in path]
    assert lm.hidden.shape[0] == ctx + len(path) and torch.equal(lm.hidden, want_h)
    for layer, k, v in zip(lm.cache.layers, want_k, want_v):
        assert layer.keys.shape[-2] == ctx + len(path)
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)


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


# ---------------------------------------------------------------- the rules: lossless (exact) and typical (lossy)

from engine.decoding.sampling import (  # noqa: E402
    first_token_check,
    typical_threshold,
    verify_tree_greedy,
    verify_tree_sampling,
    warp_probs,
)
from tests.test_sampling import g_test_pvalue  # noqa: E402
from tests.test_speculative import exact_joint  # noqa: E402
from tests.tiny_models import bigram_loaded, toy_cycle_table  # noqa: E402


class ToyTreeProposer(Proposer):
    """Trees drafted from a bigram draft table: ``branching[d]`` children for each node at depth d, drawn as
    ``draw`` says from q = the draft's warped row (same settings as p); ``repeat`` makes deterministic picks
    repeat the top token (siblings with the same token)."""

    name = "toy tree"

    def __init__(self, table: torch.Tensor, branching: list[int], draw: str, repeat: bool = False):
        self.table, self.branching, self.draw, self.repeat = table, branching, draw, repeat

    def propose(self, seq, k, cfg, generator):  # pragma: no cover - trees only
        raise NotImplementedError

    def propose_tree(self, seq, max_nodes, max_depth, cfg, generator):
        from engine.decoding.sampling import sample

        v = self.table.shape[0]
        tokens, parents, rows = [], [], []
        frontier = [(-1, seq[-1])]
        for b in self.branching[:max_depth]:
            nxt = []
            for node, tok in frontier:
                q = warp_probs(torch.log(self.table[tok]), cfg)
                if self.draw == "deterministic":
                    order = torch.argsort(q, descending=True, stable=True).tolist()
                    picks = ([order[0]] + order)[:b] if self.repeat else order[:b]
                    qs = [torch.nn.functional.one_hot(torch.tensor(x), v).double() for x in picks]
                elif self.draw == "sampled":
                    picks = [sample(q, generator) for _ in range(b)]
                    qs = [q] * b
                else:
                    left, picks = q.clone(), []
                    for _ in range(b):
                        if float(left.sum()) <= 1e-12:
                            break
                        x = sample(left, generator)
                        picks.append(x)
                        left[x] = 0.0
                    qs = [q] * len(picks)
                for x, qr in zip(picks, qs):
                    if len(tokens) >= max_nodes:
                        break
                    tokens.append(int(x))
                    parents.append(node)
                    rows.append(qr)
                    nxt.append((len(tokens) - 1, int(x)))
            frontier = nxt
        return TokenTree(tokens, parents, torch.stack(rows).float() if rows else torch.zeros(0, v), self.draw)


TOY_V = 7
TARGET_T = toy_cycle_table(TOY_V, 8.0)
_draft = toy_cycle_table(TOY_V, 4.0)
_draft[:, 3] += 0.3
DRAFT_T = _draft / _draft.sum(-1, keepdim=True)
# a target that never emits token 5, and a draft that likes it (q puts mass where p = 0)
_zero = TARGET_T.clone()
_zero[:, 5] = 0.0
ZERO_T = _zero / _zero.sum(-1, keepdim=True)
_five = torch.ones(TOY_V, TOY_V, dtype=torch.float64)
_five[:, 5] = 4.0
FIVE_T = _five / _five.sum(-1, keepdim=True)

T1 = SamplingConfig(temperature=1.0)
TREE_CASES = {
    "T1-sampled-2x2": (TARGET_T, DRAFT_T, T1, [2, 2], "sampled", False),
    "T1-without-replacement-3x2": (TARGET_T, DRAFT_T, T1, [3, 2], "without_replacement", False),
    "T1-deterministic-2x2": (TARGET_T, DRAFT_T, T1, [2, 2], "deterministic", False),
    "T1-deterministic-repeated-siblings": (TARGET_T, DRAFT_T, T1, [3, 1], "deterministic", True),
    "T0.7-topk4-sampled-2x2": (TARGET_T, DRAFT_T, SamplingConfig(0.7, top_k=4), [2, 2], "sampled", False),
    "T1.3-topp0.8-without-replacement-2x2": (TARGET_T, DRAFT_T, SamplingConfig(1.3, top_p=0.8), [2, 2],
                                             "without_replacement", False),
    "q=p-sampled-2x1": (TARGET_T, TARGET_T, T1, [2, 1], "sampled", False),
    "q-mass-where-p-is-0-sampled-3x1": (ZERO_T, FIVE_T, T1, [3, 1], "sampled", False),
    "q-mass-where-p-is-0-without-replacement-2x2": (ZERO_T, FIVE_T, T1, [2, 2], "without_replacement", False),
    "T1-topk2-deterministic-3x1": (TARGET_T, DRAFT_T, SamplingConfig(1.0, top_k=2), [3, 1], "deterministic", False),
}


def tree_joint_pvalue(target_t, proposer, cfg, runs, accept="exact", n_tokens=3, prompt=(2, 3, 4)):
    """G-test of the joint law of the next n tokens of a tree run against the bigram target's exact law."""
    target = bigram_loaded(target_t)
    exact = exact_joint(target_t, cfg, first=prompt[-1], n=n_tokens)
    counts: dict[tuple, int] = {}
    judged = accepted = 0
    for seed in range(runs):
        res = generate(target, proposer, list(prompt), gamma=3, sampling=cfg, seed=seed, max_new_tokens=n_tokens,
                       stop_on_eos=False, tree=16, accept=accept)
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
        judged += res.stats.judged
        accepted += res.stats.accepted
    if accept == "exact":
        assert set(counts) <= set(exact), "a sequence the target gives probability 0 was generated"
    # cells expected under 5 times are pooled (the G-test's validity rule); the rest keep their own cell
    big = [c for c in exact if exact[c] * runs >= 5]
    obs = [counts.get(c, 0) for c in big] + [runs - sum(counts.get(c, 0) for c in big)]
    probs = [exact[c] for c in big] + [max(0.0, 1 - sum(exact[c] for c in big))]
    assert len(big) >= 8  # enough cells for the test to have power
    return g_test_pvalue(torch.tensor(obs, dtype=torch.float64), torch.tensor(probs, dtype=torch.float64)), \
        accepted / max(judged, 1)


@pytest.mark.parametrize("case", list(TREE_CASES))
def test_lossless_tree_rule_preserves_the_joint_distribution(case):
    target_t, draft_t, cfg, branching, draw, repeat = TREE_CASES[case]
    pval, acc = tree_joint_pvalue(target_t, ToyTreeProposer(draft_t, branching, draw, repeat), cfg, 2000)
    assert pval > 1e-3, (case, pval)
    assert 0 < acc < 1 or case.startswith("q=p")  # rejections and corrections happened


def test_typical_acceptance_is_lossy_on_the_same_check():
    """The same joint check fails for Medusa's typical acceptance: it keeps any token above the threshold."""
    target_t, draft_t, cfg, branching, draw, repeat = TREE_CASES["T1-deterministic-2x2"]
    pval, _ = tree_joint_pvalue(target_t, ToyTreeProposer(draft_t, branching, draw), cfg, 2000, accept="typical")
    assert pval < 1e-6


P5 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
Q5 = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1], dtype=torch.float64)


@pytest.mark.parametrize("draw", ["deterministic", "sampled", "without_replacement"])
def test_first_token_check_exact_vs_typical(draw):
    """TV distance from p of the first emitted token: ≈ sampling noise for the exact rule, far above it for
    typical acceptance (lossy). Hand check (deterministic top-2 of q = tokens 1, 2): H(p) = 1.3322 nats,
    threshold min(0.09, 0.3·e^−1.3322 = 0.0792) = 0.0792; token 1 (p 0.2) always passes, so the first token
    is always 1: TV = 1 − 0.2 = 0.8."""
    exact = first_token_check(P5, Q5, 2, draw, "exact", 6000, seed=3)
    typical = first_token_check(P5, Q5, 2, draw, "typical", 6000, seed=3)
    assert g_test_pvalue(exact.counts, P5) > 1e-3
    assert exact.tv < 3 * exact.noise_tv
    assert typical.tv > 10 * typical.noise_tv and g_test_pvalue(typical.counts, P5) < 1e-9
    if draw == "deterministic":
        assert typical.tv == pytest.approx(0.8, abs=1e-9)
    assert 0 < exact.accepted < 1


def test_typical_threshold_hand_computed():
    # H([0.5, 0.5]) = ln 2: 0.3 · 0.5 = 0.15 > 0.09 → 0.09; H(uniform 5) = ln 5: 0.3 / 5 = 0.06
    assert typical_threshold(torch.tensor([0.5, 0.5])) == pytest.approx(0.09)
    assert typical_threshold(torch.full((5,), 0.2)) == pytest.approx(0.06)


def test_tree_rules_hand_examples():
    # greedy: roots 0 (token 4), 1 (token 6); 2 under 0 (token 8); target argmax after ctx 6, after node 1: 9
    v = verify_tree_greedy([4, 6, 8], [-1, -1, 0], [6, 8, 9, 1])
    assert (v.path, v.next_token, v.next_kind) == ([1], 9, "bonus") and v.accept_probs == [0.0, 1.0, None]
    # deterministic picks: child token 1 is accepted with p(1) = 0.3; after its rejection p' = p with 1 zeroed
    p = torch.tensor([[0.5, 0.3, 0.2]] * 3, dtype=torch.float64)
    q = torch.tensor([[0, 1.0, 0], [1.0, 0, 0]])
    seen = set()
    for seed in range(40):
        v = verify_tree_sampling([1, 0], [-1, -1], q, "deterministic", p, torch.Generator().manual_seed(seed))
        assert v.accept_probs[0] == pytest.approx(0.3)
        if v.path != [0]:
            assert v.accept_probs[1] == pytest.approx(0.5 / 0.7)
            if not v.path:  # both rejected: the correction is token 2, the only mass left
                assert v.next_token == 2 and v.next_kind == "correction"
                assert v.residual.tolist() == pytest.approx([0, 0, 1])
        seen.add(tuple(v.path))
    assert seen == {(0,), (1,), ()}


def test_the_check_detects_a_wrong_rule():
    """Sanity check of the harness: children drawn without replacement but judged as if drawn independently
    (the verifier told the wrong draw) do not pass as p."""
    from engine.decoding.sampling import sample

    q = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4], dtype=torch.float64)
    counts = {label: torch.zeros(5, dtype=torch.float64) for label in ("without_replacement", "sampled")}
    g = torch.Generator().manual_seed(0)
    for _ in range(6000):
        left, toks = q.clone(), []
        for _c in range(3):
            toks.append(sample(left, g))
            left[toks[-1]] = 0.0
        for label, c in counts.items():
            v = verify_tree_sampling(toks, [-1] * 3, q[None].expand(3, 5), label, P5[None].expand(4, 5), g)
            c[toks[v.path[0]] if v.path else v.next_token] += 1
    assert g_test_pvalue(counts["without_replacement"], P5) > 1e-3
    assert g_test_pvalue(counts["sampled"], P5) < 1e-9


# ---------------------------------------------------------------- the embedded model

EMBEDDED_PROMPTS = ["What is the capital of France?",
                    "Fix the bug in this code:\n\ndef add(a, b):\n    return a - b\n"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["embedded-head", "ngram"])
def test_embedded_tree_greedy_identical(embedded, kind):
    from engine.decoding.speculative import encode_prompt

    accepted = 0
    for prompt in EMBEDDED_PROMPTS:
        ids = encode_prompt(embedded.tokenizer, prompt)
        ref = generate(embedded, None, ids, max_new_tokens=24).token_ids
        for size, branching, gamma in [(4, 2, 3), (16, 4, 5)]:
            prop = make_proposer(kind, embedded)
            prop.set_branching(branching)
            res = generate(embedded, prop, ids, gamma=gamma, max_new_tokens=24, tree=size)
            assert res.token_ids == ref, (kind, size, prompt)
            accepted += res.stats.accepted
    assert accepted > 0


@pytest.mark.slow
def test_embedded_first_token_follows_p(embedded):
    """The head's real EAGLE-2 tree, the real tree verify pass's p, and the lossless rule: the first emitted
    token's histogram against p computed independently (a plain forward pass over the prompt)."""
    from engine.decoding.speculative import encode_prompt

    cfg = SamplingConfig(temperature=1.0, top_k=12)
    ids = encode_prompt(embedded.tokenizer, "Name a colour.")
    with torch.inference_mode(), batch_invariant():  # the engine's layout: the bits a plain step of the same path gives
        p_ref = warp_probs(embedded.model(torch.tensor([ids])).logits[0, -1].double(), cfg)
    prop = make_proposer("embedded-head", embedded)
    prop.set_branching(4)
    dec = SpeculativeDecoder(embedded, prop, ids, gamma=3, sampling=cfg, max_new_tokens=8, tree=12)
    dec.prefill()
    tree = prop.propose_tree(dec.seq, 12, 3, cfg, dec.generator)
    logits, _ = tree_verify_pass(dec.target_lm, dec.seq, tree)
    p = warp_probs(logits.double(), cfg)
    torch.testing.assert_close(p[0], p_ref, rtol=1e-4, atol=1e-6)
    roots = [tree.tokens[i] for i in tree.children(-1)]
    assert len(roots) == 4 and 0 < float(p_ref[roots].sum()) < 1  # the roots can be rejected: a real test
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(p_ref.shape[0], dtype=torch.float64)
    n = 4000
    for _ in range(n):
        v = verify_tree_sampling(tree.tokens, tree.parents, tree.q, tree.draw, p, g)
        counts[tree.tokens[v.path[0]] if v.path else v.next_token] += 1
    assert g_test_pvalue(counts, p_ref) > 1e-3
    # and one real decoder run starts with a token of p's support
    assert p_ref[dec.step().emitted_ids[0]] > 0
