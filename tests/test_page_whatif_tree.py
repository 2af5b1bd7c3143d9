"""AppTest for the What-if page's Token trees tab: its settings in the URL, numbers from
engine.explain.analytic (hand-computed where short), the verify-cost curve choices, bad link values."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.decoding.pass_cost import current_pass_cost
from engine.explain.analytic import tree_size_curve

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "whatif.py")
TAB = "Token trees"


def _app(**query) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    at.query_params["wi_tab"] = TAB
    for k, v in query.items():
        at.query_params[k] = str(v)
    at.run()
    assert not at.exception, at.exception
    return at


def _metrics(at) -> dict[str, object]:
    return {m.label: m for m in at.metric}


def _no_bad_numbers(at) -> None:
    texts = [m.value for m in at.metric] + [str(m.delta) for m in at.metric] + [c.value for c in at.caption]
    for t in texts:
        assert not re.search(r"\bnan\b|\binf\b", t, re.IGNORECASE), t


def test_defaults_come_from_the_engine():
    at = _app()
    m = _metrics(at)
    # α 0.80, c 0.05 (the page's sliders), σ 0.27, δ 1, branching 3, depth 6, this CPU's curve
    curve = current_pass_cost("embedded")  # this machine's measured curve, else the shipped one (labelled)
    cur = tree_size_curve([0.8] * 6, 0.27, 3, 6, 0.05, 64, 0.05, curve.ms)
    assert m["Tokens per pass, best tree of 8"].value == f"{cur.tokens[7]:.2f}"
    assert m["Speedup at N = 8"].value == f"{cur.speedups[7]:.2f}×"
    assert m["Best tree size"].value == f"N = {cur.best_n} ({cur.best_speedup:.2f}×)"
    flat = tree_size_curve([0.8] * 6, 0.27, 3, 6, 0.05, 64, 0.0)
    assert m["Best with a flat pass (s = 0)"].value == f"N = {flat.best_n} ({flat.best_speedup:.2f}×)"
    # the pass over N + 1 = 9 tokens, t(9)/t(1) from the same curve
    assert m["Speedup at N = 8"].delta == f"pass over 9 tokens = {curve.ratio(9):.2f} decode steps"
    assert any("extended linearly" in c.value and curve.source in c.value for c in at.caption)
    _no_bad_numbers(at)
    charts = {json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")}
    assert {"Speedup against tree size N (★ best)", "What a tree gains and what its pass costs",
            "The best tree of 8 nodes (label: P(path accepted))"} <= charts


def test_a_chain_matches_the_closed_form():
    # branching 1, N = 4 ≤ depth: the chain's 1 + 0.8 + 0.64 + 0.512 + 0.4096 = 3.3616
    at = _app(wi_tree_branch=1, wi_tree_n=4, wi_tree_curve="slope", wi_slope=0.1)
    m = _metrics(at)
    assert m["Tokens per pass, best tree of 4"].value == "3.36"
    assert m["Tokens per pass, best tree of 4"].delta == "chain of 4 (depth 4): 3.36"
    # speedup 3.3616 / (0.05 · 4 + 1 + 0.1 · 4) = 2.10
    assert m["Speedup at N = 4"].value == "2.10×"
    assert not any("no deeper than D" in c.value for c in at.caption)  # D = 6 ≥ N = 4: nothing to explain


def test_a_tree_below_the_chain_says_why():
    # defaults: the best tree of 8 is held to depth D = 6, the chain of 8 reaches depth 8
    at = _app()
    m = _metrics(at)
    tree = float(m["Tokens per pass, best tree of 8"].value)
    chain = float(str(m["Tokens per pass, best tree of 8"].delta).rsplit(": ", 1)[1])
    assert tree < chain
    assert any("no deeper than D = 6" in c.value and "depth 8" in c.value for c in at.caption)
    # with D = 8 the tree of 8 can be the chain: no fewer tokens, no sentence
    at = _app(wi_tree_depth=8)
    m = _metrics(at)
    assert float(m["Tokens per pass, best tree of 8"].value) >= float(
        str(m["Tokens per pass, best tree of 8"].delta).rsplit(": ", 1)[1])
    assert not any("no deeper than D" in c.value for c in at.caption)


def test_widgets_write_the_url_and_move_the_numbers():
    at = _app()
    before = _metrics(at)["Tokens per pass, best tree of 8"].value
    at.slider(key="wi_tree_sib").set_value(0.6).run()
    at.slider(key="wi_tree_decay").set_value(0.9).run()
    at.slider(key="wi_tree_branch").set_value(4).run()
    at.slider(key="wi_tree_n").set_value(16).run()
    at.slider(key="wi_tree_depth").set_value(4).run()
    at.radio(key="wi_tree_curve").set_value("slope").run()
    assert not at.exception
    q = {k: at.query_params[k] for k in at.query_params}
    assert (q["wi_tree_sib"], q["wi_tree_decay"], q["wi_tree_branch"], q["wi_tree_n"], q["wi_tree_depth"],
            q["wi_tree_curve"]) == ("0.6", "0.9", "4", "16", "4", "slope")
    cur = tree_size_curve([0.8 * 0.9 ** d for d in range(4)], 0.6, 4, 4, 0.05, 64, 0.05)
    m = _metrics(at)
    assert m["Tokens per pass, best tree of 16"].value == f"{cur.tokens[15]:.2f}" != before


def test_live_run_curve_and_its_fallback():
    at = _app(wi_tree_curve="live")
    assert any("No usable Live run yet" in i.value for i in at.info)
    at.session_state["measured_run"] = types.SimpleNamespace(verify_ms_by_tokens={1: 20.0, 3: 24.0, 5: 30.0})
    at.run()
    assert not at.info and any("your Live run" in c.value for c in at.caption)
    # t(9)/t(1) = (30 + 3·4)/20 = 2.1 (extended from 3 → 5)
    assert _metrics(at)["Speedup at N = 8"].delta == "pass over 9 tokens = 2.10 decode steps"


def test_bad_link_values_are_replaced_and_named():
    at = _app(wi_tree_sib=7, wi_tree_branch=0, wi_tree_n="x", wi_tree_curve="gpu", wi_tree_depth=99)
    assert at.slider(key="wi_tree_sib").value == 1.0 and at.slider(key="wi_tree_branch").value == 1
    assert at.slider(key="wi_tree_n").value == 8 and at.radio(key="wi_tree_curve").value == "cpu"
    assert at.slider(key="wi_tree_depth").value == 16
    note = " ".join(t.value for t in at.toast)
    assert "wi_tree_sib=7 → 1" in note and "wi_tree_curve=gpu → cpu" in note
    _no_bad_numbers(at)


def test_the_shipped_heads_measured_values_button():
    at = _app(wi_tree_branch=2)
    at.button(key="wi_btn_tree_head").click().run()
    assert not at.exception
    # HEAD_RANK_COUNTS: α̂_1 = 469/732 = 0.64; σ̂ on rank 2 = 349/1282 = 0.27; δ̂ from α̂_2..4 / α̂_1 ≈ 0.92
    assert at.slider(key="wi_alpha").value == 0.64
    assert at.slider(key="wi_tree_sib").value == 0.27
    assert at.slider(key="wi_tree_decay").value == 0.92
    assert at.query_params["wi_alpha"] == "0.64"


@pytest.mark.parametrize("alpha,cost", [(0.0, 0.0), (1.0, 1.0), (0.0, 1.0), (1.0, 0.0)])
def test_extremes_stay_finite(alpha, cost):
    at = _app(wi_alpha=alpha, wi_cost=cost, wi_tree_n=64, wi_tree_branch=8)
    _no_bad_numbers(at)


def test_the_tab_says_what_a_real_tree_pass_costs_here():
    """The verify-cost curve is a chain's; a caption gives the tree benchmark's measured tree and chain passes."""
    from engine.explain.measured import tree_pass_costs

    at = _app()
    tp = tree_pass_costs()
    first = tp["rows"][0]
    assert any("Measured: over" in c.value and f"{first[2]:.1f} ms against the chain's "
               f"{first[1]:.1f}" in c.value for c in at.caption)
