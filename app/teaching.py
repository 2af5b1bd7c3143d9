"""The "Check yourself" widgets shared by the pages: per question a radio, a Check button and the engine's
explanation. Questions and their answers come from ``engine.explain.teaching``; this module only draws them.
Links between pages are in ``app.navigation``.

On a page::

    from app.teaching import check_yourself
    from engine.explain.teaching import whatif_questions
    check_yourself("whatif", whatif_questions(alpha, gamma, cost))
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import streamlit as st

from engine.errors import SpeedupLabError
from engine.explain.teaching import Question


def _sig(q: Question) -> str:
    return hashlib.sha1(("\x1f".join((q.prompt, *q.options))).encode("utf-8")).hexdigest()[:8]


def question_key(page_key: str, q: Question) -> str:
    """Widget key of a question's radio; changes when the question's text or options change, so a new
    setting gives a fresh, unanswered question."""
    return f"cy_{page_key}_{q.key}_{_sig(q)}"


def check_yourself(page_key: str, questions: Sequence[Question] | None, *, expanded: bool = True) -> None:
    """Draw "Check yourself": per question a radio and a **Check** button; after an answer, whether it was
    right and the engine's explanation. ``questions`` come from ``engine.explain.teaching``."""
    if not questions:
        return
    with st.expander("🎓 Check yourself", expanded=expanded):
        st.caption("The answers are computed by the engine from this page's current settings: change a "
                   "setting and the questions change with it.")
        for i, q in enumerate(questions):
            rk = question_key(page_key, q)
            st.markdown(f"**{i + 1}. {q.prompt}**")
            choice = st.radio(f"Answer to question {i + 1}", q.options, index=None, key=rk,
                              label_visibility="collapsed")
            if st.button("Check", key=f"{rk}_check", disabled=choice is None):
                st.session_state[f"{rk}_answered"] = choice
            answered = st.session_state.get(f"{rk}_answered")
            if answered is not None and answered == choice:
                if q.is_correct(answered):
                    st.success("Right. " + q.explanation)
                else:
                    st.error(f"Not quite: the answer is **{q.options[q.correct]}**. " + q.explanation)
                st.caption(f"Source: {q.source}")


def safe_questions(fn, *args, **kwargs) -> list[Question]:
    """``fn(*args, **kwargs)`` from ``engine.explain.teaching``, or no questions when the settings are invalid
    (the page already shows the error)."""
    try:
        return fn(*args, **kwargs)
    except SpeedupLabError:
        return []
