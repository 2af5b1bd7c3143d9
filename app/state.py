"""Shared UI state: widget values mirrored in the URL query parameters, so a link reproduces a view.

Usage on a page::

    gamma = url_param("gamma", 4, int, lo=1, hi=16)   # seeds st.session_state["gamma"] from the URL
    st.slider("γ", 1, 16, key="gamma")                 # the widget reads/writes the same key
    sync_url(["gamma", ...])                           # after the widgets: write current values back

Values from the URL are parsed and clamped; anything unparsable falls back to the default, so a
hand-edited link never breaks a page. Each value replaced that way is named once, in a toast drawn by
``sync_url`` ("wi_alpha=1.5 → 1"), so the page does not silently show something else than the link said.

Three more rules make the URL behave like a page's address:
- A value survives runs in which its widget is not drawn (a What-if tab that is not open, another
  page): ``url_param`` re-asserts it every run, so Streamlit does not drop it with the widget.
- ``sync_url`` writes all changed values in one update. Streamlit adds one browser-history entry per
  update; written one key at a time, opening a page added ~20 and Back seemed to do nothing.
- A value in the URL that differs from what ``sync_url`` last wrote came from outside (Back/Forward, an
  edited link, a link to the page): it replaces the session's value. So Back undoes the last change.
  A key missing from the URL (the page opened from the sidebar) keeps the session's value.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

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
    raw = st.query_params.get(key)
    written = st.session_state.get(_WRITTEN, {})
    if key in st.session_state and raw is not None and key in written and raw != written[key]:
        del st.session_state[key]  # changed outside the page (Back/Forward, an edited link): follow the URL
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
            st.session_state.setdefault(_NOTES, []).append(f"{key}={raw[:40]} → {_fmt(value)}")
    return st.session_state[key]


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def sync_url(keys: Iterable[str]) -> None:
    """Write the current session-state values of ``keys`` into the URL query parameters (and name, once,
    the link values ``url_param`` had to replace)."""
    notes = st.session_state.pop(_NOTES, None)
    if notes:
        st.toast("Some values in the link were unreadable or out of range and were replaced: "
                 + ", ".join(notes) + ".", icon="ℹ️")
    written = st.session_state.setdefault(_WRITTEN, {})
    changed = {}
    for k in keys:
        if k in st.session_state and st.session_state[k] is not None:
            s = _fmt(st.session_state[k])
            written[k] = s
            if st.query_params.get(k) != s:
                changed[k] = s
    if changed:
        st.query_params.update(changed)  # one update: one browser-history entry
