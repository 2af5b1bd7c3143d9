"""app.threads: a page's computing runs in a thread that ends."""

from __future__ import annotations

import threading

import pytest

from app.threads import in_passing_thread
from engine.errors import InputError


def test_in_passing_thread_returns_the_result_from_a_thread_that_has_ended():
    seen = []
    got = in_passing_thread(lambda: seen.append(threading.current_thread()) or 42)
    assert got == 42
    (th,) = seen
    assert th is not threading.current_thread() and not th.is_alive() and th.name == "speedup-lab-load"


def test_in_passing_thread_raises_the_functions_exception_here():
    def bad():
        raise InputError("no such model")

    with pytest.raises(InputError, match="no such model"):
        in_passing_thread(bad)
