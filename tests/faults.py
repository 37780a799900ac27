"""Fault injection for the crash tests: a storage that dies at a chosen persist point.

Kept apart from the test modules so a forkserver child imports only this, torch and deltackpt.
"""

from __future__ import annotations

import os

import torch

from deltackpt import Checkpointer, LocalStorage, Storage
from deltackpt.storage import FaultInjection

ROWS = 64


class CrashingStorage(FaultInjection):
    """A local store that exits the process, as a kill would, at the ``crash_at``-th persist
    point (never if 0), and records the phase of every persist point it passes."""

    def __init__(self, root, crash_at: int = 0):
        super().__init__(LocalStorage(root), self.at_point)
        self.crash_at = crash_at
        self.phases: list[str] = []

    def at_point(self, phase: str, key: str) -> None:
        self.phases.append(phase)
        if len(self.phases) == self.crash_at:
            os._exit(137)


def state_at(step: int) -> dict:
    """The training state at ``step``: a table and a dense vector changed a little each step."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(ROWS, 8, generator=gen)
    dense = torch.randn(100, generator=gen)
    for s in range(1, step + 1):
        table[s % ROWS] += s
        dense[s] = s
    return {"table": table, "dense": dense, "step": step}


def save(storage: Storage, step: int) -> None:
    """Restores the latest step (so the save can be a delta), then saves ``step``."""
    ckpt = Checkpointer(storage, chunk_bytes=1024, memory_budget=4096, take_over=True)
    latest = ckpt.latest_step()
    if latest is not None:
        ckpt.restore(state_at(latest), latest)
    ckpt.save(step, state_at(step))
    ckpt.close()


def save_with_crash(path: str, crash_at: int, step: int) -> None:
    save(CrashingStorage(path, crash_at), step)


class FaultStorage(FaultInjection):
    """A local store that injects a fault at the ``nth`` persist point of ``phase`` on rank
    ``rank``: ``raise`` (OSError EIO), ``sigkill`` (the process dies) or ``sleep`` (the rank hangs
    ``seconds``)."""

    def __init__(self, root, *, phase: str, rank: int, action: str, nth: int = 1,
                 seconds: float = 60.0):
        super().__init__(LocalStorage(root), self.at_point)
        self.fault = (phase, rank, action, nth, seconds)
        self.count = 0

    def at_point(self, phase: str, key: str) -> None:
        import errno
        import signal
        import time

        import torch.distributed as dist

        want, rank, action, nth, seconds = self.fault
        if phase != want or dist.get_rank() != rank:
            return
        self.count += 1
        if self.count != nth:
            return
        if action == "raise":
            raise OSError(errno.EIO, f"injected I/O error at {phase}")
        if action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "sleep":
            time.sleep(seconds)


class HeldWrites(FaultInjection):
    """A local store whose writes of chunk files of ``key`` pass until ``passing`` of them have
    passed; the later ones wait before their first byte (their staging buffers held) until
    :meth:`open`. ``passed`` counts the writes that went through."""

    def __init__(self, root, *, key: str, passing: int):
        import threading

        super().__init__(LocalStorage(root), self.at_point)
        self.key, self.passing = key, passing
        self.passed = 0
        self.held = 0
        self._gate = threading.Event()
        self._lock = threading.Lock()

    def at_point(self, phase: str, key: str) -> None:
        if phase != "write_chunk" or f"/{self.key}/" not in key or key.endswith("zarr.json"):
            return
        with self._lock:
            wait = self.passed >= self.passing and not self._gate.is_set()
            if wait:
                self.held += 1
            else:
                self.passed += 1
        if wait:
            self._gate.wait(60)

    def open(self) -> None:
        self._gate.set()
