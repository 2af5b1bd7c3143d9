"""AppTest for pages/whatif.py: every slider, button and input, URL state, no NaN/inf shown."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "whatif.py")
TIMEOUT = 60


def _app(**query) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=TIMEOUT)
    # keep the toy run small in tests unless a test asks otherwise
    at.query_params["wi_toy_n"] = "1000"
    for k, v in query.items():
        at.query_params[k] = str(v)
    return at.run()


def _tab(at, label: str) -> AppTest:
    """Open a tab (only the open tab's content runs)."""
    at.session_state["wi_tab"] = label
    return at.run()


def _metrics(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def _no_bad_numbers(at) -> None:
    assert not at.exception, at.exception
    texts = [m.value for m in at.metric] + [str(m.delta) for m in at.metric] \
        + [md.value for md in at.markdown] + [c.value for c in at.caption]
    for t in texts:
        assert not re.search(r"\bnan\b|\binf\b|∞", t, re.IGNORECASE), t


def test_defaults_show_the_seed_values():
    at = _app()
    _no_bad_numbers(at)
    m = _metrics(at)
    assert m["Tokens per target pass E"] == "3.36"          # (1 − 0.8^5)/0.2 = 3.3616
    assert m["Speedup E / (γc + 1)"] == "2.80×"              # 3.3616 / 1.2
    assert m["Best γ at this α, c"].startswith("8")
    assert m["Break-even α"] == "0.050"                      # = c in the simple model, a fraction as α's slider
    assert at.query_params["wi_alpha"] == ["0.8"] or at.query_params["wi_alpha"] == "0.8"


def test_analytic_sliders_and_extremes():
    at = _app()
    at.slider(key="wi_alpha").set_value(0.6).run()
    assert _metrics(at)["Tokens per target pass E"] == "2.31"   # (1 − 0.6^5)/0.4 = 2.3056
    at.slider(key="wi_gamma").set_value(1).run()
    assert _metrics(at)["Tokens per target pass E"] == "1.60"   # 1 + 0.6
    at.slider(key="wi_cost").set_value(1.0).run()
    assert _metrics(at)["Break-even α"] == "never pays"
    at.slider(key="wi_slope_w").set_value(0.5).run()
    assert at.session_state["wi_slope"] == 0.5  # the page's value (and the link's) follows the slider
    # γ = 1, α = 0.6, c = 1, s = 0.5: 1.6 / (1 + 1 + 0.5) = 0.64
    assert "0.64×" in _metrics(at)["Speedup E / (γc + 1)"] or "0.64×" in str(at.metric[1].delta)
    for a, c in ((1.0, 0.0), (0.0, 0.0), (1.0, 1.0), (0.0, 1.0)):
        at.slider(key="wi_alpha").set_value(a)
        at.slider(key="wi_cost").set_value(c)
        at.slider(key="wi_gamma").set_value(16).run()
        _no_bad_numbers(at)
    # α = 0, c = 1: every round emits 1 token and costs 17 → never pays; α = 1, c = 1: 17/17 = 1.00×
    assert _metrics(at)["Tokens per target pass E"] == "1.00"
    assert at.query_params["wi_gamma"] in ("16", ["16"])


def test_step_buttons_and_simulator():
    at = _tab(_app(), "Step simulator · Try it")
    assert any("No rounds yet" in i.value for i in at.info)
    at.button(key="wi_btn_step").click().run()
    assert _metrics(at)["Rounds (target passes)"] == "1"
    assert any(md.value.startswith("**Round 1:**") for md in at.markdown)
    at.button(key="wi_btn_step10").click().run()
    assert _metrics(at)["Rounds (target passes)"] == "11"
    at.button(key="wi_btn_step100").click().run()
    assert _metrics(at)["Rounds (target passes)"] == "111"
    mean = float(_metrics(at)["Average tokens per pass"])
    assert 2.9 < mean < 3.8                                   # E = 3.36, sd of mean over 111 ≈ 0.15
    ex1 = [e for e in at.expander if e.label == "Show the answer (1)"][0]
    assert not ex1.proto.expanded  # the answers stay closed until the reader opens one
    assert "111 simulated rounds gave" in ex1.markdown[0].value
    at.number_input(key="wi_seed").set_value(7).run()
    assert float(_metrics(at)["Average tokens per pass"]) != mean
    at.button(key="wi_btn_reset").click().run()
    assert any("No rounds yet" in i.value for i in at.info)
    assert at.query_params["wi_steps"] in ("0", ["0"])


def test_try_it_buttons():
    at = _tab(_app(wi_alpha=0.3, wi_gamma=9, wi_cost=0.5), "Step simulator · Try it")
    at.button(key="wi_btn_ex1").click().run()
    assert (at.slider(key="wi_alpha").value, at.slider(key="wi_gamma").value,
            at.slider(key="wi_cost").value) == (0.8, 4, 0.05)
    at.button(key="wi_btn_ex2").click().run()
    assert at.slider(key="wi_alpha").value == 0.6
    ex2 = [e for e in at.expander if e.label == "Show the answer (2)"][0]
    assert "drops from 8" in ex2.markdown[0].value and "to 4" in ex2.markdown[0].value
    at.button(key="wi_btn_ex3").click().run()
    assert at.slider(key="wi_cost").value == 0.3
    assert at.slider(key="wi_alpha").value == 0.8  # not Exercise 2's 0.60: the exercise lowers α from here
    ex3 = [e for e in at.expander if e.label == "Show the answer (3)"][0]
    assert "α ≈ 0.30" in ex3.markdown[0].value


def test_batch_roofline_inputs():
    at = _tab(_app(), "When it does not help")
    m = _metrics(at)
    assert m["Slower than plain decoding from batch"] == "≈ 187"   # hand-computed in test_analytic
    # the red line and its label sit at B ≈ 187 on the log axis: plotly.js places a shape at the data
    # value and an annotation at its log10 (a label at x = 187 stretched the axis to 10^187)
    fig = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
               if json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("Speedup against batch"))
    (line,) = [s for s in fig["layout"]["shapes"] if s.get("line", {}).get("color") == "red"]
    (label,) = [a for a in fig["layout"]["annotations"] if "slowdown past" in a["text"]]
    assert fig["layout"]["xaxis"]["type"] == "log"
    assert line["x0"] == pytest.approx(187, abs=1) and 10 ** label["x"] == pytest.approx(line["x0"])
    at.selectbox(key="wi_hw").set_value("RTX 4090").run()
    assert at.number_input(key="wi_bw").value == 1008.0 and at.number_input(key="wi_bw").disabled
    at.selectbox(key="wi_hw").set_value("Custom").run()
    assert not at.number_input(key="wi_bw").disabled
    at.number_input(key="wi_bw").set_value(1000.0)
    at.number_input(key="wi_peak").set_value(100.0)
    at.number_input(key="wi_params_b").set_value(70.0)
    at.selectbox(key="wi_bytes").set_value("fp8 (1 byte)").run()
    # verify ridge: 1·100e12 / (2·1000e9·5) = 10 sequences; at 10 compute and memory time are equal, so
    # the first compute-bound batch is 11
    assert _metrics(at)["Verify pass compute-bound from batch"] == "11"
    at.select_slider(key="wi_max_batch").set_value(8).run()
    assert _metrics(at)["Slower than plain decoding from batch"] == "> 8"
    _no_bad_numbers(at)


def test_distribution_check_compares_the_two_rules_acceptance():
    """The toy's first-token p and q: Σ min(p, q) (the standard rule) against the Gumbel coupling's agreement, which
    lies between the paper's bound and it; the embedded model's measured numbers when a result is shipped."""
    at = _tab(_app(), "Distribution check")
    m = _metrics(at)
    std, gum = float(m["Standard rule: Σ min(p, q)"]), float(m["Gumbel coupling: P(picks agree)"])
    bound = float(m["Paper's bound (1 − TV)/(1 + TV)"])
    assert std == pytest.approx(5 / 6, abs=1e-3) and bound - 0.03 <= gum <= std + 0.03
    assert any("drafter-invariant" in c.value for c in at.caption) or any(
        "drafter-invariant" in md.value for md in at.markdown)


def test_toy_distribution_check_widgets():
    at = _tab(_app(), "Distribution check")
    m = _metrics(at)
    assert float(m["Acceptance rate (measured)"]) == pytest.approx(5 / 6, abs=0.03)
    assert "Σ min(p, q) = 0.833" in str(at.metric[[x.label for x in at.metric].index(
        "Acceptance rate (measured)")].delta)
    assert float(m["χ² p-value (first token vs p)"]) > 0.01
    at.slider(key="wi_toy_draft").set_value(8.0).run()            # draft = target → α = 1
    assert _metrics(at)["Acceptance rate (measured)"] == "1.000"
    at.slider(key="wi_toy_target").set_value(2.0).run()
    at.slider(key="wi_toy_gamma").set_value(2).run()
    at.selectbox(key="wi_toy_ctx").set_value("on").run()
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert "First token after “on”" in titles
    at.number_input(key="wi_toy_seed").set_value(3).run()
    at.select_slider(key="wi_toy_n").set_value(2000).run()
    assert not at.exception
    at.slider(key="wi_toy_target").set_value(8.0)
    at.slider(key="wi_toy_draft").set_value(4.0)
    at.radio(key="wi_toy_rule").set_value("Naive: accept every draft token").run()
    assert float(_metrics(at)["χ² p-value (first token vs p)"]) < 0.01
    assert at.warning and "naive rule" in at.warning[0].value
    _no_bad_numbers(at)


def test_measured_numbers_section():
    at = _tab(_app(), "My measured numbers")
    assert any("run the live page first" in i.value for i in at.info)
    at.session_state["measured_run"] = types.SimpleNamespace(
        acceptance_rate=0.75, draft_cost_ratio=0.1, gamma=3, verify_ms_by_tokens={1: 20.0, 4: 26.0},
        measured_speedup=1.7)
    at.run()
    m = _metrics(at)
    # E = 2.734375; simple 2.734375/1.3 = 2.10; with t(4)/t(1) = 1.3: 2.734375/1.6 = 1.71
    assert m["Predicted (simple formula)"] == "2.10×"
    assert m["Predicted (measured verify cost)"] == "1.71×"
    assert m["Measured"] == "1.70×"
    at.button(key="wi_btn_use_measured").click().run()
    assert (at.slider(key="wi_alpha").value, at.slider(key="wi_gamma").value,
            at.slider(key="wi_cost").value) == (0.75, 3, 0.1)
    # and the slope through the measured t(4)/t(1) = 1.3: (1.3 − 1)/3 = 0.1, so the analytic tab's
    # "with verify cost" equals the 1.71× above
    assert at.session_state["wi_slope"] == pytest.approx(0.1)
    at = _tab(at, "Analytic model")
    assert at.slider(key="wi_slope_w").value == pytest.approx(0.1)
    assert "1.71× with verify cost" in [m.delta for m in at.metric if m.label.startswith("Speedup E")][0]
    at = _tab(at, "My measured numbers")
    at.session_state["measured_run"] = types.SimpleNamespace(acceptance_rate=None)
    at.run()
    assert at.error and "run the live page first" in at.error[0].value
    assert not at.exception


def test_best_gamma_at_the_slider_limit_says_so():
    at = _app(wi_alpha=0.9, wi_gamma=8, wi_cost=0.02)
    best = next(m for m in at.metric if m.label == "Best γ at this α, c")
    assert best.value == "≥ 16  (6.31×)" and "γ = 19 (6.37×)" in best.help


def test_url_state_is_read_and_bad_values_fall_back():
    at = _app(wi_alpha=0.6, wi_gamma=99, wi_cost="abc", wi_hw="Nope")
    assert at.slider(key="wi_alpha").value == 0.6
    assert at.slider(key="wi_gamma").value == 16          # clamped
    assert at.slider(key="wi_cost").value == 0.05         # unparsable → default
    assert not at.exception


def test_only_the_open_tab_runs_and_tab_comes_from_the_url():
    at = _app()
    labels = [m.label for m in at.metric]
    assert "Tokens per target pass E" in labels and "Acceptance rate (measured)" not in labels
    at = _app(wi_tab="When it does not help", wi_hw="Nope")
    assert at.selectbox(key="wi_hw").value == "H100 SXM"      # unknown preset → default
    assert "Tokens per target pass E" not in [m.label for m in at.metric]
    assert "Speedup at batch 1" in [m.label for m in at.metric]


def test_quality_mistake_link_reproduces_the_mistakes_numbers():
    """The mistakes page's "Reproduce" link for the naive rule opens this page's check with the same toy
    settings, so the page shows the same total variation distance (it showed 0.1690 at 10 000 rounds
    against the mistakes page's 0.158 at 2 000)."""
    from engine.explain.teaching import MISTAKE_LINKS, quality_mistake

    at = _app(**MISTAKE_LINKS["quality"].params)
    assert not at.exception
    assert _metrics(at)["Total variation distance"] == f"{quality_mistake().tvd_naive:.4f}"


def test_gamma_chart_colours_do_not_move_with_alpha():
    """Each reference α keeps its colour and yours is always the same thick line, whatever α is (with
    the default colour cycle, moving α past 0.6 recoloured every curve)."""
    def colours(alpha):
        at = _app(wi_alpha=alpha, wi_gamma=4, wi_cost=0.1)
        fig = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                   if json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("Speedup against γ"))
        return {t["name"]: t["line"]["color"] for t in fig["data"] if t.get("mode") == "lines"}

    low, high = colours(0.55), colours(0.85)
    for name in ("α = 0.50", "α = 0.60", "α = 0.90", "yours, with verify cost"):
        assert low[name] == high[name], name
    assert low["α = 0.55 (yours)"] == high["α = 0.85 (yours)"]


