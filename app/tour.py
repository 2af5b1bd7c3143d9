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

from app.navigation import goto, page_file, passed_back_through_a_switch
from app.state import is_history_navigation, note_replaced, stage_url, url_leads
from engine.explain.teaching import PageLink, tour_stops

TOUR_KEY = "tour_stop"
PRESENT_KEY = "present"
_LINK_CHECKED = "tour_link_checked"

# A fixed style sheet (no user or model text), on every page: metric values and button labels wrap
# instead of being cut with "…" when columns are narrow (a tablet, or a small laptop with the sidebar
# open showed "22.5 …", "3,113,3…", "Step… N"), and metric values shrink a little on narrow screens.
_BASE_CSS = """<style>
[data-testid="stMetricValue"] { font-size: clamp(1.5rem, 2.6vw, 2.25rem); }
[data-testid="stMetricValue"] *, [data-testid="stMetricDelta"] *, [data-testid="stMetricLabel"] *,
[data-testid="stMainBlockContainer"] button *,
[data-testid="stMainBlockContainer"] [data-testid="stPageLink-NavLink"] * { white-space: normal !important; overflow: visible !important;
  text-overflow: clip !important; }
[data-testid="stMetricValue"] *, [data-testid="stMetricLabel"] * { overflow-wrap: anywhere; }
/* tab bars wrap onto a second line instead of scrolling out of sight (What-if's seven tabs ended in "Sequen" at
   1280 px in presenter mode) */
[data-testid="stTabs"] [role="tablist"] { flex-wrap: wrap; overflow-x: visible !important; row-gap: 0.25rem; }
</style>"""

# A fixed style sheet (no user or model text): larger type for a projector.
_PRESENTER_CSS = """<style>
[data-testid="stMain"] { --sl-text: 1.3rem; --sl-small: 1.15rem; --sl-metric: 2.6rem; }
/* with the sidebar open the page is ~300 px narrower: the usual type, so labels are not cut off */
[data-testid="stAppViewContainer"]:has([data-testid="stSidebar"][data-collapsed="false"]) [data-testid="stMain"] {
  --sl-text: 1rem; --sl-small: 0.9rem; --sl-metric: 2rem; }
[data-testid="stMainBlockContainer"] { font-size: var(--sl-text); max-width: 96rem; padding-top: 4rem; }
[data-testid="stMainBlockContainer"] p, [data-testid="stMainBlockContainer"] li,
[data-testid="stMainBlockContainer"] label, [data-testid="stMainBlockContainer"] td,
[data-testid="stMainBlockContainer"] th { font-size: var(--sl-text) !important; }
[data-testid="stMainBlockContainer"] h1 { font-size: 2.8rem !important; padding-top: 0.5rem; }
[data-testid="stMainBlockContainer"] h2 { font-size: 2.4rem !important; }
[data-testid="stMainBlockContainer"] h3 { font-size: 1.9rem !important; }
[data-testid="stMetricValue"], [data-testid="stMetricValue"] p,
[data-testid="stMetricValue"] div { font-size: var(--sl-metric) !important; }
[data-testid="stMainBlockContainer"] button p { font-size: var(--sl-text) !important; }
[data-testid="stMainBlockContainer"] [data-testid="stCaptionContainer"] p { font-size: var(--sl-small) !important; }
[data-testid="stMainBlockContainer"] input, [data-testid="stMainBlockContainer"] textarea,
[data-testid="stMainBlockContainer"] [data-baseweb="select"] div { font-size: var(--sl-small) !important; }
[data-testid="stMainBlockContainer"] [data-testid="stSliderThumbValue"],
[data-testid="stMainBlockContainer"] [data-testid="stMetricDelta"] div { font-size: var(--sl-small) !important; }
</style>"""
PRESENTER_CHART_FONT = 17  # px: Plotly's base font on a projector (its default is 12)
PRESENTER_FONT_SCALE = PRESENTER_CHART_FONT / 12  # for chart text given an explicit size

# A fixed script (no user or model text; the stop number is an int), drawn with the tour banner:
# * Shift+→ / Shift+← step the tour even while a slider, radio or checkbox has the focus. Streamlit
#   ignores button shortcuts then, and the widget itself took the keys: a stop's demo (move α, switch
#   the radio) was undone by the key meant to leave it. Text fields keep their own Shift+arrows.
# * A new stop opens at the top of the page, with the banner in view, even when the previous stop was
#   on the same page scrolled down.
_TOUR_SCRIPT = """<script>
(() => {
  const w = window;
  if (!w.__speedupLabTourKeys) {
    w.__speedupLabTourKeys = true;
    document.addEventListener("keydown", (e) => {
      if (!e.shiftKey || e.altKey || e.ctrlKey || e.metaKey) return;
      if (e.key !== "ArrowRight" && e.key !== "ArrowLeft") return;
      const a = document.activeElement;
      const kind = a && a.tagName === "INPUT" ? a.type : "";
      if (!["range", "radio", "checkbox"].includes(kind) && !(a && a.getAttribute("role") === "slider")) return;
      const b = document.querySelector(e.key === "ArrowRight" ? ".st-key-tour_next button" : ".st-key-tour_prev button");
      if (!b || b.disabled) return;
      e.preventDefault(); e.stopPropagation(); a.blur(); b.click();
    }, true);
  }
  if (w.__speedupLabTourStop !== STOP) {
    w.__speedupLabTourStop = STOP;
    const main = document.querySelector('[data-testid="stMain"]');
    if (main) main.scrollTo(0, 0);
  }
})();
</script>"""


