"""engine.explain.toy: the explainer's toy check, run through engine.decoding.sampling.verify_sampling."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InputError
from engine.explain import toy
from engine.explain.toy import (
    acceptance_rate,
    bigram_matrix,
    run_toy_rounds,
    toy_draft,
    toy_target,
    verify_always_accept,
)


def test_toy_models_match_the_explainer():
    # target after "cat": weights [1, 1, 8, 1, 1] / 12; draft: [1, 1, 4, 1, 1] / 8
    assert toy_target("cat").tolist() == pytest.approx([1 / 12, 1 / 12, 8 / 12, 1 / 12, 1 / 12])
    assert toy_draft("cat").tolist() == pytest.approx([1 / 8, 1 / 8, 4 / 8, 1 / 8, 1 / 8])
    # "mat" wraps around to "the"
    assert int(torch.argmax(toy_target("mat"))) == 0
    # α = 4·(1/12) + 4/8 = 1/3 + 1/2 = 5/6
    assert acceptance_rate(toy_target("cat"), toy_draft("cat")) == pytest.approx(5 / 6)
    assert bigram_matrix(1.0).flatten().tolist() == pytest.approx([0.2] * 25)


def test_first_token_follows_target_and_acceptance_matches():
    r = run_toy_rounds(5000, gamma=4, seed=0)
    assert sum(r.first_counts) == 5000
    # a correct rule: χ² goodness of fit against p does not reject at 1 %
    assert r.chi2_p > 0.01
    assert r.tvd < 0.03
    # measured per-token acceptance ≈ Σ min(p, q) = 5/6: over ~17k evaluated tokens sd ≈ √(.833·.167/17000) ≈ 0.003
    assert r.alpha_measured == pytest.approx(5 / 6, abs=0.015)
    # formula (1 − (5/6)^5)/(1/6) = 6·(1 − 0.40188) = 3.5887
    assert r.tokens_formula == pytest.approx(3.5887, abs=1e-4)
    assert r.tokens_per_pass == pytest.approx(r.tokens_formula, abs=0.08)
    assert sum(r.tokens_counts) == 5000
    # reproducible at a fixed seed
    assert run_toy_rounds(300, seed=3).first_counts == run_toy_rounds(300, seed=3).first_counts


def test_uses_the_engines_verify_function(monkeypatch):
    calls = []
    real = toy.verify_sampling

    def spy(draft, q, p, g):
        calls.append((len(draft), tuple(q.shape), tuple(p.shape)))
        return real(draft, q, p, g)

    r = run_toy_rounds(7, gamma=3, verify=spy)
    assert calls == [(3, (3, 5), (4, 5))] * 7
    assert r.rule == "spy"
    assert run_toy_rounds.__defaults__[-1] is real   # the default rule IS engine.decoding.sampling's


def test_wrong_rule_is_detected():
    r = run_toy_rounds(2000, gamma=4, seed=0, verify=verify_always_accept)
    # always accepting makes the first token follow q: P("sat") = 0.5 instead of 0.667
    assert r.chi2_p < 1e-6
    # TVD(p, q) = ½ (4·|1/12 − 1/8| + |2/3 − 1/2|) = ½ (1/6 + 1/6) = 1/6
    assert r.tvd == pytest.approx(1 / 6, abs=0.03)
    assert r.tokens_per_pass == 5.0


def test_confidence_sliders_change_alpha():
    # equal confidence: p = q, α = 1, every draft token accepted, γ + 1 tokens per pass
    r = run_toy_rounds(200, gamma=3, target_peak=6, draft_peak=6)
    assert r.alpha_formula == pytest.approx(1.0) and r.alpha_measured == 1.0 and r.tokens_per_pass == 4.0
    # uniform draft vs peak-8 target: α = 4·(1/12) + 0.2 = 0.5333
    r = run_toy_rounds(200, gamma=2, target_peak=8, draft_peak=1, context="the")
    assert r.alpha_formula == pytest.approx(4 / 12 + 0.2)


@pytest.mark.parametrize("kw", [dict(n_rounds=0), dict(n_rounds=20_001), dict(gamma=0), dict(gamma=9),
                                dict(target_peak=0.5), dict(draft_peak=100), dict(context="dog")])
def test_bad_input(kw):
    with pytest.raises(InputError):
        run_toy_rounds(**({"n_rounds": 10} | kw))