def test_link_bandwidth_under_a_preset_is_named_as_the_presets():
    # a user's report: ?wi_bw=-5 was named "wi_bw=-5 → 1" while the page used the H100 preset's 3350
    at = _app(wi_bw="-5")
    msg = " ".join(t.value for t in at.toast)
    assert "wi_bw=-5 → 3350 (set by the H100 SXM preset)" in msg and "→ 1" not in msg
    assert at.session_state["wi_bw"] == 3350.0
    at = _app(wi_hw="Custom", wi_bw="-5")  # custom hardware: the link's value is used, clamped
    assert "wi_bw=-5 → 1" in " ".join(t.value for t in at.toast)


def test_best_gamma_says_none_when_speculation_never_pays():
    # a user's report: α = 0, c = 1 showed "Best γ: 1 (0.50×)", advice to run 2× slower
    at = _app(wi_alpha="0", wi_gamma="1", wi_cost="1")
    m = _metrics(at)
    assert m["Best γ at this α, c"] == "none: decode plainly"
    assert m["Break-even α"] == "never pays"

    def stars(at):
        specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
        return next(t for f in specs for t in f["data"] if t.get("name") == "best γ").get("x", [])

    assert list(stars(at)) == []  # no curve gains at c = 1: no star sits on the "no gain" line
    at = _app()
    assert _metrics(at)["Best γ at this α, c"] == "8  (3.09×)"  # the defaults are unchanged
    assert len(stars(at)) == 5  # the reference α's 0.5 … 0.9 (yours, 0.8, is one of them)


