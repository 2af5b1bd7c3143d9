"""engine.explain.analytic against hand-computed values (arithmetic in the comments)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from engine.errors import InputError
from engine.explain.analytic import (
    HARDWARE_PRESETS,
    analytic_view,
    batch_speedup_curve,
    best_gamma,
    break_even_alpha,
    compare_with_measured,
    expected_tokens_per_pass,
    expected_tokens_per_round,
    roofline_step_s,
    simulate_rounds,
    speedup,
    tokens_per_pass_distribution,
    try_it_exercises,
    verify_cost_ratio,
)


def test_seed_values_from_the_explainer():
    # (1 - 0.8^5) / 0.2 = (1 - 0.32768) / 0.2 = 3.3616
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx(3.3616)
    # 3.3616 / (4 * 0.05 + 1) = 3.3616 / 1.2 = 2.80133
    assert speedup(0.8, 4, 0.05) == pytest.approx(2.801333, rel=1e-6)
    # (1 - 0.6^5) / 0.4 = (1 - 0.07776) / 0.4 = 2.3056
    assert expected_tokens_per_pass(0.6, 4) == pytest.approx(2.3056)


def test_limits_are_finite():
    assert expected_tokens_per_pass(1.0, 4) == 5.0          # limit γ + 1
    assert expected_tokens_per_pass(0.0, 4) == 1.0          # only the target's own token
    assert speedup(1.0, 16, 0.0) == 17.0                    # 17 / (0 + 1)
    assert speedup(0.0, 1, 1.0) == 0.5                      # 1 / (1 + 1)
    # close to 1 the closed form would lose precision; the sum stays smooth: ≈ 5 − 10·1e-9
    assert expected_tokens_per_pass(1 - 1e-9, 4) == pytest.approx(5.0, abs=1e-7)
    for a in (0.0, 1.0):
        for c in (0.0, 1.0):
            for s in (0.0, 1.0):
                v = analytic_view(a, 16, c, s)
                nums = [v.tokens_per_pass, v.speedup, v.speedup_realistic, v.best_speedup,
                        v.best_speedup_realistic] + sum(v.heat, []) + v.tokens_vs_alpha \
                    + sum(v.curves.values(), []) + sum(v.curves_realistic.values(), [])
                assert all(math.isfinite(x) for x in nums)


def test_best_gamma():
    # α = 0.6, c = 0.05: γ=3: 2.176/1.15 = 1.8922; γ=4: 2.3056/1.2 = 1.9213; γ=5: 2.38336/1.25 = 1.9067
    g, s = best_gamma(0.6, 0.05)
    assert g == 4 and s == pytest.approx(2.3056 / 1.2)
    # α = 0.8, c = 0.05: γ=8: (1 - 0.8^9)/0.2 / 1.4 = (1 - 0.134218)/0.2/1.4 = 3.09208; γ=7: 3.0827; γ=9: 3.0781
    g, s = best_gamma(0.8, 0.05)
    assert g == 8 and s == pytest.approx((1 - 0.8 ** 9) / 0.2 / 1.4)
    # free draft, perfect agreement: the longest draft wins
    assert best_gamma(1.0, 0.0)[0] == 16


def test_break_even_alpha():
    # simple model, γ = 1: (1 + α)/(1 + c) = 1  ⇒  α = c; longer drafts need more (1+α+α² = 1+2c ⇒ α > c)
    assert break_even_alpha(0.3) == pytest.approx(0.3, abs=1e-8)
    assert break_even_alpha(0.05) == pytest.approx(0.05, abs=1e-8)
    assert break_even_alpha(0.0) == 0.0          # a free draft never loses
    assert break_even_alpha(1.0) is None         # (1 + α)/2 ≤ 1 for every α: never pays
    # with verify slope s, γ = 1: (1 + α)/(1 + c + s) = 1  ⇒  α = c + s = 0.4
    assert break_even_alpha(0.3, slope=0.1) == pytest.approx(0.4, abs=1e-8)
    # fixed γ = 2, c = 0.3: 1 + α + α² = 1.6 ⇒ α = (−1 + √3.4)/2 = 0.42195
    assert break_even_alpha(0.3, gamma=2) == pytest.approx((-1 + math.sqrt(3.4)) / 2, abs=1e-8)


def test_verify_cost_ratio():
    assert verify_cost_ratio(5, 0.0) == 1.0
    assert verify_cost_ratio(5, 0.25) == 2.0                # 1 + 0.25·4
    curve = {1: 10.0, 3: 12.0, 5: 16.0}
    assert verify_cost_ratio(5, measured_ms=curve) == pytest.approx(1.6)   # 16/10
    assert verify_cost_ratio(2, measured_ms=curve) == pytest.approx(1.1)   # interp 11/10
    assert verify_cost_ratio(7, measured_ms=curve) == pytest.approx(2.0)   # extend: 16 + 2·2 = 20 → 2.0
    # no n = 1 point: t(1) extrapolated back from 2 → 12 (slope 2/ms per token): 10
    assert verify_cost_ratio(4, measured_ms={2: 12.0, 4: 16.0}) == pytest.approx(1.6)
    with pytest.raises(InputError):
        verify_cost_ratio(0)
    with pytest.raises(InputError):
        verify_cost_ratio(3, measured_ms={1: 0.0})
    with pytest.raises(InputError):
        verify_cost_ratio(3, slope=-1)


def test_realistic_model_lowers_speedup():
    v = analytic_view(0.8, 4, 0.05, 0.1)
    # 3.3616 / (0.2 + 1 + 0.1·4) = 3.3616 / 1.6 = 2.101
    assert v.speedup_realistic == pytest.approx(3.3616 / 1.6)
    assert v.speedup_realistic < v.speedup
    assert v.best_gamma_realistic < v.best_gamma


def test_distribution_is_truncated_geometric():
    d = tokens_per_pass_distribution(0.8, 4)
    # P(1)=0.2, P(2)=0.16, P(3)=0.128, P(4)=0.1024, P(5)=0.8^4=0.4096
    assert d == pytest.approx([0.2, 0.16, 0.128, 0.1024, 0.4096])
    assert d.sum() == pytest.approx(1.0)
    assert float((np.arange(1, 6) * d).sum()) == pytest.approx(3.3616)
    assert tokens_per_pass_distribution(1.0, 3).tolist() == [0.0, 0.0, 0.0, 1.0]


def test_simulator_converges_and_is_reproducible():
    r = simulate_rounds(0.8, 4, 10_000, seed=1)
    # standard deviation of T: E[T²] = 1·.2 + 4·.16 + 9·.128 + 16·.1024 + 25·.4096 = 13.6624; var = 13.6624 − 3.3616² = 2.3621
    # sd of the mean over 10 000 rounds = √2.3621/100 = 0.0154; allow 4 sd
    assert abs(r.mean - 3.3616) < 4 * 0.0154
    assert sum(r.counts) == 10_000 and len(r.counts) == 5
    freq = np.array(r.counts) / 10_000
    assert np.abs(freq - r.exact).max() < 0.02
    # round i does not depend on how many rounds were asked for (Step extends the history)
    assert simulate_rounds(0.8, 4, 10, seed=1).tokens == r.tokens[:10]
    assert simulate_rounds(0.0, 4, 5).tokens == [1] * 5
    assert simulate_rounds(1.0, 4, 5).tokens == [5] * 5
    last = simulate_rounds(1.0, 2, 1).last_round
    assert last == ["accepted", "accepted", "bonus"]
    assert simulate_rounds(0.5, 3, 0).mean is None


def test_exercises():
    ex = try_it_exercises(3.2, 12)
    assert ex[0].numbers["expected"] == pytest.approx(3.3616)
    assert "12 simulated rounds gave 3.20" in ex[0].answer
    assert ex[1].numbers["best_gamma_06"] == 4 and ex[1].numbers["best_gamma_08"] == 8
    # a 5th draft token: gain 0.6^5 / 2.3056 = 0.07776/2.3056 = 3.37 % < cost 0.05/1.2 = 4.17 %
    assert ex[1].numbers["gain_next"] < ex[1].numbers["cost_next"]
    assert ex[2].numbers["break_even"] == pytest.approx(0.3, abs=1e-6)


def test_roofline_and_batch_curve():
    # 7e9 params × 2 bytes / 3.35e12 B/s = 4.179 ms; compute at batch 1: 2·7e9/989e12 = 0.014 ms
    assert roofline_step_s(7e9, 2, 3.35e12, 989e12, 1, 1) == pytest.approx(14e9 / 3.35e12)
    assert roofline_step_s(7e9, 2, 3.35e12, 989e12, 1000, 1) == pytest.approx(2 * 7e9 * 1000 / 989e12)
    hw = HARDWARE_PRESETS["H100 SXM"]
    b = batch_speedup_curve(0.8, 4, 0.05, 7, 2, hw.bandwidth / 1e9, hw.peak_flops / 1e12)
    assert b.speedup_at_1 == pytest.approx(3.3616 / 1.2)
    # verify ridge: 2·989e12 / (2·3.35e12·5) = 59.04 sequences
    assert b.ridge_batch_verify == pytest.approx(989 / 3.35 / 5)
    # shown as whole batches past the ridge: 59 × 5 = 295 tokens < 295.22 is still memory-bound → 60;
    # plain decode ridge 989 / 3.35 = 295.22 → 296
    assert (b.first_compute_bound_verify, b.first_compute_bound_decode) == (60, 296)
    # crossover: 3.3616·4.1791 = 0.2·4.1791 + 2·7e9·B·5/989e12 (ms) ⇒ B = (14.0485 − 0.8358)/0.070779 = 186.7
    assert b.crossover_batch == pytest.approx(186.7, abs=0.5)
    assert b.speedups[0] > 1 > b.speedups[-1]
    assert all(x >= y - 1e-12 for x, y in zip(b.speedups, b.speedups[1:]))   # never rises with B
    # all compute-bound: 3.3616 / (0.2 + 5) = 0.6465
    assert b.speedups[-1] == pytest.approx(3.3616 / 5.2)
    assert batch_speedup_curve(0.1, 4, 1.0, 7, 2, 3350, 989).crossover_batch == 0.0
    assert batch_speedup_curve(0.8, 4, 0.05, 7, 2, 3350, 989, max_batch=8).crossover_batch is None
    with pytest.raises(InputError):
        batch_speedup_curve(0.8, 4, 0.05, -7, 2, 3350, 989)


def test_compare_with_measured():
    run = types.SimpleNamespace(acceptance_rate=0.75, draft_cost_ratio=0.1, gamma=3,
                                verify_ms_by_tokens={1: 20.0, 4: 26.0}, measured_speedup=1.7)
    m = compare_with_measured(run)
    # E = 1 + .75 + .5625 + .421875 = 2.734375; simple: / (0.3 + 1) = 2.1034; curve: t(4)/t(1) = 1.3 → / 1.6 = 1.7090
    assert m.tokens_per_pass == pytest.approx(2.734375)
    assert m.predicted_simple == pytest.approx(2.734375 / 1.3)
    assert m.predicted_curve == pytest.approx(2.734375 / 1.6)
    assert m.measured == 1.7 and m.curve_ns == [1, 4]
    # slope through t(4)/t(1) = 1.3 at γ = 3: (1.3 − 1) / 3 = 0.1; the analytic model then gives the same
    assert m.verify_slope == pytest.approx(0.1)
    assert analytic_view(0.75, 3, 0.1, m.verify_slope).speedup_realistic == pytest.approx(m.predicted_curve)
    m2 = compare_with_measured(types.SimpleNamespace(acceptance_rate=0.5, draft_cost_ratio=0.2, gamma=2,
                                                     verify_ms_by_tokens={}, measured_speedup=None))
    assert m2.predicted_curve is None and m2.measured is None and m2.verify_slope is None
    with pytest.raises(InputError):
        compare_with_measured(object())
    with pytest.raises(InputError):
        compare_with_measured(types.SimpleNamespace(acceptance_rate=0.5, draft_cost_ratio=1.5, gamma=2,
                                                    verify_ms_by_tokens={}, measured_speedup=None))


def test_compare_with_measured_needs_a_timed_one_token_pass_and_rebases_c_on_it():
    ns = types.SimpleNamespace
    # a user's two stepped rounds: a warm-up pass over 2 tokens (380 ms) and one over 3 (55 ms). t(1)
    # extrapolated from them was 705 ms, so t(3)/t(1) = 0.07 and a "2.75×" prediction: now none
    m = compare_with_measured(ns(acceptance_rate=2 / 3, draft_cost_ratio=0.347, gamma=2,
                                 verify_ms_by_tokens={2: 380.0, 3: 55.0}, measured_speedup=None))
    assert m.predicted_curve is None and m.verify_ratio is None and m.verify_slope is None
    assert "Run baseline" in m.curve_note and m.c == pytest.approx(0.347)
    assert m.c_basis == "mean target pass of the run"
    # a pass over γ + 1 tokens timed faster than a 1-token pass: noise, no prediction
    m = compare_with_measured(ns(acceptance_rate=0.5, draft_cost_ratio=0.1, gamma=2,
                                 verify_ms_by_tokens={1: 60.0, 3: 55.0}, measured_speedup=None))
    assert m.predicted_curve is None and "faster than a 1-token pass" in m.curve_note
    # with t(1) = 40 ms and a draft step of 4.6 ms, c = 4.6 / 40 = 0.115 (not 4.6 / t̄ = 0.0913);
    # α = 0.6, γ = 2: E = 1 + 0.6 + 0.36 = 1.96; simple 1.96 / (2·0.115 + 1) = 1.96 / 1.23 = 1.5935;
    # t(3)/t(1) = 50.4 / 40 = 1.26: 1.96 / (0.23 + 1.26) = 1.96 / 1.49 = 1.3154
    m = compare_with_measured(ns(acceptance_rate=0.6, draft_cost_ratio=4.6 / 50.4, gamma=2, draft_ms_per_token=4.6,
                                 verify_ms_by_tokens={1: 40.0, 3: 50.4}, measured_speedup=1.3))
    assert m.c == pytest.approx(0.115) and m.c_basis == "1-token target pass" and m.curve_note is None
    assert m.predicted_simple == pytest.approx(1.96 / 1.23)
    assert m.verify_ratio == pytest.approx(1.26) and m.predicted_curve == pytest.approx(1.96 / 1.49)
    # the sliders set from it reproduce it: slope (1.26 − 1) / 2 = 0.13
    assert analytic_view(0.6, 2, m.c, m.verify_slope).speedup_realistic == pytest.approx(m.predicted_curve)


@pytest.mark.parametrize("bad", [(-0.1, 4, 0.05), (1.1, 4, 0.05), (float("nan"), 4, 0.05),
                                 (0.5, 0, 0.05), (0.5, 65, 0.05), (0.5, 2.5, 0.05), (0.5, 4, -0.1),
                                 (0.5, 4, 1.5), ("x", 4, 0.1)])
def test_bad_input_raises(bad):
    with pytest.raises(InputError):
        speedup(*bad)


def test_best_gamma_beyond_the_sliders_is_flagged():
    # α = 0.9, c = 0.02: by hand, γ = 19: E = (1 − 0.9²⁰)/0.1 = 8.78423, / (1 + 0.38) = 6.3654; γ = 20:
    # (1 − 0.9²¹)/0.1 = 8.90581, / 1.40 = 6.3613; γ = 16 (the sliders' limit): 6.3123
    v = analytic_view(0.9, 8, 0.02)
    assert v.best_gamma == 16 and v.best_speedup == pytest.approx(6.3123, abs=1e-4)
    g, s = v.beyond_gamma_max
    assert g == 19 and s == pytest.approx((1 - 0.9 ** 20) / 0.1 / 1.38)
    assert analytic_view(0.6, 8, 0.3).beyond_gamma_max is None


def test_expected_tokens_per_round_at_each_rounds_draft_length():
    # α = 0.5, rounds drafting 0, 2, 4: 1, 1 + .5 + .25 = 1.75, 1.9375 → mean 4.6875 / 3 = 1.5625
    assert expected_tokens_per_round(0.5, [0, 2, 4]) == pytest.approx(1.5625)
    # every round at γ: Eq. 1 itself
    assert expected_tokens_per_round(0.8, [4, 4, 4]) == pytest.approx(expected_tokens_per_pass(0.8, 4))
    with pytest.raises(InputError):
        expected_tokens_per_round(0.5, [])
    with pytest.raises(InputError):
        expected_tokens_per_round(0.5, [2, -1])


def test_expected_tokens_by_position_by_hand():
    from engine.explain.analytic import expected_tokens_by_position

    # α = (0.5, 0.8): 1 + 0.5 + 0.5·0.8 = 1.9; no draft: 1 token
    assert expected_tokens_by_position([0.5, 0.8], 2) == pytest.approx(1.9)
    assert expected_tokens_by_position([0.5, 0.8], 0) == 1.0
    # a third position the run never judged takes the pooled α̂ 0.6: + 0.4·0.6 = 2.14
    assert expected_tokens_by_position([0.5, 0.8], 3, 0.6) == pytest.approx(2.14)
    # one α at every position: Leviathan et al.'s E
    assert expected_tokens_by_position([0.7] * 4, 4) == pytest.approx(expected_tokens_per_pass(0.7, 4))
    with pytest.raises(InputError):
        expected_tokens_by_position([0.5], 2)
    with pytest.raises(InputError):
        expected_tokens_by_position([1.5], 1)
    with pytest.raises(InputError):
        expected_tokens_by_position([0.5], -1)


def _run_record(**kw):
    """A prompt-lookup-like measured_run record: 4 rounds, 2 with no draft and 2 of γ = 4 tokens."""
    rec = dict(acceptance_rate=0.75, draft_cost_ratio=0.08, gamma=4, draft_ms_per_token=2.0,
               verify_ms_by_tokens={1: 20.0, 2: 22.0, 5: 30.0}, measured_speedup=1.5,
               draft_length_counts={0: 2, 4: 2}, verify_tokens_counts={1: 2, 5: 2},
               acceptance_by_position=[0.5, 1.0, 1.0, 1.0], new_tokens=8, prefill_ms=100.0,
               prefill_round_tokens=5, draft_prefill_ms=0.0, overhead_ms_per_round=1.0,
               base_new_tokens=8, base_prefill_ms=60.0, base_overhead_ms_per_round=0.5)
    rec.update(kw)
    return types.SimpleNamespace(**rec)


def test_predict_from_run_steps_by_hand():
    from engine.explain.analytic import gap_rows, predict_from_run

    p = predict_from_run(_run_record())
    # t(1) = 20 ms, c = 2 / 20 = 0.1.
    assert p.t1_ms == 20.0 and p.c == pytest.approx(0.1)
    # constant: E(0.75, 4) = 3.05078125; cost 4·0.1 + t(5)/t(1) = 0.4 + 1.5 = 1.9 → 1.60567
    s = p.step("constant")
    assert (s.tokens_per_round, s.cost_per_round) == (pytest.approx(3.05078125), pytest.approx(1.9))
    assert s.speedup == pytest.approx(3.05078125 / 1.9)
    assert s.speedup == pytest.approx(compare_with_measured(_run_record()).predicted_curve)
    # the run's lengths: E = (2·1 + 2·3.05078125) / 4 = 2.025390625; cost = (2·4·0.1 + 2·1 + 2·1.5) / 4 = 1.45
    s = p.step("lengths")
    assert (s.tokens_per_round, s.cost_per_round) == (pytest.approx(2.025390625), pytest.approx(1.45))
    assert s.speedup == pytest.approx(2.025390625 / 1.45)
    # α̂ by position (0.5, 1, 1, 1): a round of 4 gives 1 + 0.5·4 = 3; E = (2 + 2·3) / 4 = 2.0 → 2 / 1.45
    s = p.step("positions")
    assert s.tokens_per_round == pytest.approx(2.0) and s.speedup == pytest.approx(2.0 / 1.45)
    # prefill and bookkeeping: 8 tokens in 8 / 2 = 4 rounds; spec = 100 + 4·(1.45·20 + 1) − t(5) = 100 + 120 −
    # 30 = 190 ms; base = 60 + 7·20 + 8·0.5 = 204 ms → (204 / 8) / (190 / 8) = 1.07368
    s = p.step("from_run")
    assert s.speedup == pytest.approx(204 / 190)
    assert s.error == pytest.approx(204 / 190 / 1.5 - 1)
    assert [x.key for x in p.steps] == ["constant", "lengths", "positions", "from_run"]
    assert (p.mean_draft_length, p.empty_rounds, p.n_rounds) == (2.0, 2, 4)
    # the sentence: constant ÷ lengths − 1 = 1.60567 / 1.39682 − 1 = +15 %; lengths ÷ positions − 1 = +1 %;
    # positions ÷ from_run − 1 = 1.37931 / 1.07368 − 1 = +28 %
    assert ("drafts γ = 4 (the run drafted 2.0 per round on average, 2 of 4 rounds none) moves the prediction "
            "by +15%") in p.summary
    assert "by position by +1%" in p.summary and "bookkeeping by +28%" in p.summary
    assert "1.07× against 1.50× measured (-28.4%)" in p.summary
    rows = gap_rows(p)
    assert len(rows) == 4 and rows[-1]["speedup ×"] == pytest.approx(204 / 190)
    assert rows[0]["off from measured %"] == pytest.approx(100 * (3.05078125 / 1.9 / 1.5 - 1))


def test_predict_from_run_with_full_length_drafts_is_todays_formula():
    """Every round drafts γ and feeds γ + 1 tokens: the run's lengths change nothing; with one α̂ at every
    position neither does α̂ by position."""
    from engine.explain.analytic import predict_from_run

    rec = _run_record(draft_length_counts={4: 7}, verify_tokens_counts={5: 7}, acceptance_by_position=[0.75] * 4)
    p = predict_from_run(rec)
    today = compare_with_measured(rec).predicted_curve
    assert p.step("lengths").speedup == pytest.approx(today)
    assert p.step("positions").speedup == pytest.approx(today)
    assert today == pytest.approx(expected_tokens_per_pass(0.75, 4) / (4 * 0.1 + 30 / 20))


def test_predict_from_run_needs_the_profile_and_t1():
    from engine.explain.analytic import predict_from_run

    assert predict_from_run(types.SimpleNamespace(acceptance_rate=0.5, draft_cost_ratio=0.1, gamma=2,
                                                  verify_ms_by_tokens={1: 20.0}, measured_speedup=None)) is None
    assert predict_from_run(_run_record(verify_ms_by_tokens={5: 30.0})) is None  # no timed t(1)
    # without a baseline's prefill there is no whole-run step; without a measurement no errors
    p = predict_from_run(_run_record(base_prefill_ms=None, measured_speedup=None))
    assert [s.key for s in p.steps] == ["constant", "lengths", "positions"]
    assert p.measured is None and all(s.error is None for s in p.steps)
    with pytest.raises(InputError):
        predict_from_run(_run_record(draft_length_counts={-1: 3}))
    with pytest.raises(InputError):
        predict_from_run(_run_record(acceptance_by_position=[1.2]))
    with pytest.raises(InputError):
        predict_from_run(_run_record(verify_tokens_counts={1: 2, 5: 3}))  # 4 rounds against 5


def test_signed_percent_never_reads_minus_zero():
    from engine.explain.analytic import signed_percent

    assert signed_percent(0.15) == "+15%" and signed_percent(-0.0126) == "-1%"
    assert signed_percent(-0.004) == "-0.4%" and signed_percent(0.0049) == "+0.5%"
    assert signed_percent(-0.0004) == "±0%" and signed_percent(0.0) == "±0%"
