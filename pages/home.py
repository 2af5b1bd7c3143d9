"""Home page: what Speedup Lab is and what each page shows."""

import streamlit as st

from app.registry import PAGES_DIR, available_pages

st.title("⚡ Speedup Lab")
st.markdown(
    "An interactive explainer of **speculative decoding** and other LLM inference speedups, built "
    "around a real speculative decoding engine running a real model (SmolLM2-135M-Instruct, embedded). "
    "Every number on these pages is computed or measured by the engine."
)
for p in available_pages():
    if p.file == "home.py":
        continue
    st.page_link(str(PAGES_DIR / p.file), label=f"**{p.title}** — {p.summary}", icon=p.icon)

st.divider()
from app.tour import start_tour_button  # noqa: E402

start_tour_button()
