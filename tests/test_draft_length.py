"""The per-round draft length (engine.decoding.draft_length) and the combined draft (engine.decoding.combined):
the gain formula by hand, the rule's choices, its calibration, exact greedy output, the sampling law."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.decoding.combined import HEAD, LOOKUP, CombinedProposer
from engine.decoding.draft_head import FeatureHead, save_head
from engine.decoding.draft_length import (A_MAX, Costs, LengthChoice, LengthRule, check_policy, costs_from_curve,
                                          expected_tokens, head_step_cost)
from engine.decoding.drafts import EMBEDDED_AUTO, default_length, make_proposer
from engine.decoding.models import EMBEDDED_HEAD, load_model
from engine.decoding.pass_cost import PassCost
from engine.decoding.proposers import FeatureHeadProposer, PromptLookupProposer
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import encode_prompt, generate
from engine.errors import InputError
from tests.test_draft_head import exact_joint_2, hf_greedy
from tests.test_sampling import g_test_pvalue
from tests.tiny_models import save_tiny_llama


# ---------------------------------------------------------------- the gain formula, by hand
def test_expected_tokens_by_hand():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens([0.8, 0.2]) == pytest.approx(1.96)  # 1 + 0.8 + 0.16
    assert expected_tokens([1.0, 1.0, 1.0]) == 4.0


COSTS = Costs((1.0, 1.1, 1.3, 1.3, 1.6), 0.1)


def test_round_cost_and_speedup_by_hand():
    assert COSTS.gamma_max == 4
    assert COSTS.round_cost(0) == 1.0
    assert COSTS.round_cost(1) == pytest.approx(1.2)  # t(2)/t(1) + c
    assert COSTS.round_cost(3) == pytest.approx(1.6)  # 1.3 + 3·0.1
    assert COSTS.speedup([]) == 1.0
    assert COSTS.speedup([0.8]) == pytest.approx(1.8 / 1.2)
    assert COSTS.speedup([0.8, 0.8, 0.8]) == pytest.approx(2.952 / 1.6)
    # flat a = 0.8: S = 1.5, 1.6267, 1.845, 1.6808 for k = 1..4: the best is 3
    k, s = COSTS.best_length([], 1, 4, 0.8)
    assert (k, s) == (3, pytest.approx(1.845))
    with pytest.raises(ValueError):
        COSTS.round_cost(5)
    with pytest.raises(ValueError):
        Costs((1.2, 1.3), 0.1)  # t(1)/t(1) must be 1


def test_the_rule_drafts_while_the_gain_pays_by_hand():
    rule = LengthRule(COSTS, source="d")
    rule.start(4)
    assert rule.offer(0.8)  # â = 0.8: the best length from here is 3 (1.845×) > 1×
    # â = 0.2 for token 2: with it the best is k = 2, (1 + 0.8 + 0.16)/1.5 = 1.3067× < 1.5× at k = 1
    assert not rule.offer(0.2)
    ch = rule.finish(10, [7])
    assert (ch.k, ch.stopped, ch.gamma_max) == (1, "gain", 4)
    assert ch.expected_tokens == pytest.approx(1.8) and ch.cost == pytest.approx(1.2)
    assert ch.expected_speedup == pytest.approx(1.5) and ch.next_speedup == pytest.approx(1.96 / 1.5)
    assert ch.acceptance == pytest.approx([0.8, 0.2]) and ch.confidence == pytest.approx([0.8, 0.2])
    assert "drafted 1" in ch.line() and "1.31×" in ch.line()


def test_a_plain_step_when_no_draft_pays():
    rule = LengthRule(COSTS)
    rule.start(4)
    # â = 0.15: S(1) = 1.15/1.2, S(2) = 1.1725/1.5, …: all under 1
    assert not rule.offer(0.15)
    ch = rule.finish(3, [])
    assert ch.k == 0 and ch.stopped == "plain" and ch.expected_speedup == 1.0 and ch.cost == 1.0
    assert ch.next_speedup == pytest.approx(1.15 / 1.2)
    assert "plain step" in ch.line()


def test_a_flat_curve_makes_two_tokens_pay_where_one_does_not():
    """t(2) = t(3): one token at â = 0.45 gives 1.45/1.5 = 0.967×, two give (1.45 + 0.2025)/1.5 = 1.1017×."""
    costs = Costs((1.0, 1.5, 1.5), 0.0)
    rule = LengthRule(costs)
    rule.start(2)
    assert rule.offer(0.45)
    assert rule.offer(0.45)
    ch = rule.finish(0, [1, 2])
    assert ch.k == 2 and ch.stopped == "gamma" and ch.expected_speedup == pytest.approx(1.6525 / 1.5)
    # capped at one token the same estimate is a plain step
    rule.start(1)
    assert not rule.offer(0.45)


def test_a_gain_within_the_curves_noise_is_not_drafted():
    """With a 5 % tolerance a first token must lift the round above 1.05×: at â = 0.3, S(1) = 1.3/1.2 = 1.083× is
    drafted; at â = 0.25, S(1) = 1.25/1.2 = 1.042× (the best from there) is not."""
    costs = Costs((1.0, 1.1, 1.3, 1.3, 1.6), 0.1, tolerance=0.05)
    rule = LengthRule(costs)
    rule.start(1)
    assert rule.offer(0.3)
    rule.start(1)
    assert not rule.offer(0.25)
    assert rule.plan_flat(0.25, 1) == (0, 1.0) and rule.plan_flat(0.3, 1)[0] == 1
    assert LengthRule(COSTS).plan_flat(0.25, 1)[0] == 1  # no tolerance: any gain
    with pytest.raises(ValueError):
        Costs((1.0,), 0.1, tolerance=1.0)


def test_calibration_follows_the_running_acceptance():
    rule = LengthRule(COSTS, weight=2.0, forget=0.9)
    assert rule.ratio == 1.0 and rule.estimate(0.5) == 0.5 and rule.estimate(1.0) == A_MAX
    rule.start(4)
    assert rule.offer(0.8) and rule.offer(0.6)  # S(2) = 2.28/1.5 = 1.52× > S(1) = 1.5×
    rule.finish(3, [5, 6])
    rule.observe([0, 0, 0, 5, 7])  # token 1 kept, token 2 rejected: both judged
    assert (rule.accepted, rule.conf_sum, rule.judged) == (1.0, pytest.approx(1.4), 2.0)
    assert rule.ratio == pytest.approx((1 + 2) / (1.4 + 2))
    assert rule.rate() == pytest.approx((1 + 2) / (2 + 2))
    rule.start(4)
    rule.offer(0.9)
    rule.offer(0.1)
    rule.finish(5, [8])
    rule.observe([0, 0, 0, 5, 7, 9])  # rejected
    assert rule.accepted == pytest.approx(0.9) and rule.conf_sum == pytest.approx(1.4 * 0.9 + 0.9)
    # a sequence that ended inside the draft: only the kept tokens were judged
    rule.reset()
    rule.start(4)
    rule.offer(0.9)
    rule.offer(0.9)
    rule.finish(2, [4, 4])
    rule.observe([1, 1, 4])
    assert (rule.accepted, rule.judged) == (1.0, 1.0)
    with pytest.raises(ValueError):
        LengthRule(COSTS, prior=0)


def test_costs_read_the_curve_and_the_head_rounds():
    curve = PassCost(ms={1: 10.0, 2: 11.0, 3: 13.0, 4: 13.0}, cpu="x", compute="stream", threads=2, date="d",
                     extra={"head_rounds": {"plain_ms": 10.0, "round_ms": {"1": 12.0, "2": 15.0, "3": 16.0}}})
    costs = costs_from_curve(curve, 0.1, gamma_max=3)
    assert costs.ratios == pytest.approx((1.0, 1.1, 1.3, 1.3))
    assert costs.tolerance == pytest.approx(0.03)  # a curve without its reps' spread: the least tolerance
    # (1.2 − 1.1)/1 = 0.1, (1.5 − 1.3)/2 = 0.1, (1.6 − 1.3)/3 = 0.1: median 0.1
    c, why = head_step_cost(curve)
    assert c == pytest.approx(0.1) and "timed" in why
    c, why = head_step_cost(PassCost(ms={1: 1.0}, cpu="x", compute="d", threads=1, date="d"))
    assert "card" in why
    with pytest.raises(InputError):
        costs_from_curve(curve, 0.1, gamma_max=0)
    with pytest.raises(InputError):
        check_policy("sometimes")


# ---------------------------------------------------------------- on tiny models
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("length")
    target = load_model(str(save_tiny_llama(root / "target", vocab_size=32, layers=3, seed=0)), device="cpu")
    torch.manual_seed(0)
    head = FeatureHead(target.model.config, 1, torch.arange(0, 32, 2))
    head.init_from_target(target.model)
    save_head(head, root / "head")
    return dict(target=target, head_dir=root / "head")


CHEAP = Costs((1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12, 1.14, 1.16), 0.02)
"""Cheap rounds: the tiny head's low confidences still draft, so rounds of several lengths occur."""


