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


def test_restore_and_load_read_with_the_collector_paused(collector_on, tmp_path, monkeypatch):
    """A collection of a trainer's whole heap in the middle of a restore took as long as the
    restore itself; restores and loads make no reference cycles, so the collector waits."""
    import torch

    from deltackpt import Checkpointer
    from deltackpt.io.reader import ChainReader

    seen = []
    read = ChainReader.run

    def run(self, jobs):
        seen.append(gc.isenabled())
        return read(self, jobs)

    monkeypatch.setattr(ChainReader, "run", run)
    table = torch.arange(64.0).reshape(16, 4)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"t": table})
        table[3] += 1
        ckpt.save(2, {"t": table})
        into = {"t": torch.zeros(16, 4)}
        ckpt.restore(into)
        assert into["t"].equal(table) and ckpt.load(2)["t"].equal(table)
    assert seen and not any(seen)
    assert gc.isenabled()
