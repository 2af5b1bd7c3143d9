"""engine.explain.why: the three conditions of a measured speedup, hand-computed."""

from types import SimpleNamespace

import pytest

from engine.explain.why import paying_case, unsure_reasons, why_from_race, why_from_run, why_here


def test_three_conditions_and_what_held_back():
    # α̂ 0.5, γ 1: E = 1.5; r = 14/10 = 1.4; c = 1/10 = 0.1 → 1.5 / (0.1 + 1.4) = 1.00
    w = why_here(alpha=0.5, gamma=1, measured=1.02, t1_ms=10.0, verify_ms=14.0, draft_ms_per_token=1.0)
    assert w.verify_ratio == pytest.approx(1.4) and w.c == pytest.approx(0.1)
    assert w.predicted == pytest.approx(1.0)
    # perfect acceptance: 2 / 1.5 = 1.333; a free verify pass: 1.5 / 1.1 = 1.364; a free draft: 1.5 / 1.4 = 1.071
    assert w.condition("acceptance").if_ideal == pytest.approx(4 / 3)
    assert w.condition("verify").if_ideal == pytest.approx(1.5 / 1.1)
    assert w.condition("draft").if_ideal == pytest.approx(1.5 / 1.4)
    assert w.limiting == "verify"
    assert w.condition("draft").ok and not w.condition("verify").ok
    assert not w.unsure
    assert "1.00×" in w.headline() and "verify pass" in w.headline()
    q = w.whatif_link().query()
    assert q == {"wi_tab": "Analytic model", "wi_alpha": "0.5", "wi_gamma": "1", "wi_cost": "0.1", "wi_slope": "0.4"}


def test_acceptance_holds_back_a_cheap_pass():
    # α̂ 0.2, γ 4, r 1.0, c 0: E = 1.2496, predicted 1.2496; perfect acceptance 5.0
    w = why_here(alpha=0.2, gamma=4, measured=1.2, t1_ms=8.0, verify_ms=8.0, draft_ms_per_token=0.0)
    assert w.predicted == pytest.approx(1.2496)
    assert w.limiting == "acceptance" and w.condition("acceptance").if_ideal == pytest.approx(5.0)
    assert w.condition("verify").ok and w.condition("draft").ok


def test_unsure_run_with_a_slow_draft_says_so_and_predicts_nothing():
    # a busy machine's c = 25.9 / 10 = 2.59: outside the model's [0, 1], and the run is unsure
    w = why_here(alpha=0.6, gamma=1, measured=1.59, t1_ms=10.0, verify_ms=12.0, draft_ms_per_token=25.9, spread=2.1,
                 tokens_per_round=1.6)
    assert w.predicted is None and w.limiting is None
    assert w.unsure == ["the timed runs of one kind differed by up to 2.1×"]
    assert "2.59" in w.note and "unsure" in w.note
    assert "unsure" in w.headline()


def test_unsure_reasons():
    assert unsure_reasons(None, 1.5, 3.0) == []
    assert unsure_reasons(1.1, 1.5, 1.2) == []
    assert len(unsure_reasons(1.7, 1.5, 1.2)) == 1  # above tokens per round × 1.02
    assert len(unsure_reasons(1.7, 1.5, 1.6)) == 2


def test_from_a_live_run_record():
    rec = SimpleNamespace(acceptance_rate=0.5, gamma=1, measured_speedup=1.02, verify_ms_by_tokens={1: 10.0, 2: 14.0},
                          draft_ms_per_token=1.0, new_tokens=60, n_rounds=40, spread=1.1, unsure=[])
    w = why_from_run(rec)
    assert w.predicted == pytest.approx(1.0) and w.tokens_per_pass == pytest.approx(1.5)
    rec.measured_speedup = None
    assert why_from_run(rec) is None  # before Run baseline
    rec.measured_speedup, rec.unsure = 1.59, ["the timed runs of one kind differed by up to 2.1×"]
    assert why_from_run(rec).unsure == rec.unsure


def _span(kind, ms, tokens, rnd=0):
    return SimpleNamespace(kind=kind, start_ms=0.0, end_ms=ms, ms=ms, tokens=tokens, round=rnd)