@st.cache_data(show_spinner=False)
def _stops():
    return tour_stops()


def presenting() -> bool:
    """Whether presenter mode is on in this session."""
    return bool(st.session_state.get(PRESENT_KEY))


def intro(markdown: str, label: str = "About this page") -> None:
    """A page's (or a tab's) opening paragraph (fixed text: no user or model text). In presenter mode it
    folds into an expander named ``label``, so the controls and visuals fit the projector's first
    screen; the presenter says the words."""
    if presenting():
        with st.expander(label):
            st.markdown(markdown)
    else:
        st.markdown(markdown)


def _flag(raw: str | None) -> bool:
    return str(raw).lower() in ("1", "true", "yes", "on")


def init_modes() -> bool:
    """Read ``present`` from the URL into the session (call before ``st.set_page_config``; the tour stop
    is read by ``tour_banner``, once the run knows whether its URL is an address to follow).

    Returns:
        whether presenter mode is on.
    """
    qp = st.query_params
    if PRESENT_KEY in qp:
        st.session_state[PRESENT_KEY] = _flag(qp[PRESENT_KEY])
        if qp[PRESENT_KEY].lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            note_replaced(PRESENT_KEY, qp[PRESENT_KEY], False)
    return bool(st.session_state.get(PRESENT_KEY))


def _read_tour_stop() -> None:
    """Follow the link's ``tour=i`` when this run opens an address (``url_leads``: Back/Forward, a link,
    the first run). A click sends the URL the browser had then, which may predate the last update: a
    quick second click on "◀ Previous" took the tour back to the stop it had just left."""
    qp = st.query_params
    if passed_back_through_a_switch() and "tour" not in qp and is_history_navigation():
        st.session_state[TOUR_KEY] = None  # Back past the tour's start: the entry from before it
    if "tour" in qp and qp["tour"] != str(st.session_state.get(TOUR_KEY)) and (
            url_leads() or TOUR_KEY not in st.session_state):
        raw = qp["tour"]
        try:
            i = int(raw)
        except ValueError:
            i = -1
        n = len(_stops())
        st.session_state[TOUR_KEY] = min(i, n - 1) if i >= 0 else None
        if i < 0 or i >= n:  # a hand-edited link: say what is shown instead
            # the link counts stops from 0, the banner from 1: name the stop as the banner does
            note_replaced("tour", raw, n - 1 if i >= n else "off", why=f"stop {n} of {n}" if i >= n else "")


def _keep_modes_in_url() -> None:
    """Page navigation clears the query string; put the modes back so the URL reproduces the view."""
    if st.session_state.get(PRESENT_KEY):
        stage_url(PRESENT_KEY, "1")
    elif PRESENT_KEY in st.query_params:  # "present=0" or an unreadable value: off, and out of the link
        stage_url(PRESENT_KEY, None)
    stop = st.session_state.get(TOUR_KEY)
    if stop is not None:
        stage_url("tour", str(stop))
    elif "tour" in st.query_params:
        stage_url("tour", None)


def go_to_stop(i: int) -> None:
    """Move the tour to stop ``i`` and open its page in the stop's state."""
    stops = _stops()
    i = min(max(i, 0), len(stops) - 1)
    st.session_state[TOUR_KEY] = i
    st.session_state[_LINK_CHECKED] = True
    goto(stops[i].link, stops[i].clear)


def _open_linked_stop(page_url_path: str) -> None:
    """A link with ``tour=i`` opened on another page than stop i's, or with none of the stop's settings
    (a hand-made ``/?tour=2`` or ``/whatif?tour=1``), opens the stop as the tour would: its page, its
    settings. A link copied at a stop (its page and settings, perhaps changed) is left as it is. Checked
    once per session, on the first run with a tour."""
    i = st.session_state.get(TOUR_KEY)
    if i is None or st.session_state.get(_LINK_CHECKED):
        return
    st.session_state[_LINK_CHECKED] = True
    link = _stops()[i].link
    if page_url_path != link.url_path or not any(k in st.query_params for k in link.params):
        go_to_stop(i)


def leave_tour() -> None:
    st.session_state[TOUR_KEY] = None
    if "tour" in st.query_params:
        stage_url("tour", None)  # also replaces a "tour" this run had already staged


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


def tour_banner(page_url_path: str) -> None:
    """The app's small base style sheet, presenter styling and, while the tour is on, its banner: where
    we are, what to look at, and Previous / Next / Leave. Call from app/main.py after ``st.navigation``
    and before ``.run()``, with the page's ``url_path`` ("" for the home page)."""
    _read_tour_stop()
    _keep_modes_in_url()
    st.html(_BASE_CSS)
    if st.session_state.get(PRESENT_KEY):
        st.html(_PRESENTER_CSS)
    i = st.session_state.get(TOUR_KEY)
    if i is None:
        return
    _open_linked_stop(page_url_path)
    stops = _stops()
    stop = stops[i]
    with st.container(border=True, key="tour_banner"):
        # the title and the stepping buttons share a row, so the stop's page starts higher on the screen
        t, c1, c2, c3 = st.columns([2.8, 1.8, 1.6, 1.6], vertical_alignment="center")
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
        st.html(_TOUR_SCRIPT.replace("STOP", str(int(i))), unsafe_allow_javascript=True)
