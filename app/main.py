"""Speedup Lab entry point: ``streamlit run app/main.py``.

Sets up the page config and Streamlit's multipage navigation over ``pages/``; the pages themselves
only read widgets, call ``engine``, and draw.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from app.navigation import finish_switch, pass_through_switch_entry  # noqa: E402
from app.registry import PAGES_DIR, available_pages  # noqa: E402
from app.state import begin_url_batch, flush_url, keep_page_state  # noqa: E402
from app.tour import init_modes, tour_banner  # noqa: E402

# ?present=1 (presenter mode) collapses the sidebar; the tour banner and presenter styling are drawn
# above whichever page runs (app/tour.py), so no page file needs to know about them.
present = init_modes()
st.set_page_config(page_title="Speedup Lab", page_icon="⚡", layout="wide",
                   initial_sidebar_state="collapsed" if present else "auto")

pages = [
    st.Page(str(PAGES_DIR / p.file), title=p.title, icon=p.icon, url_path=p.url_path,
            default=(p.file == "home.py"))
    for p in available_pages()
]
nav = st.navigation(pages)
# an address that names no page: Streamlit says so itself ("Page not found … Running the app's main page") and opens
# Home; the app adds no second message
keep_page_state()   # settings of the pages not shown in this run survive it
begin_url_batch(nav.url_path)   # the run's URL writes become one update (one browser-history entry)
try:
    pass_through_switch_entry(nav.url_path)  # Back/Forward onto the entry a page switch left behind
    tour_banner(nav.url_path)
    with st.sidebar:  # every page: the room's join card one click away (Home and the Race page show it too)
        if st.button("📱 Join card", key="sidebar_join", help="The app's address in large type and as a QR code."):
            from app.join import join_card

            join_card()
    finish_switch(nav.url_path)  # a tour/page button's switch that a quick second click swallowed
    nav.run()
finally:  # also after st.rerun(); pages stop through app.state.stop_page, which writes the URL first (nothing
    # sent after st.stop() reaches the browser)
    flush_url()