def adaptive_head(tiny, costs=CHEAP):
    p = make_proposer(str(tiny["head_dir"]), tiny["target"], length="adaptive")
    p.length_rule.costs = costs
    return p


PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 3, 12, 20, 4, 9, 3, 12, 2], [4]]


def test_adaptive_greedy_identical_to_plain(tiny):
    target = tiny["target"]
    lengths = set()
    for ids in PROMPTS:
        ref = hf_greedy(target, ids, 24)
        for gamma in (1, 3, 8):
            for costs in (CHEAP, None):  # the cheap costs, and the shipped curve's (mostly plain steps here)
                p = adaptive_head(tiny, costs) if costs else make_proposer(str(tiny["head_dir"]), target,
                                                                           length="adaptive")
                res = generate(target, p, ids, gamma=gamma, max_new_tokens=24, stop_on_eos=False)
                assert res.token_ids == ref, (ids, gamma)
                lengths |= {r.n_drafted for r in res.rounds}
                # every round that could draft has its choice (not the one with a single token left)
                assert all(r.choice.k == r.n_drafted for r in res.rounds if r.choice is not None)
                assert sum(r.choice is not None for r in res.rounds) >= len(res.rounds) - 1
    assert {0, 1} <= lengths and max(lengths) >= 3  # plain steps and drafts of several lengths occurred


