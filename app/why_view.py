""""Why, here": a measured speedup with the three conditions a run measured (``engine.explain.why``), which one held
it back, the analytic model's prediction, a link into What-if at the run's numbers, and beside a small speedup a
case that pays on this machine one click away. Drawn under the Live page's result, the Race page's verdict.

``why_rows`` is the card's content without Streamlit (tested alone); ``why_card`` draws it.
"""

from __future__ import annotations

import math

import streamlit as st

from app.navigation import go_button, page_link
from engine.explain.why import PAYS, PayingCase, WhyHere, paying_case

MARK = {True: "✅", False: "⚠️"}
"""A condition met (the speedup would gain under 10 % were it perfect) or not; ⬇️ marks the one that held it back most."""


def why_rows(why: WhyHere) -> list[dict]:
    """The card's three columns: {"title", "value", "measured", "ideal", "if_ideal", "limiting"} (plain Markdown, no
    model text). ``value`` is the short figure a metric shows; ``if_ideal`` the sentence of the speedup with the
    condition perfect (None without a prediction)."""
    values = {"acceptance": f"α̂ {why.alpha:.2f} · {why.tokens_per_pass:.2f}/pass",
              "verify": "—" if why.verify_ratio is None else f"{why.verify_ratio:.2f}× one token",
              "draft": "—" if why.c is None or math.isnan(why.c) else f"c {why.c:.3f}"}
    perfect = {"acceptance": "every draft token accepted", "verify": f"a pass over {why.fed} tokens cost one token's",
               "draft": "the draft were free"}
    out = []
    for c in why.conditions:
        lim = why.limiting == c.key and not c.ok
        mark = "·" if why.predicted is None else "⬇️" if lim else MARK[c.ok]
        out.append({"key": c.key, "title": f"{mark} {c.name}" + (" (held it back most)" if lim else ""),
                    "value": values[c.key], "measured": c.measured, "ideal": c.ideal,
                    "if_ideal": None if c.if_ideal is None else f"If {perfect[c.key]}: {c.if_ideal:.2f}×",
                    "limiting": lim})
    return out


def why_card(why: WhyHere | None, key: str, offer_case: bool = True,
             link_label: str = "Open What-if at this run's numbers") -> None:
    """Draw the card (nothing when ``why`` is None). ``key`` prefixes its widgets' keys; ``link_label`` names the
    What-if link (on What-if itself: its analytic model)."""
    if why is None:
        return
    with st.container(border=True, key=f"{key}_why"):
        st.markdown("**Why, here** " + why.headline())
        cols = st.columns(3)
        for col, row in zip(cols, why_rows(why)):
            col.metric(row["title"], row["value"], help=f"Measured: {row['measured']}. Needed: {row['ideal']}.")
            col.caption(row["measured"] + (f". {row['if_ideal']}." if row["if_ideal"] else "."))
        row = st.container(horizontal=True, vertical_alignment="center")
        with row:
            page_link(why.whatif_link(), link_label, icon="📈")
        if offer_case and why.measured is not None and why.measured < PAYS:
            case_button(key)


def case_button(key: str, case: PayingCase | None = None) -> None:
    """One button that opens a case that pays (prompt lookup on a code edit) in the Race page, with its measured
    speedup and the machine it was measured on in the sentence."""
    case = paying_case() if case is None else case
    if case is None:
        return
    st.caption("A case that pays: " + case.sentence())
    go_button(case.link(), f"🏁 Race {case.label[0].lower() + case.label[1:]}", key=f"{key}_paying",
              extra_clear=("rc_prompt", "rc_race", "rc_show"),
              help="Opens the Race page on this configuration; press Race there to measure it on this server.")
