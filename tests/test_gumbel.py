"""Drafter-invariant (Gumbel-max) sampling: it samples p exactly, its noise is keyed by (seed, position, token) and
nothing else, and plain and speculative decoding under it give the same tokens for a seed, for every draft kind,
γ, token tree and batch size."""

from __future__ import annotations

import pytest
import torch

from engine.decoding.batch import generate_batch
from engine.decoding.drafts import make_proposer
from engine.decoding.models import load_model
from engine.decoding.proposers import PromptLookupProposer
from engine.decoding.sampling import (
    SamplingConfig,
    draw_token,
    gumbel_agreement,
    gumbel_argmax,
    gumbel_noise,
    uniform_at,
    verify_chain,
    verify_gumbel,
    verify_tree_gumbel,
    warp_probs,
)
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt, generate
from engine.errors import InputError
from tests.test_sampling import g_test_pvalue
from tests.tiny_models import save_tiny_llama

GUMBEL = SamplingConfig(temperature=1.0, rule="gumbel")

TOY = {
    "skewed": torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64),
    "flat": torch.full((8,), 1 / 8, dtype=torch.float64),
    "with zeros": torch.tensor([0.0, 0.3, 0.0, 0.6, 0.1, 0.0], dtype=torch.float64),
    "tiny mass": torch.tensor([0.97, 0.01, 0.01, 0.005, 0.005], dtype=torch.float64),
}


def gumbel_counts(p: torch.Tensor, seed: int, n: int, start: int = 0, ids=None) -> torch.Tensor:
    """How often each entry is the Gumbel-max pick over positions start..start+n−1 of one seed."""
    counts = torch.zeros(p.shape[0], dtype=torch.float64)
    for t in range(start, start + n):
        counts[gumbel_argmax(p, seed, t, ids)] += 1
    return counts


# ---------------------------------------------------------------- the rule samples p exactly


@pytest.mark.parametrize("name", sorted(TOY))
@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_gumbel_max_samples_p_exactly_on_toy_distributions(name, seed):
    p = TOY[name]
    counts = gumbel_counts(p, seed, 6000)
    assert g_test_pvalue(counts, p) > 1e-3, (name, seed, counts.tolist())


def test_gumbel_max_with_a_reduced_vocabulary_samples_p_exactly():
    """A draft head's q covers some token ids only (``ids``): the pick still follows q."""
    q = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    ids = torch.tensor([3, 17, 40, 41])
    counts = gumbel_counts(q, 5, 6000, ids=ids)
    assert g_test_pvalue(counts, q) > 1e-3


def test_the_uniforms_are_uniform_and_the_noise_is_gumbel():
    from scipy.stats import kstest

    u = [uniform_at(3, t, x) for t in range(40) for x in range(50)]
    assert kstest(u, "uniform").pvalue > 1e-3
    g = torch.cat([gumbel_noise(3, t, 200) for t in range(20)]).numpy()
    assert kstest(g, "gumbel_r").pvalue > 1e-3
    assert uniform_at(3, 7, 11) == pytest.approx(float(torch.exp(-torch.exp(-gumbel_noise(3, 7, 20)[11]))), rel=1e-12)


@pytest.mark.slow
def test_gumbel_max_samples_the_real_models_next_token_distribution(embedded):
    """The embedded model's p after a chat prompt at T 1 (and with top-k/top-p): 8000 noise rows' picks against p
    (G-test over the tokens with ≥ 5 expected picks, the rest pooled into one cell)."""
    from scipy.stats import power_divergence

    ids = encode_prompt(embedded.tokenizer, "Write one word that describes the sea.")
    with torch.no_grad():
        logits = embedded.model(torch.tensor([ids])).logits[0, -1].double()
    for cfg in (SamplingConfig(temperature=1.0, rule="gumbel"),
                SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, rule="gumbel")):
        p = warp_probs(logits, cfg)
        n = 8000
        counts = gumbel_counts(p, 11, n)
        assert counts[p == 0].sum() == 0
        big = p * n >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([p[big], p[~big].sum()[None]]) * n
        keep = exp > 0
        assert int(big.sum()) >= 5, "the check would be vacuous"
        assert power_divergence(obs[keep].numpy(), exp[keep].numpy(), lambda_="log-likelihood").pvalue > 1e-3


