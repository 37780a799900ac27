"""The cyclic collector's pause: nested and overlapping sections, and the state it restores."""

from __future__ import annotations

import gc
import threading

import pytest

from deltackpt.collector import paused


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_paused_in_overlapping_sections_and_on_again_after_the_last(collector_on):
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with paused():
        t.start()
        assert inside.wait(10)
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's section is still open
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off_and_errors_pass_through(collector_on):
    gc.disable()

    @paused()
    def fails() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        fails()
    assert not gc.isenabled()
    gc.enable()
    with pytest.raises(KeyError), paused():
        raise KeyError("y")
    assert gc.isenabled()
