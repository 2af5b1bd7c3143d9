"""Where a page computes: in a thread that ends (``in_passing_thread``), so that the room's worker is the process's
only long-lived computing thread (``engine.decoding.scheduler``)."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def in_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run in a thread that ends when it returns (with this script run's Streamlit context, so its progress
    bars draw): its result, or its exception raised here.

    Why: PyTorch's CPU threads are OpenMP's, and a thread that has run a parallel operation keeps its own team of
    helper threads while it lives. A page's thread that loaded a model or a draft, then waited for the room's worker
    to decode its run, left two teams on the 2 cores, and libgomp then stops spinning between parallel regions: the
    Race page's plain lane ran at 50 tokens/s instead of 90 on the AMD EPYC
    (``engine.decoding.scheduler.IDLE_EXIT_S`` says the same of the worker)."""
    from streamlit.runtime.scriptrunner import add_script_run_ctx, get_script_run_ctx

    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            box["err"] = e

    th = threading.Thread(target=run, name="speedup-lab-load", daemon=True)
    ctx = get_script_run_ctx()
    if ctx is not None:
        add_script_run_ctx(th, ctx)
    th.start()
    th.join()
    if "err" in box:
        raise box["err"]
    return box.get("out")