def test_from_a_race():
    acc, rej = SimpleNamespace(verdict="accepted"), SimpleNamespace(verdict="rejected")
    spec = SimpleNamespace(rounds=[SimpleNamespace(draft=[acc]), SimpleNamespace(draft=[rej]),
                                   SimpleNamespace(draft=[acc])],
                           spans=[_span("prefill", 50.0, 30), _span("draft", 0.9, 1), _span("verify", 11.0, 2),
                                  _span("draft", 1.1, 1), _span("verify", 13.0, 2), _span("draft", 1.0, 1),
                                  _span("verify", 12.0, 2)], tokens_per_pass=1.6)
    plain = SimpleNamespace(spans=[_span("step", 9.0, 1), _span("step", 10.0, 1), _span("step", 11.0, 1)])
    race = SimpleNamespace(spec=spec, plain=plain, settings={"gamma": 1}, speedup=1.05, spread=1.1, others_max=0,
                           rows_max=0)
    w = why_from_race(race)
    # α̂ 2/3; t(1) 10; r = 12/10; c = 1.0/10 → (1 + 2/3) / (0.1 + 1.2) = 1.282
    assert w.alpha == pytest.approx(2 / 3) and w.verify_ratio == pytest.approx(1.2) and w.c == pytest.approx(0.1)
    assert w.predicted == pytest.approx((5 / 3) / 1.3)
    race.others_max = 2
    assert "other readers" in why_from_race(race).unsure[-1]


def test_paying_case_from_the_shipped_race_result():
    case = paying_case()
    assert case is not None
    assert case.low >= 1.2 and case.high >= case.low
    assert case.race["rc_draft"] == "ngram" and case.race["rc_preset"] == "code"
    assert case.date.startswith("2026-")
    case.here = False
    assert "another machine" in case.sentence() and case.machine in case.sentence()
    case.here = True
    assert f"on this machine ({case.machine}" in case.sentence()  # the result of this kind of CPU, else the reference
    assert case.link().url_path == "race"


def test_paying_case_missing_file(tmp_path):
    assert paying_case(tmp_path / "race_x.json") is None


def test_whatif_comparison_says_an_unsure_run_was_unsure():
    from engine.errors import InputError
    from engine.explain.analytic import compare_with_measured

    run = SimpleNamespace(acceptance_rate=0.6, draft_cost_ratio=2.59, gamma=1, verify_ms_by_tokens={},
                          measured_speedup=1.59, unsure=["the timed runs of one kind differed by up to 2.1×"])
    with pytest.raises(InputError, match="Live run was unsure .*2.1×"):
        compare_with_measured(run)
    run.unsure = []
    with pytest.raises(InputError, match="outside \\[0, 1\\]"):
        compare_with_measured(run)


def test_card_rows_mark_what_held_back():
    from app.why_view import why_rows

    w = why_here(alpha=0.5, gamma=1, measured=1.02, t1_ms=10.0, verify_ms=14.0, draft_ms_per_token=1.0)
    rows = why_rows(w)
    assert [r["key"] for r in rows] == ["acceptance", "verify", "draft"]
    assert [r["limiting"] for r in rows] == [False, True, False]
    assert [r["title"] for r in rows] == ["⚠️ Acceptance", "⬇️ Verify pass (held it back most)", "✅ Draft step"]
    assert rows[1]["value"] == "1.40× one token" and rows[2]["value"] == "c 0.100"
    assert rows[1]["if_ideal"] == "If a pass over 2 tokens cost one token's: 1.36×"
    unsure = why_here(alpha=0.6, gamma=1, measured=1.59, t1_ms=10.0, verify_ms=12.0, draft_ms_per_token=25.9)
    assert all(r["if_ideal"] is None for r in why_rows(unsure))


def test_an_adaptive_draft_length_is_read_at_the_length_the_rounds_used():
    # the cap γ = 6, but the rounds drafted 2 most often: the model is read at 2, the verify pass at 3 tokens
    rec = SimpleNamespace(acceptance_rate=0.5, gamma=6, measured_speedup=1.0,
                          verify_ms_by_tokens={1: 10.0, 3: 15.0, 7: 30.0}, draft_ms_per_token=1.0, new_tokens=60,
                          n_rounds=40, spread=1.1, unsure=[], draft_length_counts={0: 3, 2: 30, 6: 7})
    w = why_from_run(rec)
    # E(0.5, 2) = 1.75; r = 15/10 = 1.5; c = 0.1 → 1.75 / (0.2 + 1.5)
    assert w.gamma == 2 and w.fed == 3 and w.verify_ratio == pytest.approx(1.5)
    assert w.predicted == pytest.approx(1.75 / 1.7)
    assert "under the cap γ = 6" in w.condition("acceptance").measured
    assert w.whatif_link().query()["wi_gamma"] == "2"