# ---------------------------------------------------------------- the noise is keyed, not drawn


def test_noise_is_a_function_of_seed_position_and_token_only():
    from engine.decoding import sampling

    a = gumbel_noise(9, 12, 64).clone()

    sampling._noise_row.cache_clear()
    torch.rand(1000)  # the global and any run's generator drawing more changes nothing
    b = gumbel_noise(9, 12, 64)
    assert torch.equal(a, b)
    assert torch.equal(gumbel_noise(9, 12, 100)[:64], a)  # a token's noise does not depend on V
    assert not torch.equal(gumbel_noise(9, 13, 64), a)
    assert not torch.equal(gumbel_noise(10, 12, 64), a)


def test_a_draft_pick_does_not_depend_on_the_generators_earlier_draws():
    q = TOY["skewed"]
    g1 = torch.Generator().manual_seed(4)
    g2 = torch.Generator().manual_seed(4)
    torch.rand(777, generator=g2)  # g2 has drawn 777 numbers before
    picks1 = [draw_token(q, GUMBEL, g1, t) for t in range(50)]
    picks2 = [draw_token(q, GUMBEL, g2, t) for t in range(50)]
    assert picks1 == picks2
    # the standard rule does depend on them: the check above is not vacuous
    std = SamplingConfig(temperature=1.0)
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    torch.rand(777, generator=g2)
    assert [draw_token(q, std, g1, t) for t in range(50)] != [draw_token(q, std, g2, t) for t in range(50)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_gumbel")
    target = load_model(str(save_tiny_llama(root / "target", vocab_size=32, layers=3, seed=0)), device="cpu")
    draft = load_model(str(save_tiny_llama(root / "draft", vocab_size=40, layers=1, seed=1)), device="cpu")
    return dict(target=target, draft=draft)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 3, 12, 20, 4, 9, 3, 12, 2]]


def test_a_run_resumed_mid_text_continues_with_the_same_tokens(tiny):
    """The noise at a position is the same whatever the run drew before it: a plain run restarted from its own
    first 9 tokens (a fresh generator, nothing drawn) continues exactly as the full run did. Under the standard
    rule it would not (the generator's draws shift)."""
    target = tiny["target"]
    for seed in range(6):
        full = generate(target, None, PROMPTS[0], sampling=GUMBEL, seed=seed, max_new_tokens=24,
                        stop_on_eos=False).token_ids
        rest = generate(target, None, PROMPTS[0] + full[:9], sampling=GUMBEL, seed=seed, max_new_tokens=15,
                        stop_on_eos=False).token_ids
        assert rest == full[9:], seed


# ---------------------------------------------------------------- plain and speculative give the same tokens


def spec(target, kind, draft=None):
    return make_proposer("draft" if kind == "draft" else kind, target, draft)


@pytest.mark.parametrize("kind", ["ngram", "early-exit:1", "early-exit:2", "draft"])
@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0, rule="gumbel"),
                                 SamplingConfig(temperature=0.7, top_k=8, top_p=0.9, rule="gumbel")])
def test_plain_and_speculative_texts_are_equal_for_many_seeds(tiny, kind, cfg):
    target = tiny["target"]
    for ids in PROMPTS:
        for seed in range(12):
            ref = generate(target, None, ids, sampling=cfg, seed=seed, max_new_tokens=20, stop_on_eos=False).token_ids
            for gamma in (1, 3, 6):
                got = generate(target, spec(target, kind, tiny["draft"]), ids, gamma=gamma, sampling=cfg, seed=seed,
                               max_new_tokens=20, stop_on_eos=False)
                assert got.token_ids == ref, (kind, seed, gamma)


def test_under_the_standard_rule_the_texts_part(tiny):
    """The same comparison under the standard rule: the texts differ for some seed (so the test above is not
    vacuous: equal texts come from the rule)."""
    target = tiny["target"]
    std = SamplingConfig(temperature=1.0)
    differ = 0
    for seed in range(12):
        ref = generate(target, None, PROMPTS[0], sampling=std, seed=seed, max_new_tokens=20, stop_on_eos=False)
        got = generate(target, spec(target, "early-exit:2"), PROMPTS[0], gamma=3, sampling=std, seed=seed,
                       max_new_tokens=20, stop_on_eos=False)
        differ += got.token_ids != ref.token_ids
    assert differ > 0


