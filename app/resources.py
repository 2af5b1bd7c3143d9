"""Process-wide resources shared by every browser session: loaded models (Streamlit's resource cache) and this
machine's measured bandwidth and FLOP/s (one measurement that every page shows).

Models are read-only during decoding (each session keeps its own KV caches), so sharing them across
sessions is safe.
"""

from __future__ import annotations

import streamlit as st

from app.threads import in_passing_thread
from engine.decoding.models import LoadedModel, load_model, load_tokenizer
from engine.decoding.pass_cost import refresh_stale_pass_cost


def get_model(spec: str = "embedded", device: str | None = None, dtype: str | None = None,
              arithmetic: str | None = None) -> LoadedModel:
    """Load ``spec`` once per process and arithmetic (see ``engine.decoding.models.load_model``; ``arithmetic`` None:
    the process's, ``engine.decoding.compute.arithmetic``, so a page that names it and one that does not share one
    load); raises ModelLoadError, InputError."""
    from engine.decoding.compute import arithmetic as process_arithmetic

    return _get_model(spec, device, dtype, arithmetic or process_arithmetic())


@st.cache_resource(show_spinner=False, max_entries=6)
def _get_model(spec: str, device: str | None, dtype: str | None, arithmetic: str) -> LoadedModel:
    bar = st.progress(0.0, text="Loading the embedded model…" if spec == "embedded" else f"Loading {spec}…")
    # one bar for both stages: loading 0–70 %, then this machine's pass-cost curve 70–100 % (two bars would
    # jump from 100 % back to 17 % when the curve is measured after the load)
    show = (lambda lo, hi: lambda msg, frac: bar.progress(lo + (hi - lo) * min(max(frac, 0.0), 1.0), text=msg))
    def load() -> LoadedModel:
        target = load_model(spec, device=device, dtype=dtype, progress=show(0.0, 0.7), arithmetic=arithmetic)
        # this machine's curve, if stored under another row limit
        refresh_stale_pass_cost(target, progress=show(0.7, 1.0))
        return target

    try:
        return in_passing_thread(load)  # the page's own thread computes nothing in parallel (in_passing_thread)
    finally:
        bar.empty()


@st.cache_resource(show_spinner=False, max_entries=6)
def get_tokenizer(spec: str = "embedded"):
    """The tokenizer of ``spec``, loaded once per process; raises ModelLoadError."""
    return load_tokenizer(spec)


@st.cache_resource(show_spinner="Reading this machine's memory bandwidth and FLOP/s (measured once, ~2 s)…",
                   max_entries=2)
def dated_machine_peaks(device: str):
    """This machine's memory bandwidth and matmul FLOP/s with the date they were measured
    (``engine.explain.machine.stored_peaks``: measured once per machine and stored, a 128 MB tensor copy and a
    1024² fp32 matmul, best of 3), shared by every page that shows them (What-if's roofline, the KV-cache page's
    "this machine"), so they show the same numbers, across restarts too."""
    from engine.explain.machine import stored_peaks

    return in_passing_thread(lambda: stored_peaks(device))


def machine_peaks(device: str):
    """The figures of ``dated_machine_peaks`` (an ``engine.decoding.batch.MachinePeaks``)."""
    return dated_machine_peaks(device).peaks


def remeasure_machine_peaks(device: str) -> None:
    """Measure this machine's peaks again (a reader's request), store them, and let every page read the new ones."""
    from engine.explain.machine import stored_peaks

    in_passing_thread(lambda: stored_peaks(device, remeasure=True))
    dated_machine_peaks.clear()
