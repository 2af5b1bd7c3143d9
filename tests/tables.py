"""Find a page's table in an AppTest by one of its column names: app.charts.show_table draws a grid
(st.dataframe) or, for a wide table or in presenter mode, a static table (st.table)."""

from __future__ import annotations

import pandas as pd


def find_table(at, column: str, nth: int = 0) -> pd.DataFrame:
    """The ``nth`` table (grid or static, in page order per kind: grids first) that has ``column``."""
    frames = [t.value for t in at.dataframe] + [t.value for t in at.table]
    hits = [f for f in frames if isinstance(f, pd.DataFrame) and column in f.columns]
    if len(hits) <= nth:
        raise AssertionError(f"no table with a column {column!r} (columns seen: "
                             f"{[list(f.columns) for f in frames if isinstance(f, pd.DataFrame)]})")
    return hits[nth]
