"""Navigation between pages: links and buttons that open a page in a given state (a page URL with query
parameters), and the two checks ``app/main.py`` runs before each page draws (a history entry a page switch
left behind is passed through; a switch a quick second click swallowed is made again).

On a page::

    from app.navigation import go_button, page_link
    page_link(link, "Open What-if at α 0.8")   # link: an ``engine.explain.teaching.PageLink``
"""

from __future__ import annotations

import re
import time
from functools import lru_cache
from typing import Sequence

import streamlit as st

from app.registry import PAGES_DIR, available_pages
from app.state import abandon_run, current_page, discard_url_batch, is_history_navigation, previous_page
from engine.explain.teaching import PageLink

_URL_PARAM = re.compile(r"""url_param\(\s*["'](\w+)["']""")


@lru_cache(maxsize=32)
def page_url_keys(file: str) -> tuple[str, ...]:
    """The query-parameter keys a page reads with ``url_param`` (parsed from its source file)."""
    path = PAGES_DIR / file
    if not path.is_file():
        return ()
    return tuple(dict.fromkeys(_URL_PARAM.findall(path.read_text(encoding="utf-8"))))


def page_file(url_path: str) -> str | None:
    """File name in pages/ of the registered page with this ``url_path`` (None if it is not there)."""
    for p in available_pages():
        if p.url_path == url_path:
            return p.file
    return None


def reset_page_state(link: PageLink, extra: Sequence[str] = ()) -> None:
    """Forget the session values of the target page's URL keys (and ``extra`` derived keys), so the page
    seeds its widgets from the link's query parameters on its next run."""
    file = page_file(link.url_path)
    for k in (*(page_url_keys(file) if file else ()), *link.params, *extra):
        if not _is_bound(k):
            st.session_state.pop(k, None)


def _mode_params() -> dict[str, str]:
    """The app-wide modes that travel with every link (presenter mode, the tour stop)."""
    out = {}
    if st.session_state.get("present"):
        out["present"] = "1"
    if st.session_state.get("tour_stop") is not None:
        out["tour"] = str(st.session_state["tour_stop"])
    return out


def _is_bound(key: str) -> bool:
    """Whether a query parameter is bound to a widget (``bind="query-params"``, e.g. In the wild's engine
    filter): such a parameter cannot be set directly, only through the widget's session value."""
    try:
        from streamlit.runtime.state.session_state_proxy import get_session_state

        with get_session_state().query_params() as qp:
            return bool(qp.is_bound(key))
    except Exception:  # noqa: BLE001 - Streamlit internals; treat as unbound
        return False


def goto(link: PageLink, extra_clear: Sequence[str] = ()) -> None:
    """Open ``link``'s page with its settings now (``st.switch_page``; call from the script, not a callback).

    The page's URL keys are forgotten first, so it seeds its widgets from the link; a parameter bound to
    a widget is set through the widget's session value instead of the URL."""
    file = page_file(link.url_path)
    if file is None:
        st.error(f"The page “{link.url_path}” is not available yet.")
        return
    query = link.query()
    bound = {k: v for k, v in link.params.items() if _is_bound(k)}
    reset_page_state(link, extra_clear)
    for k, v in bound.items():
        st.session_state[k] = v
        query.pop(k, None)
    discard_url_batch()  # this page's pending URL writes must not land on the new page's URL
    query = {**query, **_mode_params()}
    origin = current_page()
    st.session_state[_SWITCH] = (link, tuple(extra_clear), origin, query)
    if origin is not None and origin != link.url_path and set(query) - _MODES:
        # st.switch_page first puts the new query on the page being left: a history entry of its own
        transits = st.session_state.setdefault(_TRANSITS, [])
        transits[:] = [*transits[-49:], _entry(origin, query)]
    st.switch_page(str(PAGES_DIR / file), query_params=query)


_SWITCH = "_goto_switch"  # (link, extra_clear, the page it left, the query it opened with) until it lands
_TRANSITS = "_goto_transits"  # the history entries goto's switches left behind: (page, query items)
_PASSED_BACK = "_goto_passed_back"  # the previous run passed such an entry going back
_MODES = {"tour", "present"}
# A fixed script (no user or model text; the direction is one of two words): see pass_through_switch_entry.
_HISTORY_STEP = """<script>/* NONCE */ window.history.DIRECTION();</script>"""


def _entry(page: str | None, query) -> tuple:
    return page, tuple(sorted((str(k), str(v)) for k, v in query.items()))


def pass_through_switch_entry(page: str) -> None:
    """Call every run before anything is drawn (app/main.py), with the page's ``url_path``. Back/Forward
    onto a history entry that ``goto``'s switch left behind (the page being left, under the new page's
    query: ``/whatif?pc_preset=…&tour=3``) passes through it in the reader's direction: forward when the
    previous run drew this same page (the entry before it), back otherwise. Such an entry showed a tour
    stop's banner over another stop's page, and every opened link cost two or three Back presses."""
    if not is_history_navigation():
        return
    if _entry(page, st.query_params.to_dict()) not in st.session_state.get(_TRANSITS, ()):
        return
    forward = previous_page() == page
    st.session_state[_PASSED_BACK] = not forward
    st.caption("…")
    st.html(_HISTORY_STEP.replace("DIRECTION", "forward" if forward else "back")
            .replace("NONCE", str(time.time_ns())), unsafe_allow_javascript=True)
    abandon_run()


def passed_back_through_a_switch() -> bool:
    """Whether the previous run passed back through a switch's entry (read once per run)."""
    return bool(st.session_state.pop(_PASSED_BACK, False))


def finish_switch(page: str) -> None:
    """Call every run before the page draws (app/main.py), with the page's ``url_path``. A second click
    that reaches the server while ``goto``'s page switch is under way replaces the switch with a run of
    the page it left (Streamlit keeps the newer request): a quick double "◀ Previous" in the tour left
    the first stop's banner over the second stop's page. Such a switch is made again; Back/Forward or
    another page in between drop it."""
    pending = st.session_state.pop(_SWITCH, None)
    if pending is None:
        return
    link, extra_clear, origin, query = pending
    landed = page == link.url_path and all(st.query_params.get(k) == v for k, v in query.items())
    if not landed and not is_history_navigation() and page in (origin, link.url_path):
        goto(link, extra_clear)


def go_button(link: PageLink, label: str, key: str, extra_clear: Sequence[str] = (), **kwargs) -> None:
    """A button that opens ``link``'s page in the linked state (one click)."""
    if st.button(label, key=key, **kwargs):
        goto(link, extra_clear)


def page_link(link: PageLink, label: str, icon: str | None = None) -> None:
    """A plain link (opens in a new tab too) to ``link``'s page with its query parameters."""
    file = page_file(link.url_path)
    if file is None:
        st.markdown(f"{label} (page not available yet)")
        return
    try:
        st.page_link(str(PAGES_DIR / file), label=label, icon=icon, query_params={**link.query(), **_mode_params()})
    except Exception:  # noqa: BLE001 - page run alone (AppTest) without navigation
        st.markdown(f"{label} → `{link.url()}`")
