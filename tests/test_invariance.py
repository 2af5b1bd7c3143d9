"""engine.decoding.invariance: the room's self-check reports what holds on this machine, and catches a shared pass
that does not give a row its lone bits."""

from __future__ import annotations

import contextlib

import pytest

from engine.decoding import compute, invariance
from engine.decoding.models import load_model
from tests.tiny_models import save_tiny_llama


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("invariance") / "m", layers=2, seed=5, init=0.5)


def test_the_check_holds_by_construction_on_the_streaming_kernel(path):
    t = load_model(str(path), device="cpu", compute="stream")
    assert t.compute.path == "stream", (
        f"the streaming kernel must build where the suite runs (make installs a compiler): {t.compute.reason}")
    c = invariance.run_check(t)
    assert c.holds and c.by_construction and c.attention == "kernel", c
    assert c.mismatched == [] and c.shared_passes > 0 and c.rounds > 0 and c.readers == invariance.READERS
    assert c.label().startswith("bit for bit equal to alone, checked here")


def test_the_check_catches_one_ulp_of_difference_in_a_shared_pass(path, monkeypatch):
    """A shared pass whose logits for one row are one ulp off what its lone pass gives: the check sees it and says
    so instead of promising equality (the check compares bits, not tokens)."""
    import torch

    from engine.decoding import scheduler

    t = load_model(str(path), device="cpu", compute="stream")

    def nudged(real):  # the room's shared pass, either way it runs (in the rows' own caches, or stacked)
        def run(self, fed, rec):
            out = real(self, fed, rec)
            for lg in (out or {}).values():
                if lg is not None:
                    lg[0] = torch.nextafter(lg[0], torch.full_like(lg[0], float("inf")))
                    break
            return out
        return run

    monkeypatch.setattr(scheduler.Room, "_stacked", nudged(scheduler.Room._stacked))
    monkeypatch.setattr(scheduler.Room, "_in_own_caches", nudged(scheduler.Room._in_own_caches))
    c = invariance.run_check(t)
    assert not c.holds and c.mismatched, c
    assert "got other bits in the shared pass than alone" in c.reason
    assert c.label().startswith("equal to alone up to rounding here")


def test_without_the_kernels_attention_the_promise_is_not_made(path, monkeypatch):
    t = load_model(str(path), device="cpu", compute="stream")
    monkeypatch.setitem(compute.extension._STREAM, "attention", None)
    c = invariance.run_check(t)
    assert c.attention == "sdpa per row" and not c.by_construction and not c.holds
    assert "not by construction" in c.reason or c.mismatched


def test_on_the_default_path_the_promise_is_not_made(path):
    t = load_model(str(path), device="cpu", compute="default")
    c = invariance.run_check(t)
    assert c.attention == "not invariant" and not c.holds and not c.by_construction
    assert "the streaming kernel does not run its products" in c.reason


def test_the_result_is_kept_per_target_and_shown_in_the_background(path, monkeypatch):
    t = load_model(str(path), device="cpu", compute="stream")
    calls = []
    real = invariance.run_check
    monkeypatch.setattr(invariance, "run_check", lambda target: calls.append(1) or real(target))
    first = invariance.invariance_check(t)
    assert invariance.invariance_check(t) is first and len(calls) == 1
    assert invariance.check_in_background(t) is first


@pytest.mark.parametrize("work", ["check", "room"])
def test_a_process_exiting_mid_work_exits_cleanly(work):
    """A process that exits while the background self-check, or a room's pass, is inside a torch op ends with exit
    status 0: both stop at exit (``invariance._stop_at_exit``, ``scheduler._close_rooms``). Without them it aborted
    ("terminate called without an active exception", 134) on the embedded model."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(f"""
        import threading, time
        from engine.decoding.models import load_model
        from engine.decoding.speculative import SpeculativeDecoder
        target = load_model("embedded")
        if {work!r} == "check":
            from engine.decoding.invariance import check_in_background
            check_in_background(target)
        else:
            from engine.decoding.scheduler import room_for
            room = room_for(target, warm_up=False)
            dec = SpeculativeDecoder(target, None, list(range(100, 140)), max_new_tokens=400)
            threading.Thread(target=room.run, args=(dec,), daemon=True).start()
        time.sleep(0.5)
        print("exiting", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=str(Path(__file__).resolve().parent.parent))
    assert "exiting" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 0 and "terminate called" not in done.stderr, (done.returncode, done.stderr[-2000:])
