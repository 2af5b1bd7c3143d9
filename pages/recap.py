"""Recap: the few ideas to remember, each linked to the page (and state) that shows it
(``engine.explain.teaching.recap``)."""

import streamlit as st

from app.navigation import page_link
from engine.explain.teaching import recap

st.title("✅ Recap")
st.markdown("Seven ideas to take away. Each link opens the page in a state that shows it.")


@st.cache_data(show_spinner=False)
def _items():
    return recap()


for i, item in enumerate(_items(), start=1):
    with st.container(border=True):
        st.markdown(f"**{i}.** {item.idea}")
        page_link(item.link, f"See it: {item.where}", icon=":material/arrow_forward:")