def test_round_records_its_choice(tiny):
    res = generate(tiny["target"], adaptive_head(tiny), PROMPTS[1], gamma=4, max_new_tokens=12, stop_on_eos=False)
    d = res.to_dict()["rounds"][-2]["choice"]
    assert d["source"] == "draft head" and d["k"] == res.rounds[-2].n_drafted and d["cost"] >= 1.0
    fixed = generate(tiny["target"], make_proposer(str(tiny["head_dir"]), tiny["target"]), PROMPTS[1], gamma=4,
                     max_new_tokens=12, stop_on_eos=False)
    assert all(r.choice is None for r in fixed.rounds)  # a head folder keeps a fixed γ unless asked


def test_batched_drafts_choose_as_alone(tiny):
    """The room drafts rows of one head together (``propose_many``): each row's rule makes the choice it makes
    alone."""
    target = tiny["target"]
    from engine.decoding.speculative import SpeculativeDecoder

    decs = [SpeculativeDecoder(target, adaptive_head(tiny), ids, gamma=4, max_new_tokens=16, stop_on_eos=False)
            for ids in PROMPTS[:2]]
    alone = [SpeculativeDecoder(target, adaptive_head(tiny), ids, gamma=4, max_new_tokens=16, stop_on_eos=False)
             for ids in PROMPTS[:2]]
    for d in decs + alone:
        d.prefill()
    cfg = SamplingConfig()
    for _ in range(5):
        props = FeatureHeadProposer.propose_many([(d.proposer, d.seq, 4, cfg, d.generator) for d in decs])
        for d, a, prop in zip(decs, alone, props):
            want = a.proposer.propose(a.seq, 4, cfg, a.generator)
            assert prop.tokens == want.tokens and prop.choice.k == want.choice.k
            assert prop.choice.acceptance == pytest.approx(want.choice.acceptance, abs=1e-5)
            a.proposer.rollback(a.seq)  # nothing judged: both rules see the same (no) outcome
            d.proposer.rollback(d.seq)


def test_combined_draft_uses_lookup_where_the_context_repeats(tiny):
    target = tiny["target"]
    ids = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7]
    ref = hf_greedy(target, ids, 24)
    head = adaptive_head(tiny)
    comb = CombinedProposer(head, PromptLookupProposer(32, stop_ids=target.eos_token_ids))
    res = generate(target, comb, ids, gamma=6, max_new_tokens=24, stop_on_eos=False)
    assert res.token_ids == ref
    sources = [r.choice.source for r in res.rounds if r.choice is not None and r.choice.k]
    assert LOOKUP in sources
    first = next(r.choice for r in res.rounds if r.choice is not None and r.choice.source == LOOKUP)
    assert first.alternatives[LOOKUP] >= first.alternatives[HEAD]
    for ids in PROMPTS:  # greedy output as plain on prompts with and without repeats
        comb = CombinedProposer(adaptive_head(tiny), PromptLookupProposer(32, stop_ids=target.eos_token_ids))
        assert generate(target, comb, ids, gamma=4, max_new_tokens=20,
                        stop_on_eos=False).token_ids == hf_greedy(target, ids, 20)
    with pytest.raises(ValueError):
        CombinedProposer(make_proposer(str(tiny["head_dir"]), target), PromptLookupProposer(32))


