"""app.charts.presenter_figure: projector-sized chart text, every element given an explicit size
(Streamlit's chart theme ignores layout.font.size), the page's figure left as it was."""

import plotly.graph_objects as go
import pytest
from plotly.subplots import make_subplots

from app.charts import presenter_figure


def test_explicit_sizes_are_scaled_and_the_rest_filled():
    fig = make_subplots(rows=1, cols=2)
    fig.add_trace(go.Bar(x=["a"], y=[2], text=["2"], textfont={"size": 10}), 1, 1)
    fig.add_trace(go.Heatmap(z=[[1.0]], colorbar={"title": "×"}), 1, 2)
    fig.update_layout(title={"text": "t", "font": {"size": 13}})
    fig.add_annotation(x="a", y=2, text="no size")
    fig.add_annotation(x="a", y=1, text="sized", font={"size": 12})
    out = presenter_figure(fig, base_px=18, scale=1.5)
    # explicit: × 1.5 (13 → 19.5, 10 → 15, 12 → 18)
    assert out.layout.title.font.size == 19.5
    assert out.data[0].textfont.size == 15
    assert [a.font.size for a in out.layout.annotations] == [18, 18]
    # unset: the base size, on both subplots' axes, the colour bar and the legend
    for ax in ("xaxis", "xaxis2", "yaxis", "yaxis2"):
        assert out.layout[ax].tickfont.size == 18 and out.layout[ax].title.font.size == 18, ax
    assert out.data[1].colorbar.tickfont.size == 18 and out.data[1].colorbar.title.font.size == 18
    assert out.layout.legend.font.size == 18
    # the input is unchanged (a cached figure drawn twice must not grow twice)
    assert fig.layout.title.font.size == 13 and fig.data[0].textfont.size == 10
    assert fig.layout.xaxis.tickfont.size is None


def test_per_point_sizes_are_scaled():
    fig = go.Figure(go.Scatter(x=[1, 2], y=[1, 2], mode="text", text=["a", "b"], textfont={"size": [10, 20]}))
    assert list(presenter_figure(fig, scale=2.0).data[0].textfont.size) == [20, 40]


def test_tables_are_grids_and_in_presenter_mode_large_html_tables():
    from streamlit.testing.v1 import AppTest

    def page():
        import streamlit as st

        from app.charts import show_table

        st.session_state.setdefault("present", False)
        show_table([{"token": "a", "q(x)": 0.123456, "n": 12345}], formats={"q(x)": "%.4f"})

    at = AppTest.from_function(page).run()
    assert len(at.dataframe) == 1 and not at.table  # the interactive grid (sort, CSV export)
    at.session_state["present"] = True
    at.run()
    assert len(at.table) == 1 and not at.dataframe  # HTML, which the presenter type enlarges
    shown = str(at.table[0].proto)  # the Styler's display values travel with the table
    assert "0.1235" in shown and "12,345" in shown


def test_log_ticks_one_two_five():
    from app.charts import log_ticks

    # 1..1024: 1, 2, 5 in each decade up to 1000 (2000 > 1024 is left out)
    t = log_ticks(1, 1024)
    assert t["tickvals"] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert t["ticktext"][-1] == "1,000"
    # 0.03..0.4 ms: 0.05, 0.1, 0.2 (0.02 < lo and 0.5 > hi are left out)
    t = log_ticks(0.03, 0.4)
    assert t["ticktext"] == ["0.05", "0.1", "0.2"]
    with pytest.raises(ValueError):
        log_ticks(0, 10)


def test_wide_tables_are_static_so_every_column_shows():
    """A user's report: an 11-column grid hid its last columns at 1280 px (no visible scrollbar)."""
    from streamlit.testing.v1 import AppTest

    def page():
        import streamlit as st

        from app.charts import GRID_MAX_COLUMNS, show_table

        st.session_state.setdefault("present", False)
        show_table([{f"c{i}": i for i in range(GRID_MAX_COLUMNS)}])
        show_table([{f"c{i}": i for i in range(GRID_MAX_COLUMNS + 1)}])

    at = AppTest.from_function(page).run()
    assert len(at.dataframe) == 1 and len(at.table) == 1
    assert len(at.dataframe[0].value.columns) == 8 and len(at.table[0].value.columns) == 9