def test_the_draft_proposes_with_the_same_noise_so_it_is_accepted_more(tiny):
    """A draft drawing with the run's noise agrees with the target's pick more often than an independent draw:
    early exit at every layer is the target itself, so every draft token is kept."""
    target = tiny["target"]
    res = generate(target, make_proposer("early-exit:3", target), PROMPTS[1], gamma=4, sampling=GUMBEL, seed=2,
                   max_new_tokens=30, stop_on_eos=False)
    drafted = sum(len(r.drafted) for r in res.rounds)
    assert drafted and sum(r.n_accepted for r in res.rounds) == drafted


@pytest.mark.parametrize("tree", [3, 8])
def test_token_trees_give_the_plain_tokens(tiny, tree):
    target = tiny["target"]
    for seed in range(8):
        ref = generate(target, None, PROMPTS[0], sampling=GUMBEL, seed=seed, max_new_tokens=20,
                       stop_on_eos=False).token_ids
        prop = PromptLookupProposer(target_vocab=32, max_ngram=2, min_ngram=1)
        prop.set_branching(3)
        res = generate(target, prop, PROMPTS[0], gamma=4, sampling=GUMBEL, seed=seed, max_new_tokens=20,
                       stop_on_eos=False, tree=tree)
        assert res.token_ids == ref, seed
        assert all(r.tree is None or r.tree.rule == "gumbel" for r in res.rounds)


@pytest.mark.parametrize("kind", ["none", "ngram", "early-exit:1"])
def test_batches_give_each_rows_plain_tokens(tiny, kind):
    """Row b of a batch is seeded seed + b: its tokens are the lone plain run's with that seed."""
    target = tiny["target"]
    prompts = PROMPTS + [PROMPTS[0][:4]]
    props = None if kind == "none" else [spec(target, kind) for _ in prompts]
    res = generate_batch(target, props, prompts, gamma=3, sampling=GUMBEL, seed=5, max_new_tokens=16,
                         stop_on_eos=False)
    for b, ids in enumerate(prompts):
        ref = generate(target, None, ids, sampling=GUMBEL, seed=5 + b, max_new_tokens=16, stop_on_eos=False)
        assert res.results[b].token_ids == ref.token_ids, (kind, b)


def test_room_readers_get_their_lone_plain_text_whether_passes_draft_or_not(tiny):
    """A room whose shared passes run plain (``no_draft_above=1``, as the room does when drafting does not pay) and
    a room that always drafts: every sampled reader on the rule gets the text of plain decoding alone with its
    seed (under the standard rule a plain pass would draw another sample)."""
    from engine.decoding.scheduler import Room
    from tests.test_scheduler import _in_threads

    target = tiny["target"]
    kinds = ["ngram", "early-exit:1", "early-exit:2", "none"]
    want = [generate(target, None, PROMPTS[i % 2], sampling=GUMBEL, seed=i, max_new_tokens=18,
                     stop_on_eos=False).token_ids for i in range(4)]
    for limit in (1, None):
        room = Room(target, no_draft_above=limit)
        try:
            decs = [SpeculativeDecoder(target, spec(target, kinds[i]), PROMPTS[i % 2], gamma=3, sampling=GUMBEL,
                                       seed=i, max_new_tokens=18, stop_on_eos=False) for i in range(4)]
            with room._cond:  # queued together: the first pass holds all four
                tickets = [room.submit(d, None) for d in decs]
            got = _in_threads([(lambda t=t: t.wait()) for t in tickets])
            for i in range(4):
                assert [x for r in got[i] for x in r.emitted_ids] == want[i], (limit, i)
            assert any(p.rows > 1 for p in room.passes)
        finally:
            room.close()


# ---------------------------------------------------------------- the verdicts


