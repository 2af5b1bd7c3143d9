"""AppTest for the What-if page's Sequential vs parallel drafting tab: numbers from engine.explain.drafting
(hand-computed where short), its settings in the URL, the measured points of block.json (a fixture), a missing
or malformed file, bad link values."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.decoding.pass_cost import current_pass_cost
from engine.explain import drafting
from engine.explain.drafting import BlockCost, drafting_curves

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "whatif.py")
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "block" / "block.json"
TAB = "Sequential vs parallel drafting"


@pytest.fixture
def no_results(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEEDUP_LAB_BLOCK_RESULTS", raising=False)
    monkeypatch.setattr(drafting, "BLOCK_RESULTS", tmp_path / "block.json")


@pytest.fixture
def results(tmp_path, monkeypatch):
    path = tmp_path / "block.json"
    shutil.copy(FIXTURE, path)
    monkeypatch.delenv("SPEEDUP_LAB_BLOCK_RESULTS", raising=False)
    monkeypatch.setattr(drafting, "BLOCK_RESULTS", path)
    return path


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


def _charts(at) -> dict[str, dict]:
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    return {s["layout"]["title"]["text"]: s for s in specs}


def _no_bad_numbers(at) -> None:
    texts = [m.value for m in at.metric] + [str(m.delta) for m in at.metric] + [c.value for c in at.caption]
    for t in texts:
        assert not re.search(r"\bnan\b|\binf\b", t, re.IGNORECASE), t


def test_defaults_come_from_the_engine(no_results):
    at = _app()
    m = _metrics(at)
    # α 0.80, γ 4, c 0.05 (the page's sliders); δ_block 0.9, δ_seq 1, c_block = 0.10 flat; this CPU's curve
    curve = current_pass_cost("embedded")
    cur = drafting_curves(0.8, 0.05, BlockCost.constant(0.1), 0.9, 1.0, 0.05, curve.ms)
    assert m["Sequential, γ = 4"].value == f"{cur.seq_speedup[3]:.2f}×"
    assert m["Block B = 5, γ = 4"].value == f"{cur.block_speedup[3]:.2f}×"
    assert m["Block + confidence cut (oracle)"].value == f"{cur.cut_speedup[3]:.2f}×"
    assert m["Best γ: sequential"].value == f"γ = {cur.best_seq[0]} ({cur.best_seq[1]:.2f}×)"
    assert m["Sequential, γ = 4"].delta == f"E 3.36 ÷ (4·c + {curve.ratio(5):.2f})"
    assert {"Speedup against γ (★ best)", "What a round costs (target decode steps)",
            "Acceptance by draft position j"} <= set(_charts(at))
    assert any("run benchmarks/bench_block.py to put measured points here" in c.value for c in at.caption)
    assert any(curve.source in c.value for c in at.caption)
    _no_bad_numbers(at)


def test_the_briefs_example_by_hand(no_results):
    # α 0.8, γ 3, c 0.1, flat verify (slope 0), no block decay, c_block 0.1:
    # E = 2.952; sequential 2.952/1.3 = 2.27×, block 2.952/1.1 = 2.68×, the cut equals the block (flat verify)
    at = _app(wi_alpha=0.8, wi_gamma=3, wi_cost=0.1, wi_slope=0, wi_block_curve="slope", wi_block_decay=1)
    m = _metrics(at)
    assert m["Sequential, γ = 3"].value == "2.27×"
    assert m["Sequential, γ = 3"].delta == "E 2.95 ÷ (3·c + 1.00)"
    assert m["Block B = 4, γ = 3"].value == "2.68×"
    assert m["Block B = 4, γ = 3"].delta == "E 2.95 ÷ (0.10 + 1.00)"
    assert m["Block + confidence cut (oracle)"].value == "2.68×"


def test_widgets_write_the_url_and_move_the_numbers(no_results):
    at = _app(wi_block_curve="slope")
    before = _metrics(at)["Block B = 5, γ = 4"].value
    at.slider(key="wi_block_decay").set_value(0.7).run()
    at.slider(key="wi_block_seq_decay").set_value(0.95).run()
    at.radio(key="wi_block_cmodel").set_value("linear").run()
    at.slider(key="wi_block_c0").set_value(0.2).run()
    at.slider(key="wi_block_c1").set_value(0.01).run()
    assert not at.exception
    q = {k: at.query_params[k] for k in at.query_params}
    assert (q["wi_block_decay"], q["wi_block_seq_decay"], q["wi_block_cmodel"], q["wi_block_c0"], q["wi_block_c1"],
            q["wi_block_curve"]) == ("0.7", "0.95", "linear", "0.2", "0.01", "slope")
    cur = drafting_curves(0.8, 0.05, BlockCost.linear(0.2, 0.01), 0.7, 0.95, 0.05)
    m = _metrics(at)
    assert m["Block B = 5, γ = 4"].value == f"{cur.block_speedup[3]:.2f}×" != before
    assert m["Sequential, γ = 4"].value == f"{cur.seq_speedup[3]:.2f}×"
    # the link reopens the same state
    again = _app(**q)
    assert _metrics(again)["Block B = 5, γ = 4"].value == m["Block B = 5, γ = 4"].value
    assert again.radio(key="wi_block_cmodel").value == "linear" and again.slider(key="wi_block_c1").value == 0.01


def test_measured_points_and_measured_block_cost(results):
    at = _app(wi_gamma=3, wi_block_cmodel="measured", wi_block_curve="slope")
    spec = _charts(at)["Speedup against γ (★ best)"]
    points = {t["name"]: (t["x"], t["y"]) for t in spec["data"] if t["name"].startswith("measured: ")}
    assert points == {"measured: block chain B=8": ([7], [1.5]), "measured: EAGLE-style head γ=3": ([3], [1.4]),
                      "measured: Medusa heads": ([4], [1.3])}
    assert any("measured on Test CPU 9000, onednn kernels" in c.value for c in at.caption)
    # c_block(4) = 0.06 from the fixture's block_pass; verify t(4)/t(1) = 1 + 0.05·3 = 1.15;
    # α_j = 0.8, 0.72, 0.648 (δ 0.9): E = 1 + 0.8 + 0.576 + 0.373248 = 2.749
    assert _metrics(at)["Block B = 4, γ = 3"].delta == "E 2.75 ÷ (0.06 + 1.15)"
    assert _metrics(at)["Block B = 4, γ = 3"].value == f"{2.749248 / 1.21:.2f}×"
    assert any("measured c_block(B): B=4: 0.06" in c.value and "another machine" in c.value for c in at.caption)
    assert at.slider(key="wi_block_c0").disabled
    assert len(at.dataframe) == 1


def test_measured_cost_without_a_file_falls_back(no_results):
    at = _app(wi_block_cmodel="measured")
    assert any("No measured block passes yet" in i.value for i in at.info)
    assert any("c_block(B) = 0.1 at any B" in c.value for c in at.caption)


def test_a_malformed_file_is_one_clear_error(results):
    d = json.loads(results.read_text())
    del d["machine"]["cpu"]
    results.write_text(json.dumps(d))
    at = _app()
    assert any("The measured points could not be read" in e.value and "lacks \"cpu\"" in e.value for e in at.error)
    assert _metrics(at)["Block B = 5, γ = 4"].value.endswith("×")


def test_bad_link_values_are_replaced_and_named(no_results):
    at = _app(wi_block_decay=7, wi_block_cmodel="gpu", wi_block_c1="x", wi_block_curve="live")
    assert at.slider(key="wi_block_decay").value == 1.0 and at.radio(key="wi_block_cmodel").value == "flat"
    assert at.slider(key="wi_block_c1").value == 0.005 and at.radio(key="wi_block_curve").value == "cpu"
    note = " ".join(t.value for t in at.toast)
    assert "wi_block_decay=7 → 1" in note and "wi_block_cmodel=gpu → flat" in note
    _no_bad_numbers(at)


@pytest.mark.parametrize("alpha,cost,decay", [(0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (1.0, 0.0, 0.0), (0.0, 1.0, 1.0)])
def test_extremes_stay_finite(no_results, alpha, cost, decay):
    at = _app(wi_alpha=alpha, wi_cost=cost, wi_block_decay=decay, wi_block_seq_decay=decay, wi_gamma=16)
    _no_bad_numbers(at)


def test_the_flat_verify_button(no_results):
    at = _app(wi_slope=0.3)
    at.button(key="wi_btn_block_flat").click().run()
    assert not at.exception
    assert at.query_params["wi_block_curve"] == "slope" and at.query_params["wi_slope"] == "0"
    cur = drafting_curves(0.8, 0.05, BlockCost.constant(0.1), 0.9, 1.0, 0.0)
    m = _metrics(at)
    assert m["Block B = 5, γ = 4"].value == f"{cur.block_speedup[3]:.2f}×"
    assert m["Sequential, γ = 4"].delta == "E 3.36 ÷ (4·c + 1.00)"
    # a flat verify: the oracle cut saves nothing
    assert m["Block + confidence cut (oracle)"].value == m["Block B = 5, γ = 4"].value


def test_measured_rows_of_one_kind_have_their_own_symbols():
    """The shipped results have several block rows (chains of B = 4, 8, 16, a cut, a tree): each measured point gets
    its own valid plotly symbol, so the legend tells them apart (they were identical grey diamonds)."""
    import plotly.graph_objects as go

    at = _app(wi_gamma=3)
    spec = _charts(at)["Speedup against γ (★ best)"]
    symbols = [t["marker"]["symbol"] for t in spec["data"] if t["name"].startswith("measured: ")]
    assert len(symbols) >= 5 and len(set(symbols)) == len(symbols), symbols
    for s in symbols:
        go.Scatter(marker={"symbol": s})  # ValueError for a name plotly does not draw
