"""Trade-offs page: one table comparing the speedups; every example number comes from
``engine.explain.teaching.trade_offs`` (which calls engine.explain.analytic / kv_size / flash / prefix_cache)."""

import streamlit as st

from app.navigation import page_link
from app.registry import available_pages
from app.tour import intro
from engine.explain.teaching import trade_offs

st.title("⚖️ Trade-offs")
intro(
    "Every speedup in this app removes a different kind of waste, and each one pays for it somewhere. "
    "The cards set them side by side; each **example** is computed by the engine for the setting it "
    "names, and each card opens the page that shows it.")


@st.cache_data(show_spinner=False)
def _rows():
    return trade_offs()


rows = _rows()
titles = {p.url_path: p.title for p in available_pages()}
# one card per speedup, so no column hides behind a horizontal scroll (on a projector too)
cols = st.columns(2)
for i, r in enumerate(rows):
    with cols[i % 2].container(border=True):
        st.markdown(f"**{r.technique}**")
        st.markdown(f"**Saves:** {r.saves}  \n**Costs:** {r.costs}  \n**Stops helping when:** "
                    f"{r.stops_helping}  \n**Changes outputs?** {r.changes_outputs}")
        st.markdown(f"**Example (engine):** {r.example}")
        st.caption(f"Source: {r.source}")
        page_link(r.link, f"Open: {titles.get(r.page, r.page)}")
with st.expander("The same comparison as one table (download as CSV from its toolbar)"):
    st.dataframe(
        [{"speedup": r.technique, "saves": r.saves, "costs": r.costs, "stops helping when": r.stops_helping,
          "changes outputs?": r.changes_outputs, "example (engine)": r.example,
          "page": titles.get(r.page, r.page), "source": r.source} for r in rows],
        hide_index=True, width="stretch",
        column_config={"speedup": st.column_config.TextColumn(pinned=True)})

st.markdown(
    "They combine: a server can cache prefixes, run FlashAttention kernels, serve a GQA model and "
    "speculate at small batch all at once, because each attacks a different cost: prefill, attention's "
    "memory traffic, KV-cache size, or the number of sequential decode steps.")