def test_verify_gumbel_keeps_the_agreeing_prefix_and_emits_the_targets_pick():
    p = TOY["skewed"][None].expand(4, 5)
    ys = [gumbel_argmax(p[i], 3, 10 + i) for i in range(4)]
    v = verify_gumbel(ys[:3], p, 3, 10)
    assert (v.n_accepted, v.next_token, v.next_kind, v.accept_probs) == (3, ys[3], "bonus", [1.0] * 3)
    wrong = (ys[1] + 1) % 5
    v = verify_gumbel([ys[0], wrong, ys[2]], p, 3, 10)
    assert (v.n_accepted, v.next_token, v.next_kind, v.accept_probs) == (1, ys[1], "correction", [1.0, 0.0])
    assert v.residual is None and v.uniforms == []
    with pytest.raises(ValueError):
        verify_gumbel([1, 2], p, 3, 10)


def test_verify_chain_dispatches_on_the_rule():
    p = TOY["skewed"][None].expand(2, 5)
    q = TOY["flat"][:5][None] / TOY["flat"][:5].sum()
    g = torch.Generator().manual_seed(8)
    v = verify_chain([0], q, p, GUMBEL, g, 4)
    assert v.uniforms == [] and v.accept_probs in ([1.0], [0.0])
    v = verify_chain([0], q, p, SamplingConfig(temperature=1.0), g, 4)
    assert len(v.uniforms) == 1


def test_verify_tree_gumbel_walks_the_targets_picks():
    p = TOY["skewed"][None].expand(5, 5)
    y0, y1 = gumbel_argmax(p[0], 1, 20), gumbel_argmax(p[0], 1, 21)
    other = (y0 + 1) % 5
    tokens, parents = [other, y0, (y1 + 1) % 5, y1], [-1, -1, 1, 1]
    v = verify_tree_gumbel(tokens, parents, p, 1, 20)
    assert v.path == [1, 3] and v.next_kind == "bonus"
    assert v.next_token == gumbel_argmax(p[4], 1, 22)
    assert v.accept_probs == [0.0, 1.0, 0.0, 1.0]


def test_agreement_is_at_least_the_papers_bound_and_at_most_one_minus_tv():
    p = TOY["skewed"]
    q = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1], dtype=torch.float64)
    tv = float(0.5 * (p - q).abs().sum())
    a = gumbel_agreement(p, q, samples=4000, seed=1)
    assert (1 - tv) / (1 + tv) - 0.03 <= a <= 1 - tv + 0.03
    assert gumbel_agreement(p, p, samples=200) == 1.0


def test_bad_rule_and_bad_input_raise_clearly(tiny):
    with pytest.raises(InputError, match="sampling rule"):
        SamplingConfig(temperature=1.0, rule="coin")
    with pytest.raises(ValueError, match="zero total mass"):
        gumbel_argmax(torch.zeros(4), 0, 0)
    with pytest.raises(ValueError, match="negative, NaN"):
        gumbel_argmax(torch.tensor([0.5, float("nan")]), 0, 0)
    with pytest.raises(ValueError, match="position"):
        gumbel_noise(0, -1, 4)
    target = tiny["target"]
    prop = PromptLookupProposer(target_vocab=32)
    with pytest.raises(InputError, match="exclude each other"):
        SpeculativeDecoder(target, prop, PROMPTS[0], sampling=GUMBEL, tree=4, accept="typical")
    assert not SamplingConfig(rule="gumbel").gumbel  # greedy ignores the rule


