"""Home page: what Speedup Lab is and what each page shows."""

import streamlit as st

from app.registry import PAGES_DIR, available_pages
from app.join import join_card
from app.tour import start_tour_button

st.title("⚡ Speedup Lab")
st.markdown(
    "An interactive explainer of **speculative decoding** and other LLM inference speedups, built "
    "around a real speculative decoding engine running a real model (SmolLM2-135M-Instruct, embedded). "
    "Every number on these pages is computed or measured by the engine."
)
# the tour and presenter mode first: on a projector at 1280×720 the page list below filled the screen and hid them
start_tour_button()
if st.button("📱 Join card: the app's address and a QR code for the room", key="home_join"):
    join_card()
st.divider()
for p in available_pages():
    if p.file == "home.py":
        continue
    st.page_link(str(PAGES_DIR / p.file), label=f"**{p.title}** — {p.summary}", icon=p.icon)
