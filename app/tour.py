"""The guided tour and presenter mode, drawn by app/main.py around whichever page runs.

* ``?present=1`` in the URL → presenter mode: larger fonts, sidebar collapsed, the tour's stepping
  buttons large. ``?present=0`` leaves it. It sticks for the session and travels with every link.
* ``?tour=i`` → the tour at stop i (0-based). The tour banner sits above every page while the tour is
  on; Next/Previous open the next stop's page with its settings; Leave ends it.

So ``/whatif?present=1&tour=1&wi_alpha=0.6&...`` opens the app in presenter mode, on the what-if page,
in that state, at tour stop 2.
"""

from __future__ import annotations

import streamlit as st

from app.teaching import goto, page_file
from engine.teaching import PageLink, tour_stops

TOUR_KEY = "tour_stop"
PRESENT_KEY = "present"

# A fixed style sheet (no user or model text): larger type for a projector.
_PRESENTER_CSS = """<style>
[data-testid="stMainBlockContainer"] { font-size: 1.3rem; max-width: 96rem; padding-top: 4rem; }
[data-testid="stMainBlockContainer"] p, [data-testid="stMainBlockContainer"] li,
[data-testid="stMainBlockContainer"] label, [data-testid="stMainBlockContainer"] td,
[data-testid="stMainBlockContainer"] th { font-size: 1.3rem !important; }
[data-testid="stMainBlockContainer"] h1 { font-size: 2.8rem !important; padding-top: 0.5rem; }
[data-testid="stMainBlockContainer"] h2 { font-size: 2.4rem !important; }
[data-testid="stMainBlockContainer"] h3 { font-size: 1.9rem !important; }
[data-testid="stMetricValue"], [data-testid="stMetricValue"] p,
[data-testid="stMetricValue"] div { font-size: 2.6rem !important; }
[data-testid="stMainBlockContainer"] button p { font-size: 1.3rem !important; }
[data-testid="stMainBlockContainer"] [data-testid="stCaptionContainer"] p { font-size: 1.1rem !important; }
[data-testid="stMainBlockContainer"] input, [data-testid="stMainBlockContainer"] textarea,
[data-testid="stMainBlockContainer"] [data-baseweb="select"] div { font-size: 1.15rem !important; }
[data-testid="stMainBlockContainer"] [data-testid="stSliderThumbValue"],
[data-testid="stMainBlockContainer"] [data-testid="stMetricDelta"] div { font-size: 1.15rem !important; }
</style>"""
PRESENTER_CHART_FONT = 17  # px: Plotly's base font on a projector (its default is 12)
PRESENTER_FONT_SCALE = PRESENTER_CHART_FONT / 12  # for chart text given an explicit size


@st.cache_data(show_spinner=False)
def _stops():
    return tour_stops()


def presenting() -> bool:
    """Whether presenter mode is on in this session."""
    return bool(st.session_state.get(PRESENT_KEY))


def intro(markdown: str) -> None:
    """A page's opening paragraph (fixed text: no user or model text). In presenter mode it folds into an
    "About this page" expander, so the page's controls and visuals fit the projector's first screen;
    the presenter says the words."""
    if presenting():
        with st.expander("About this page"):
            st.markdown(markdown)
    else:
        st.markdown(markdown)


def _flag(raw: str | None) -> bool:
    return str(raw).lower() in ("1", "true", "yes", "on")


def init_modes() -> bool:
    """Read ``present`` and ``tour`` from the URL into the session (call before ``st.set_page_config``).

    Returns:
        whether presenter mode is on.
    """
    qp = st.query_params
    if PRESENT_KEY in qp:
        st.session_state[PRESENT_KEY] = _flag(qp[PRESENT_KEY])
    if "tour" in qp:
        try:
            i = int(qp["tour"])
        except ValueError:
            i = -1
        n = len(_stops())
        st.session_state[TOUR_KEY] = min(max(i, 0), n - 1) if i >= 0 else None
    return bool(st.session_state.get(PRESENT_KEY))


def _keep_modes_in_url() -> None:
    """Page navigation clears the query string; put the modes back so the URL reproduces the view."""
    if st.session_state.get(PRESENT_KEY):
        if st.query_params.get(PRESENT_KEY) != "1":
            st.query_params[PRESENT_KEY] = "1"
    elif PRESENT_KEY in st.query_params and st.query_params.get(PRESENT_KEY) == "1":
        del st.query_params[PRESENT_KEY]
    stop = st.session_state.get(TOUR_KEY)
    if stop is not None:
        if st.query_params.get("tour") != str(stop):
            st.query_params["tour"] = str(stop)
    elif "tour" in st.query_params:
        del st.query_params["tour"]


def go_to_stop(i: int) -> None:
    """Move the tour to stop ``i`` and open its page in the stop's state."""
    stops = _stops()
    i = min(max(i, 0), len(stops) - 1)
    st.session_state[TOUR_KEY] = i
    goto(stops[i].link, stops[i].clear)


def leave_tour() -> None:
    st.session_state[TOUR_KEY] = None
    if "tour" in st.query_params:
        del st.query_params["tour"]


def start_tour_button() -> None:
    """The home page's entry to the tour (and to presenter mode)."""
    c1, c2 = st.columns([1, 1])
    if c1.button("▶ Start the guided tour", type="primary", key="tour_start", width="stretch"):
        go_to_stop(0)
    # an action, not a status: "Presenter mode on" read as if it already were
    c2.button("Leave presenter mode" if st.session_state.get(PRESENT_KEY) else "Switch to presenter mode",
              key="present_toggle",
              width="stretch", help="Larger fonts and a hidden sidebar; or add ?present=1 to any page's URL.",
              on_click=_toggle_presenter)


def _toggle_presenter() -> None:
    """Button callback: runs before the next script run, so the styling follows at once, without an
    ``st.rerun()`` after the click. The URL changes too: ``init_modes`` reads it on every run."""
    on = not st.session_state.get(PRESENT_KEY)
    st.session_state[PRESENT_KEY] = on
    if on:
        st.query_params[PRESENT_KEY] = "1"
    elif PRESENT_KEY in st.query_params:
        del st.query_params[PRESENT_KEY]


def tour_banner() -> None:
    """Presenter styling and, while the tour is on, its banner: where we are, what to look at, and
    Previous / Next / Leave. Call from app/main.py after ``st.navigation`` and before ``.run()``."""
    _keep_modes_in_url()
    if st.session_state.get(PRESENT_KEY):
        st.html(_PRESENTER_CSS)
    i = st.session_state.get(TOUR_KEY)
    if i is None:
        return
    stops = _stops()
    stop = stops[i]
    with st.container(border=True, key="tour_banner"):
        # the title and the stepping buttons share a row, so the stop's page starts higher on the screen
        t, c1, c2, c3 = st.columns([3.4, 1.6, 1.5, 1.5], vertical_alignment="center")
        t.markdown(f"**Guided tour · stop {i + 1} of {len(stops)}: {stop.title}**")
        if c1.button("◀ Previous", key="tour_prev", disabled=i == 0, width="stretch", shortcut="Shift+Left"):
            go_to_stop(i - 1)
        last = i == len(stops) - 1
        if c2.button("Finish" if last else "Next ▶", key="tour_next", type="primary", width="stretch",
                     shortcut="Shift+Right"):
            if last:
                leave_tour()
                if page_file("recap"):
                    goto(PageLink("recap"))
                st.rerun()
            else:
                go_to_stop(i + 1)
        c3.button("✕ Leave tour", key="tour_leave", width="stretch", on_click=leave_tour)
        st.markdown(stop.text)
