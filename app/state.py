"""Shared UI state: widget values mirrored in the URL query parameters, so a link reproduces a view.

Usage on a page::

    gamma = url_param("gamma", 4, int, lo=1, hi=16)   # seeds st.session_state["gamma"] from the URL
    st.slider("γ", 1, 16, key="gamma")                 # the widget reads/writes the same key
    sync_url(["gamma", ...])                           # after the widgets: write current values back

Values from the URL are parsed and clamped; anything unparsable falls back to the default, so a
hand-edited link never breaks a page. Each value replaced that way is named once, in a toast drawn by
``flush_url`` at the end of the run (``sync_url`` when a page runs alone) ("wi_alpha=1.5 → 1"), so the
page does not silently show something else than the link said.

Three more rules make the URL behave like a page's address:
- A value survives runs in which its widget is not drawn (a What-if tab that is not open, another
  page): ``url_param`` re-asserts it on its page, and ``keep_page_state`` (app/main.py, every run)
  re-asserts every key any page registered, so Streamlit does not drop it with the widget.
- One URL update per run: Streamlit adds a browser-history entry per update. app/main.py calls
  ``begin_url_batch`` before the page and ``flush_url`` after it; in between ``sync_url`` and
  ``stage_url`` only collect. (Written one key at a time, opening a page added ~20 entries and Back
  seemed to do nothing.) Without a batch (a page run alone, as in tests) writes apply at once.
- A value in the URL that differs from what ``sync_url`` last wrote came from outside (Back/Forward, an
  edited link, a link to the page): it replaces the session's value. So Back undoes the last change.
  A key missing from the URL (the page opened from the sidebar) keeps the session's value.
  Only a run that opens an address does that (``begin_url_batch`` decides: Back/Forward, another page,
  the session's first run). A click on the page sends the browser's URL as it was at the click, which
  can predate the previous run's update: read as an outside change, it undid a quick second click.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NoReturn

import streamlit as st


def _parse(raw: str, default: Any, cast: Callable[[str], Any]) -> Any:
    try:
        if cast is bool:
            if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return default  # "causal=maybe": replaced, and named in the toast
            return raw.lower() in ("1", "true", "yes", "on")
        value = cast(raw)
    except (TypeError, ValueError, OverflowError):
        return default
    if isinstance(value, float) and not math.isfinite(value):  # nan/inf pass every clamp test
        return default
    return value


_NOTES = "_url_param_notes"
_WRITTEN = "_url_param_written"  # {key: the string sync_url last put in the URL}
_KEYS = "_url_param_keys"        # every key url_param has seeded, on any page
_PENDING = "_url_pending"        # {key: string, or None to remove} collected during a batch
_LEADS = "_url_leads"            # whether this run's URL is an address to follow (begin_url_batch)
_LAST_PAGE = "_url_last_page"    # the page this run draws (the previous run's, until begin_url_batch)
_PREVIOUS_PAGE = "_url_previous_page"  # the page the previous run drew


def url_param(key: str, default: Any, cast: Callable[[str], Any] = str, *, lo: Any = None,
              hi: Any = None, choices: Iterable[Any] | None = None, step: float | None = None) -> Any:
    """Seed ``st.session_state[key]`` from the URL (first run of a session) and return the value.

    Args:
        key: session-state key and query-parameter name.
        default: used when the URL has no (valid) value.
        cast: parser for the raw string (int, float, str, bool).
        lo, hi: clamp numeric values into [lo, hi].
        step: the slider's step: a value between steps is rounded to the nearest one (a link's α = 0.805
            was used as such while its slider showed 0.81).
        choices: allowed values; anything else falls back to ``default``. Also checked against a value
            already in the session (pages share one session state: a key another page set, with a value
            this page does not offer, is seeded again rather than shown as something it is not).
    """
    if key in st.session_state and choices is not None and st.session_state[key] not in list(choices):
        del st.session_state[key]
    st.session_state.setdefault(_KEYS, set()).add(key)
    raw = st.query_params.get(key)
    written = st.session_state.get(_WRITTEN, {})
    if (key in st.session_state and raw is not None and key in written and raw != written[key]
            and st.session_state.get(_LEADS, True)):
        del st.session_state[key]  # changed outside the page (Back/Forward, a link to it): follow the URL
    if key in st.session_state:
        # re-assert: a widget not drawn in a run (a closed tab) would otherwise lose its value
        st.session_state[key] = st.session_state[key]
    else:
        value = default
        if raw is not None:
            value = _parse(raw, default, cast)
        if choices is not None and value not in list(choices):
            value = default
        if step and isinstance(value, (int, float)) and not isinstance(value, bool):
            # half up, as the slider shows it (0.805 → 0.81; Python's round() would give 0.8)
            value = round(math.floor(value / step + 0.5 + 1e-9) * step, 10)
        if lo is not None and value is not None and value < lo:
            value = lo
        if hi is not None and value is not None and value > hi:
            value = hi
        st.session_state[key] = value
        if raw is not None and _fmt(value) != raw and _parse(raw, None, cast) != value:
            note_replaced(key, raw, value)
    return st.session_state[key]


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        # 15 significant digits: a preset's 70.553706 B parameters came back from a link as 70.5537 ("{:g}")
        # and the page called the unchanged preset "modified"
        return f"{v:.15g}"
    return str(v)


def url_text(value: Any) -> str:
    """The string ``sync_url`` writes into the URL for ``value`` (bool as 1/0, floats to 15 digits)."""
    return _fmt(value)


def sync_url(keys: Iterable[str]) -> None:
    """Write the current session-state values of ``keys`` into the URL query parameters (and name, once,
    the link values ``url_param`` had to replace)."""
    if st.session_state.get(_PENDING) is None:  # in a batch, flush_url names them, once per run
        _toast_notes()
    written = st.session_state.setdefault(_WRITTEN, {})
    for k in keys:
        if k in st.session_state and st.session_state[k] is not None:
            written[k] = _fmt(st.session_state[k])
            stage_url(k, written[k])


def note_replaced(key: str, raw: str, value: Any, why: str = "") -> None:
    """Record that the link's ``key=raw`` could not be used as such and ``value`` is shown instead; the
    next ``sync_url`` (outside a batch) or ``flush_url`` names it in a toast. For link values that
    ``url_param`` does not read (the tour stop, a widget bound to the URL by Streamlit), or that a page
    overrode after reading them (``why`` says by what). Replaces an earlier note about ``key``."""
    notes = st.session_state.setdefault(_NOTES, [])
    notes[:] = [n for n in notes if not n.startswith(f"{key}=")]
    notes.append(f"{key}={raw[:40]} → {_fmt(value)}" + (f" ({why})" if why else ""))


def _toast_notes() -> None:
    notes = st.session_state.pop(_NOTES, None)
    if notes:
        st.toast("Some values in the link were unreadable or out of range and were replaced: "
                 + ", ".join(notes) + ".", icon="ℹ️")


def stage_url(key: str, value: str | None) -> None:
    """Put ``value`` in the URL under ``key`` (None: remove it): at the end of the run inside a batch,
    at once otherwise."""
    pending = st.session_state.get(_PENDING)
    if pending is None:
        _apply({key: value})
    else:
        pending[key] = value


def stage_text(key: str, text: str | None, limit: int) -> bool:
    """Put a user's own text (a custom prompt, edited requests) in the URL under ``key`` when it has at most
    ``limit`` characters; ``text=None`` (a preset's text, named by another key) or a longer text takes
    ``key`` out of the URL. Returns whether the link carries the text (True for None: nothing to carry)."""
    fits = text is None or len(text) <= limit
    if text is not None and fits:
        stage_url(key, text)
    elif key in st.query_params:
        stage_url(key, None)
    return fits


def _apply(changes: dict[str, str | None]) -> None:
    updates = {k: v for k, v in changes.items() if v is not None and st.query_params.get(k) != v}
    if updates:
        st.query_params.update(updates)  # one update: one browser-history entry
    for k, v in changes.items():
        if v is None and k in st.query_params:
            del st.query_params[k]  # rare (a custom prompt back to a preset): one entry each


def keep_page_state() -> None:
    """Re-assert every key ``url_param`` has seeded, so the values of pages not shown in this run survive
    it (Streamlit drops a widget's value in a run that does not draw the widget: a sidebar round trip reset
    every slider). Call at the start of every run, before any page draws its widgets."""
    for k in st.session_state.get(_KEYS, ()):
        if k in st.session_state:
            st.session_state[k] = st.session_state[k]


def url_leads() -> bool:
    """Whether this run opens an address: Back/Forward, another page, or the session's first run, as
    ``begin_url_batch`` decided. Then the URL describes the page, including what it leaves out (a page's
    own text that is not in the link is the preset's). False outside a batch."""
    return st.session_state.get(_LEADS) is True


def is_history_navigation() -> bool:
    """Whether the browser's Back/Forward started this run (False when Streamlit does not say)."""
    return bool(_is_history_navigation())


def _is_history_navigation() -> bool | None:
    """Whether the browser's Back/Forward started this run (None: this Streamlit does not say)."""
    try:
        from streamlit.runtime.scriptrunner import get_script_run_ctx

        return getattr(get_script_run_ctx(), "is_history_navigation", None)
    except Exception:  # noqa: BLE001 - Streamlit internals
        return None


def begin_url_batch(page: str | None = None) -> None:
    """Collect this run's URL writes until ``flush_url`` (call before the page runs), and decide whether
    this run's URL is an address to follow (a value in it that differs from what ``sync_url`` wrote
    replaces the session's): yes after Back/Forward, on another ``page`` than the previous run's, and in a
    session's first run; no after a click on the same page, whose URL may be older than the last update
    (two quick clicks on "Previous request" moved one step or none)."""
    st.session_state[_PENDING] = {}
    history = _is_history_navigation()
    previous = st.session_state.get(_LAST_PAGE)
    st.session_state[_LEADS] = history is None or history or page is None or page != previous
    st.session_state[_PREVIOUS_PAGE] = previous
    st.session_state[_LAST_PAGE] = page


_SWITCHING = "_url_switching"  # set by discard_url_batch: this run ends in a page switch
_ARRIVING = "_url_arriving"    # set by discard_url_batch: the next run draws the page the switch opens


def discard_url_batch() -> None:
    """Drop the writes collected so far (before switching to another page with its own query). The
    notes of replaced link values wait for the next run: a toast drawn now would vanish with this one.
    The run that draws the new page leaves the URL as the switch set it (the link's own values): each
    URL update is a browser-history entry, and the page's defaults, written on top, made one Back a
    press that changed nothing."""
    if st.session_state.get(_PENDING) is not None:
        st.session_state[_PENDING] = {}
        st.session_state[_SWITCHING] = True
        st.session_state[_ARRIVING] = True


def current_page() -> str | None:
    """The ``page`` this run's ``begin_url_batch`` was given (None outside a batch)."""
    return st.session_state.get(_LAST_PAGE) if _PENDING in st.session_state else None


def previous_page() -> str | None:
    """The ``page`` the previous run's ``begin_url_batch`` was given (None: none, or outside a batch)."""
    return st.session_state.get(_PREVIOUS_PAGE)


def abandon_run() -> NoReturn:
    """End this run without writing its URL changes (``st.stop()``): for a run that only passes through
    a history entry (see ``app.tour``)."""
    st.session_state[_PENDING] = {}
    st.stop()


def stop_page() -> NoReturn:
    """``st.stop()`` that first writes the run's URL changes and names replaced link values. After
    ``st.stop()`` Streamlit drops every message the script still sends, so a page that stopped on an error
    (a draft model not typed yet, 65 query heads over 8 KV heads) left its link at the previous state and
    its toast unsaid."""
    flush_url()
    st.stop()


def flush_url() -> None:
    """Apply the run's collected URL writes in one update and end the batch (call after the page runs,
    also when it stopped early)."""
    pending = st.session_state.pop(_PENDING, None)
    switching = st.session_state.pop(_SWITCHING, False)
    arriving = not switching and st.session_state.pop(_ARRIVING, False)
    if pending and not arriving:
        _apply(pending)
    if not switching:
        _toast_notes()  # also the values read before a page stopped early (an error shown, st.stop)
