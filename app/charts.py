"""Draw the pages' Plotly charts and tables: ``show_chart(fig, key=...)`` instead of ``st.plotly_chart``,
``show_table(rows)`` instead of ``st.dataframe``.

In presenter mode (``?present=1``) every chart's text is enlarged for a projector: text a page gave an
explicit size is scaled by ``PRESENTER_FONT_SCALE``, the rest is set to ``PRESENTER_CHART_FONT`` px.
Elsewhere the figure is drawn as the page built it.

Tables are interactive grids (``st.dataframe``: sort, search, CSV export), except in presenter mode:
a grid is drawn on a canvas that the presenter style sheet cannot enlarge (it stayed at 13 px beside
20 px text), so there the same rows become a static HTML table (``st.table``) in the large type.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app.tour import PRESENTER_CHART_FONT, PRESENTER_FONT_SCALE, presenting

# reference lines (break-even, E, α̂, the chosen batch): mid grey, seen on the light and the dark theme
# alike (plotly's default dark line vanished on the dark theme)
REFERENCE_LINE = "#888888"

_FONT_KEYS = {"font", "tickfont", "textfont", "insidetextfont", "outsidetextfont", "hoverlabel_font"}


def _scale_sizes(node: Any, scale: float, under_font: bool = False) -> Any:
    """Scale every ``size`` inside a font object of a figure's dict (recursively)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if under_font and k == "size" and isinstance(v, (int, float)):
                out[k] = round(v * scale, 1)
            elif under_font and k == "size" and isinstance(v, list):  # per-point sizes
                out[k] = [round(x * scale, 1) if isinstance(x, (int, float)) else x for x in v]
            else:
                out[k] = _scale_sizes(v, scale, k in _FONT_KEYS)
        return out
    if isinstance(node, list):
        return [_scale_sizes(x, scale, under_font) for x in node]
    return node


def presenter_figure(fig: go.Figure, base_px: float = PRESENTER_CHART_FONT,
                     scale: float = PRESENTER_FONT_SCALE) -> go.Figure:
    """A copy of ``fig`` with projector-sized text: explicit sizes × ``scale``, the rest ``base_px`` (px).

    Streamlit's chart theme sets each element's font size itself and ignores ``layout.font.size``, so
    every text element gets an explicit size: axis ticks and titles, the chart title, the legend,
    annotations, hover labels, trace text and colour bars. The input figure is not changed (a page may
    draw a cached figure more than once).
    """
    out = go.Figure(_scale_sizes(fig.to_plotly_json(), scale))

    def fill(font, px: float = base_px) -> None:
        if font.size is None:
            font.size = px

    lay = out.layout
    _ = lay.xaxis, lay.yaxis  # make sure the main axes exist, so the loops below reach them
    for ax in [*out.select_xaxes(), *out.select_yaxes()]:
        fill(ax.tickfont)
        fill(ax.title.font)
    fill(lay.title.font, base_px + 2)
    fill(lay.legend.font)
    fill(lay.hoverlabel.font)
    for a in lay.annotations:
        fill(a.font)
    for tr in out.data:
        if "textfont" in tr:
            fill(tr.textfont)
        if "colorbar" in tr:
            fill(tr.colorbar.tickfont)
            fill(tr.colorbar.title.font)
    return out


def log_ticks(lo: float, hi: float) -> dict[str, list]:
    """Tick values and labels at 1, 2, 5 × 10^k between lo and hi, for a log axis
    (``fig.update_xaxes(type="log", **log_ticks(1, 1024))``). Plotly's own log ticks label only the
    decades at full size and print the 2s and 5s between them in a small font, too small on a projector.

    Raises:
        ValueError: unless 0 < lo ≤ hi.
    """
    if not 0 < lo <= hi:
        raise ValueError(f"log ticks need 0 < lo ≤ hi, got {lo}, {hi}")
    vals = [m * 10.0 ** k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
            for m in (1, 2, 5)]
    vals = [v for v in vals if lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9)]
    return {"tickvals": vals, "ticktext": [f"{v:,.0f}" if v >= 1 else f"{v:g}" for v in vals]}


# Plotly's toolbar, trimmed to what these charts need (PNG download, box zoom, pan, reset): its default
# eight buttons were eight Tab stops per chart for a keyboard user, and covered chart titles on a phone
CHART_CONFIG = {"displaylogo": False,
                "modeBarButtonsToRemove": ["select2d", "lasso2d", "zoomIn2d", "zoomOut2d", "autoScale2d"]}


def show_chart(fig: go.Figure, key: str | None = None, where: Any = None) -> None:
    """Draw ``fig`` at full width in ``where`` (a column or container; the page by default)."""
    if presenting():
        fig = presenter_figure(fig)
    (where if where is not None else st).plotly_chart(fig, width="stretch", key=key, config=CHART_CONFIG)


def _cell(fmt: str | None):
    def f(v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return "" if v is None else str(v)
        if fmt:
            return fmt % v
        return f"{v:,}" if isinstance(v, int) else f"{v:,.6g}"
    return f


GRID_MAX_COLUMNS = 8  # wider tables are static: a grid of 10-11 columns hid its last ones at 1280 px


def show_table(data: Any, formats: dict[str, str] | None = None, where: Any = None) -> None:
    """Draw rows (a list of dicts or a dict of columns) without the index, full width.

    An interactive grid (sort, search, CSV export) up to ``GRID_MAX_COLUMNS`` columns; a wider table, or any
    table in presenter mode, is a static table whose headers and cells wrap, so every column stays on
    screen (the grid scrolled sideways with no visible scrollbar, and a reader missed the last columns).

    Args:
        formats: printf formats of numeric columns, e.g. {"q(x)": "%.4f"}; other numbers are shown as
            they are (up to 6 significant digits).
    """
    formats = formats or {}
    place = where if where is not None else st
    n_columns = len(data) if isinstance(data, dict) else len(data[0]) if data else 0
    if presenting() or n_columns > GRID_MAX_COLUMNS:
        df = pd.DataFrame(data)
        styler = df.style.hide(axis="index").format({c: _cell(formats.get(c)) for c in df.columns})
        place.table(styler)
    else:
        cfg = {c: st.column_config.NumberColumn(format=f) for c, f in formats.items()} or None
        place.dataframe(data, hide_index=True, width="stretch", column_config=cfg)