def test_combined_drafts_choose_as_alone_when_batched(tiny):
    """The room drafts rows of combined drafts together: each row picks its drafter and length as alone."""
    target = tiny["target"]
    from engine.decoding.speculative import SpeculativeDecoder

    def comb():
        head = adaptive_head(tiny)
        head.length_rule.rate_prior = 0.3  # so that a lookup match wins its round
        return CombinedProposer(head, PromptLookupProposer(32, stop_ids=target.eos_token_ids))

    prompts = [[5, 6, 7, 8, 9, 10] * 3 + [5, 6], PROMPTS[1]]
    decs = [SpeculativeDecoder(target, comb(), ids, gamma=4, max_new_tokens=16, stop_on_eos=False) for ids in prompts]
    alone = [SpeculativeDecoder(target, comb(), ids, gamma=4, max_new_tokens=16, stop_on_eos=False) for ids in prompts]
    for d in decs + alone:
        d.prefill()
    cfg = SamplingConfig()
    props = CombinedProposer.propose_many([(d.proposer, d.seq, 4, cfg, d.generator) for d in decs])
    for a, prop in zip(alone, props):
        want = a.proposer.propose(a.seq, 4, cfg, a.generator)
        assert prop.tokens == want.tokens and prop.choice.source == want.choice.source
        assert prop.choice.k == want.choice.k
    assert {p.choice.source for p in props} == {LOOKUP, HEAD}  # one row each
    assert decs[0].proposer.batch_key() == decs[1].proposer.batch_key()


def test_make_proposer_length_policies(tiny):
    assert default_length(EMBEDDED_HEAD) == "adaptive" and default_length(EMBEDDED_AUTO) == "adaptive"
    assert default_length("ngram") == "fixed"
    with pytest.raises(InputError, match="adaptive"):
        make_proposer("ngram", tiny["target"], length="adaptive")
    with pytest.raises(InputError, match="'adaptive' or 'fixed'"):
        make_proposer("ngram", tiny["target"], length="long")
    with pytest.raises(InputError, match="embedded target"):
        make_proposer(EMBEDDED_AUTO, tiny["target"])
    assert make_proposer(str(tiny["head_dir"]), tiny["target"], length="fixed").length_rule is None


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=5)])
def test_distribution_preserved_with_adaptive_length(tmp_path, cfg):
    """G-test of the joint law of 2 generated tokens against the exact one, the head's rounds drafting 0, 1 or 2
    tokens by the rule (its confidence, its calibration from earlier rounds of the same run)."""
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
    prop = make_proposer(str(tmp_path / "h"), target, length="adaptive")
    prop.length_rule.costs = Costs((1.0, 1.25, 1.3), 0.05)  # some rounds draft, some do not
    lengths = set()
    for seed in range(runs):
        res = generate(target, prop, prompt, gamma=2, sampling=cfg, seed=seed, max_new_tokens=3,
                       stop_on_eos=False)
        key = tuple(res.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
        lengths |= {r.n_drafted for r in res.rounds}
    assert len(lengths) >= 2, lengths
    assert set(counts) <= set(exact), "a pair of tokens with probability 0 was generated"
    big = [c for c in exact if exact[c] * runs >= 5]
    obs = [counts.get(c, 0) for c in big] + [runs - sum(counts.get(c, 0) for c in big)]
    probs = [exact[c] for c in big] + [1 - sum(exact[c] for c in big)]
    pval = g_test_pvalue(torch.tensor(obs, dtype=torch.float64), torch.tensor(probs, dtype=torch.float64))
    assert len(big) >= 5 and pval > 1e-3, (len(big), pval)


# ---------------------------------------------------------------- the embedded model
@pytest.mark.slow
@pytest.mark.parametrize("kind", [EMBEDDED_HEAD, EMBEDDED_AUTO])
def test_embedded_adaptive_greedy_identical(embedded, kind):
    for prompt in ("Explain KV caching in two sentences.",
                   "Rename the variable x to count in: def f(x):\n    return x + x * x"):
        ids = encode_prompt(embedded.tokenizer, prompt)
        # plain greedy on the same compute path (the process's arithmetic; transformers' own generate runs other
        # attention kernels, which the int8 arithmetic's rounding can tell apart)
        ref = generate(embedded, None, ids, max_new_tokens=32).token_ids
        res = generate(embedded, make_proposer(kind, embedded), ids, gamma=6, max_new_tokens=32)
        assert res.token_ids == ref[:len(res.token_ids)] and (len(res.token_ids) == 32 or
                                                                res.rounds[-1].stop_reason == "eos")
        assert sum(r.choice is not None for r in res.rounds) >= len(res.rounds) - 1  # the last may have no room