EMBEDDED_KINDS = ["embedded-head", "embedded-medusa", "embedded-block", "embedded-draft", "ngram", "early-exit:10"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", EMBEDDED_KINDS)
def test_embedded_plain_and_speculative_texts_are_equal(embedded, kind):
    """Every shipped draft kind on the real model, sampled at T 0.8 under the rule: the speculative tokens are plain
    decoding's for each seed, and the drafts' picks (same noise) are kept often enough to matter."""
    draft = load_model("embedded-draft", device="cpu") if kind == "embedded-draft" else None
    ids = encode_prompt(embedded.tokenizer, "Write a short poem about the sea.")
    cfg = SamplingConfig(temperature=0.8, rule="gumbel")
    accepted = 0
    for seed in range(3):
        ref = generate(embedded, None, ids, sampling=cfg, seed=seed, max_new_tokens=24).token_ids
        prop = make_proposer("model" if kind == "embedded-draft" else kind, embedded, draft)
        res = generate(embedded, prop, ids, gamma=3, sampling=cfg, seed=seed, max_new_tokens=24)
        assert res.token_ids == ref, (kind, seed)
        accepted += sum(r.n_accepted for r in res.rounds)
    if kind != "ngram":
        assert accepted > 0, kind


def test_the_command_line_runs_the_rule(tiny, capsys):
    """``generate --sampling-rule gumbel``: the speculative run's text is plain decoding's, and the JSON says the rule."""
    import json

    from engine.__main__ import main

    texts = []
    for draft in ("ngram", "none"):
        rc = main(["generate", "--target", str(tiny["target"].spec), "--draft", draft, "--prompt", "w1 w2 w3 w1 w2",
                   "--no-chat", "--temperature", "1.0", "--seed", "4", "--sampling-rule", "gumbel",
                   "--max-new-tokens", "12", "--json"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        assert out["settings"]["sampling_rule"] == "gumbel"
        texts.append(out["token_ids"])
    assert texts[0] == texts[1]


def test_rule_acceptance_and_the_measured_result(tmp_path):
    import json

    from engine.explain.coupling import measured_rule_acceptance, rule_acceptance

    ra = rule_acceptance([0.5, 0.3, 0.2], [0.2, 0.3, 0.5], rows=3000)
    assert ra.standard == pytest.approx(0.7) and ra.bound == pytest.approx(0.7 / 1.3)
    assert ra.bound - 0.03 <= ra.gumbel <= ra.standard + 0.03
    with pytest.raises(InputError):
        rule_acceptance([0.5, 0.5], [1.0], rows=10)
    with pytest.raises(InputError):
        rule_acceptance([0.5, -0.5], [0.5, 0.5], rows=10)
    assert measured_rule_acceptance(tmp_path / "missing.json") is None
    f = tmp_path / "gumbel_x.json"
    f.write_text(json.dumps({"meta": {"cpu": "Some CPU", "date": "2026-12-07"},
                             "args": {"prompts": 12, "gamma": 2, "temperature": 0.8},
                             "acceptance": {"rules": {"standard": {"alpha": 0.6}, "gumbel": {"alpha": 0.55}},
                                            "sum_min_pq_mean": 0.62, "gumbel_agreement_mean": 0.57,
                                            "paper_bound_mean": 0.48, "positions": 100,
                                            "identical_to_plain": [True] * 12}}))
    m = measured_rule_acceptance(f)
    assert m["alpha_gumbel"] == 0.55 and m["identical"] == 12 and m["cpu"] == "Some CPU"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["embedded-head", "embedded-medusa", "ngram"])
def test_embedded_token_trees_give_the_plain_tokens(embedded, kind):
    """Token trees on the real model under the rule (the head's children ranked by log q + g, Gumbel-top-k; Medusa's
    static tree; prompt lookup's matches): the tokens of plain decoding with the seed, and the head's top child is
    the chain's proposal, so its trees keep a draft token often."""
    ids = encode_prompt(embedded.tokenizer, "Write a short poem about the sea.")
    cfg = SamplingConfig(temperature=0.8, rule="gumbel")
    accepted = 0
    for seed in range(2):
        ref = generate(embedded, None, ids, sampling=cfg, seed=seed, max_new_tokens=20).token_ids
        prop = make_proposer(kind, embedded)
        if hasattr(prop, "set_branching") and kind != "embedded-medusa":
            prop.set_branching(3)
        res = generate(embedded, prop, ids, gamma=3, sampling=cfg, seed=seed, max_new_tokens=20,
                       tree=getattr(prop, "tree_size", 0) if kind == "embedded-medusa" else 8)
        assert res.token_ids == ref, (kind, seed)
        assert all(r.tree is None or r.tree.rule == "gumbel" for r in res.rounds)
        accepted += sum(r.n_accepted for r in res.rounds)
    if kind == "embedded-head":
        assert accepted > 0