def test_unknown_tab_in_a_link_is_named():
    at = _app(wi_tab="Nope")
    assert "wi_tab=Nope → Analytic model" in " ".join(t.value for t in at.toast)


def test_measured_numbers_show_where_the_gap_comes_from():
    """The prediction from the run, one assumption at a time (engine.explain.analytic.predict_from_run; the
    values are hand-computed in tests/test_analytic.py::test_predict_from_run_steps_by_hand)."""
    from tests.test_analytic import _run_record

    at = _tab(_app(), "My measured numbers")
    at.session_state["measured_run"] = _run_record()
    at.run()
    assert not at.exception
    assert "Where the gap comes from" in [h.value for h in at.subheader]
    df = at.dataframe[0].value
    assert list(df["step"]) == ["Today's formula", "The run's draft lengths", "+ α̂ by draft position",
                                "+ prefill and bookkeeping"]
    assert list(df["speedup ×"].round(4)) == [round(x, 4) for x in (3.05078125 / 1.9, 2.025390625 / 1.45,
                                                                    2.0 / 1.45, 204 / 190)]
    assert df["off from measured %"].iloc[-1] == pytest.approx(100 * (204 / 190 / 1.5 - 1))
    assert any("included on both sides" in c.value for c in at.caption)
    summary = next(m.value for m in at.markdown if m.value.startswith("Assuming every round drafts"))
    assert "moves the prediction by +15%" in summary and "1.07× against 1.50× measured (-28.4%)" in summary
    _no_bad_numbers(at)
    # a run stored before Run baseline (no rounds profile): the old comparison, and what to press
    at.session_state["measured_run"] = types.SimpleNamespace(
        acceptance_rate=0.75, draft_cost_ratio=0.1, gamma=3, verify_ms_by_tokens={1: 20.0, 4: 26.0},
        measured_speedup=1.7)
    at.run()
    assert not at.dataframe and any("Run baseline" in c.value for c in at.caption)
    # a broken profile: a clear message, no traceback
    at.session_state["measured_run"] = _run_record(verify_tokens_counts={1: 2, 5: 3})
    at.run()
    assert not at.exception and any("count different rounds" in e.value for e in at.error)


def test_an_unsure_live_run_is_called_unsure_here_too():
    """A busy Live run (its record's ``unsure``): What-if says so first, and its out-of-range c is no red verdict."""
    at = _tab(_app(), "My measured numbers")
    at.session_state["measured_run"] = types.SimpleNamespace(
        acceptance_rate=0.6, draft_cost_ratio=2.59, gamma=1, verify_ms_by_tokens={1: 10.0, 2: 12.0},
        draft_ms_per_token=25.9, measured_speedup=1.59, spread=2.1,
        unsure=["the timed runs of one kind differed by up to 2.1×"])
    at.run()
    assert not at.exception and not at.error
    warnings = [w.value for w in at.warning]
    assert warnings[0].startswith("The Live run these numbers come from was **unsure**: the timed runs")
    assert any("Live run was unsure" in w and "2.59" in w for w in warnings)
    why = next(m.value for m in at.markdown if m.value.startswith("**Why, here**"))
    assert "Measured **1.59×**" in why and "unsure" in why
