"""A checkpointer alone on its store does not wait for the writer lease to stage a save: the
lease write runs beside the save, and the save's files wait for it instead, so GC never finds
a file in a folder the lease does not name yet. A save whose head the lease does not keep yet (the
first after a restore) still waits for it before deciding (see test_gc_concurrent)."""

from __future__ import annotations

import threading

import pytest
import torch

from deltackpt import Checkpointer, LocalStorage, WriterConflictError
from deltackpt.format.layout import LEASE
from deltackpt.ops import lease
from deltackpt.storage.faults import FaultInjection


class HeldLease:
    """Once :attr:`armed`, holds every write of the lease until :attr:`go` is set, and notes the
    files of steps written meanwhile."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.held = threading.Event()
        self.go = threading.Event()
        self.early: list[str] = []  # files of a step written while the lease write was held

    def __call__(self, phase: str, key: str) -> None:
        if not self.armed.is_set():
            return
        if phase == "swap" and key == LEASE:
            self.held.set()
            self.go.wait(60)
        elif phase == "write_chunk" and key.startswith("steps/") and self.held.is_set() and not self.go.is_set():
            self.early.append(key)


def save_in_thread(ckpt: Checkpointer, step: int, state: dict) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(ckpt.save(step, state, blocking=False)), daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("first", [True, False], ids=["first save", "later save"])
def test_a_save_returns_while_the_lease_is_written_and_its_files_land_after(tmp_path, first):
    hold = HeldLease()
    state = {"t": torch.arange(4096, dtype=torch.float32).view(256, 16), "step": 1}
    with Checkpointer(FaultInjection(LocalStorage(tmp_path / "s"), hold), base_every=2) as ckpt:
        if not first:
            ckpt.save(1, state)
            state["t"][3] = -1.0
        step = 1 if first else 2
        hold.armed.set()
        try:
            saving, out = save_in_thread(ckpt, step, state)
            assert hold.held.wait(30)
            saving.join(10)
            returned = not saving.is_alive()
            early = list(hold.early)
        finally:
            hold.go.set()
        saving.join(30)
        assert returned, "the save waited for the lease write"
        assert early == []
        info = out[0].result()
        assert ckpt.steps() == ([1] if first else [1, 2])
        assert info.kind == ("base" if first else "delta")
        assert torch.equal(ckpt.load(step)["t"], state["t"])
        holder = lease.read(ckpt.store.storage)[1]
        assert holder is not None and holder.attempt == ckpt.store.manifest(step).attempt


def test_a_save_that_finds_the_lease_held_writes_nothing_and_raises_at_its_result(tmp_path):
    path = tmp_path / "s"
    state = {"t": torch.ones(64, 8)}
    with Checkpointer(path) as holder:
        holder.save(1, state)
        with Checkpointer(path) as other:
            handle = other.save(2, state, blocking=False)
            with pytest.raises(WriterConflictError):
                handle.result()
            assert other.steps() == [1]
        assert sorted(p.name for p in (path / "steps").iterdir()) == sorted(
            ["zarr.json", holder.store.manifest(1).attempt])
