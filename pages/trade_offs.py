"""Trade-offs page: one table comparing the speedups; every example number comes from
``engine.teaching.trade_offs`` (which calls engine.analytic / kv_size / flash / prefix_cache)."""

import streamlit as st

from app.registry import available_pages
from app.teaching import page_link
from engine.teaching import PageLink, trade_offs

st.title("⚖️ Trade-offs")
st.markdown(
    "Every speedup in this app removes a different kind of waste, and each one pays for it somewhere. "
    "The table sets them side by side; the **example** column is computed by the engine for the setting "
    "it names, and each row opens the page that shows it.")


@st.cache_data(show_spinner=False)
def _rows():
    return trade_offs()


rows = _rows()
titles = {p.url_path: p.title for p in available_pages()}
st.dataframe(
    [{"speedup": r.technique, "saves": r.saves, "costs": r.costs, "stops helping when": r.stops_helping,
      "changes outputs?": r.changes_outputs, "example (engine)": r.example,
      "page": titles.get(r.page, r.page), "source": r.source} for r in rows],
    hide_index=True, width="stretch", row_height=70,
    column_config={"speedup": st.column_config.TextColumn(width="medium", pinned=True),
                   "stops helping when": st.column_config.TextColumn(width="large"),
                   "example (engine)": st.column_config.TextColumn(width="large")})
st.caption("Use the table's toolbar (top right, on hover) to download it as CSV.")

st.subheader("Open the page behind each row")
cols = st.columns(3)
for i, r in enumerate(rows):
    with cols[i % 3]:
        page_link(PageLink(r.page), f"{r.technique} → {titles.get(r.page, r.page)}")
st.markdown(
    "They combine: a server can cache prefixes, run FlashAttention kernels, serve a GQA model and "
    "speculate at small batch all at once, because each attacks a different cost: prefill, attention's "
    "memory traffic, KV-cache size, or the number of sequential decode steps.")
