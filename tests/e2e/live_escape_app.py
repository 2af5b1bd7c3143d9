"""A one-page Streamlit script for tests/e2e/test_live.py: renders hostile token texts through the live
page's Markdown helpers, so the browser test can check they show literally (no HTML, link, image,
emphasis, LaTeX or emoji)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import streamlit as st  # noqa: E402

from app.live_view import chip, generated_markdown, verdict_frame  # noqa: E402
from engine.decoding.trace import DraftPosition, Round  # noqa: E402

NASTY = ["*bold*", "_em_", "[x](javascript:alert(1))", "<script>alert(1)</script>", "`code`", "$x^2$",
         "# head", "1. item", "a\\b", "~~s~~", ":+1:", "<- -> --", "{foreground=red}", "| a | b |",
         "![img](http://x/y.png)", "&amp; &lt;", "**", "]", "[", "<img src=x onerror=alert(1)>", ":red[x]"]

for i, s in enumerate(NASTY):
    st.markdown(f"row{i}: " + chip(s, "green-background") + " " + chip(s, "red-background", strike=True)
                + " " + generated_markdown([(s, "accepted"), ("Z", "correction")]) + f" end{i}")
rnd = Round(index=0, context_len=1, drafted=[
    DraftPosition(1, "<b>x</b>", 0.5, 0.6, 1.0, 0.1, "accepted"),
    DraftPosition(2, " [a](b)", 0.5, 0.1, 0.2, 0.9, "rejected")],
    n_accepted=1, next_token_id=3, next_text="*c*", next_kind="correction", next_top_p=[],
    residual_top=None, emitted_ids=[1, 3], draft_ms=1, verify_ms=1, tokens_verified=3)
st.markdown(verdict_frame(rnd) + " endround")
