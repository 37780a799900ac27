"""A non-blocking save's writer (``hold``) writes a base's chunk files only once the caller has
staged every chunk, its copies shared with the idle cores' I/O threads meanwhile; while its
held files would leave fewer than two touched staging buffers, it writes them as they come.
Once staged, at most ``workers`` I/O threads write them, until the caller waits for them."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deltackpt import Checkpointer, EveryK, MemoryStorage, checkpointer
from deltackpt.format.encodings import FULL
from deltackpt.io import writer
from deltackpt.io.files import FileWrites
from deltackpt.io.staging import StagingPool
from deltackpt.io.threads import run_ahead
from deltackpt.io.writer import StepWriter

ROWS, COLS = 64, 256  # 64 KiB of float32 a tensor: 4 chunks of 16 KiB


class CountingStorage(MemoryStorage):
    """Counts the chunk files written."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks = 0

    def write(self, key, parts):
        super().write(key, parts)
        self.chunks += "/c." in key


class GatedStorage(CountingStorage):
    """Counts the chunk files written, each once ``gate`` is open (or after 10 s): a chunk the
    caller waited for still counts, and none written after the call can count before the caller
    looks."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def write(self, key, parts):
        if "/c." in key:
            self.gate.wait(10)
        super().write(key, parts)


def stage(w: StepWriter, tables: list[torch.Tensor]) -> None:
    cs = FULL.chunk_shape((ROWS, COLS), 4, ROWS, (16 << 10, 16 << 10), None)
    for i, t in enumerate(tables):
        FULL.encode(w, f"t{i}", "", t, None, cs)


def touched_pool(buffers: int) -> StagingPool:
    pool = StagingPool(buffers, 16 << 10)
    pool.warm(buffers)
    return pool


def held_write(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s four chunks, staged by a writer that holds its files, into touched
    buffers, then written."""
    storage, pool = CountingStorage(), touched_pool(16)
    with ThreadPoolExecutor(2) as ex:
        w = StepWriter(storage, "steps/1-a", pool, ex, hold=True)
        stage(w, [t])
        w.staged()
        w.finish()
    return b"".join(storage.read(f"steps/1-a/t0/c.{c}.0") for c in range(4))


@pytest.mark.parametrize("hold", [True, False])
def test_held_files_are_written_once_staged(hold):
    tables = [torch.randn(ROWS, COLS) + i for i in range(2)]
    want = [t.clone() for t in tables]
    storage, pool = CountingStorage(), touched_pool(16)
    with ThreadPoolExecutor(2) as ex:
        w = StepWriter(storage, "steps/1-a", pool, ex, hold=hold)
        stage(w, tables)
        ex.submit(lambda: None).result()  # the I/O threads have run what they were given
        before = storage.chunks
        w.staged()
        for t in tables:
            t.fill_(-1.0)  # training goes on: the staged copies are written
        files = w.finish()
    assert (before == 0) == hold and storage.chunks == 8
    for i, t in enumerate(want):
        got = b"".join(storage.read(f"steps/1-a/t{i}/c.{c}.0") for c in range(4))
        assert got == t.numpy().tobytes()
        assert sorted(files[(f"t{i}", "")]) == [f"c.{c}.0" for c in range(4)]
    assert all(pool._slots.acquire(timeout=5) for _ in range(16))  # every buffer came back


class SlowStorage(CountingStorage):
    """Counts the files written at once, the most in :attr:`most`, and at each write's start in
    :attr:`starts` (with its time): each write takes 50 ms."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.most = 0
        self.starts: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def write(self, key, parts):
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.starts.append((time.monotonic(), self.now))
        time.sleep(0.05)
        with self._lock:
            self.now -= 1
        super().write(key, parts)


@pytest.mark.parametrize("workers", [1, 2, None])
def test_staged_files_are_written_by_at_most_workers_io_threads(workers):
    storage, pool = SlowStorage(), touched_pool(16)
    tables = [torch.randn(ROWS, COLS) for _ in range(3)]
    with ThreadPoolExecutor(4) as ex:
        w = StepWriter(storage, "steps/1-a", pool, ex, hold=True, workers=workers)
        stage(w, tables)
        w.staged()
        w.finish(helping=False)
    assert storage.chunks == 12 and storage.most == (workers or 4)
    for i, t in enumerate(tables):
        assert b"".join(storage.read(f"steps/1-a/t{i}/c.{c}.0") for c in range(4)) == t.numpy().tobytes()


def test_io_threads_beyond_a_lowered_bound_stop_after_their_job():
    storage = SlowStorage()
    with ThreadPoolExecutor(4) as ex:
        files = FileWrites(storage, ex)
        for i in range(12):
            files.file(f"f/c.{i}", lambda: [memoryview(b"x")], None)
        while not storage.starts:  # some already write
            time.sleep(0.001)
        bounded = time.monotonic()
        files.bound(1)
        assert files.finish(helping=False) is None
    assert storage.chunks == 12
    assert all(now == 1 for at, now in storage.starts if at > bounded)


def test_a_lifted_bound_asks_every_io_thread_for_the_queued_jobs():
    storage = SlowStorage()
    with ThreadPoolExecutor(4) as ex:
        files = FileWrites(storage, ex)
        files.bound(1)
        for i in range(12):
            files.file(f"f/c.{i}", lambda: [memoryview(b"x")], None)
        while not storage.starts:
            time.sleep(0.001)
        lifted = time.monotonic()
        files.bound(None)
        assert files.finish(helping=False) is None
    assert storage.chunks == 12
    assert all(now == 1 for at, now in storage.starts if at < lifted)
    assert max(now for at, now in storage.starts if at > lifted) == 4


def test_held_files_are_written_as_they_come_once_two_touched_buffers_are_left():
    storage, pool = CountingStorage(), touched_pool(5)  # room for 3 held files
    with ThreadPoolExecutor(2) as ex:
        w = StepWriter(storage, "steps/1-a", pool, ex, hold=True)
        stage(w, [torch.randn(ROWS, COLS) for _ in range(2)])  # 8 chunks, more than 5 buffers
        w.finish()
    assert storage.chunks == 8


def test_fresh_buffers_hold_nothing():
    """Copies into fresh memory are slow enough that the writes start beside them."""
    storage, pool = CountingStorage(), StagingPool(16, 16 << 10)
    with ThreadPoolExecutor(2) as ex:
        w = StepWriter(storage, "steps/1-a", pool, ex, hold=True)
        stage(w, [torch.randn(ROWS, COLS)])
        assert w.finish() and storage.chunks == 4


def test_an_abandoned_writer_drops_its_held_files():
    storage, pool = CountingStorage(), touched_pool(16)
    with ThreadPoolExecutor(2) as ex:
        w = StepWriter(storage, "steps/1-a", pool, ex, hold=True)
        stage(w, [torch.randn(ROWS, COLS)])
        w.abandon()
    assert storage.chunks == 0
    assert all(pool._slots.acquire(timeout=5) for _ in range(16))


def test_held_copies_are_shared_with_an_idle_core(monkeypatch):
    monkeypatch.setattr(writer, "COPY_PIECE_BYTES", 4 << 10)
    monkeypatch.setattr(writer, "idle_cores", lambda: 1)
    shared = []
    real = writer.run_shared

    def counted(executor, jobs, helpers=None):
        shared.append((len(jobs), helpers))
        return real(executor, jobs, helpers)

    monkeypatch.setattr(writer, "run_shared", counted)
    t = torch.randn(ROWS, COLS)
    assert held_write(t) == t.numpy().tobytes()
    assert shared == [(8, 1)] * 4  # each 16 KiB chunk in 8 jobs, one helper


def test_a_held_copy_too_small_to_split_asks_for_no_core_count(monkeypatch):
    """Counting idle cores reads a file per thread of the process (15 ms beside the kernels'
    warm-up): a copy under two pieces is made on the calling thread without asking."""
    def refused():
        raise AssertionError("idle_cores() asked for a copy under two pieces")

    monkeypatch.setattr(writer, "idle_cores", refused)
    t = torch.randn(ROWS, COLS)
    assert held_write(t) == t.numpy().tobytes()


def test_a_background_base_into_touched_buffers_writes_after_the_call():
    storage = GatedStorage()
    t = torch.randn(1 << 14, 64)  # 4 MiB: 4 chunks of 1 MiB
    with Checkpointer(storage, policy=EveryK(1), chunk_bytes=1 << 20, memory_budget=16 << 20) as ckpt:
        ckpt.save(0, {"t": t}, blocking=False).result()
        warmed = threading.Event()
        run_ahead(warmed.set)  # after the buffers the first base asked to be touched
        assert warmed.wait(30)
        files = storage.chunks
        storage.gate.clear()
        handle = ckpt.save(1, {"t": t * 2}, blocking=False)
        assert storage.chunks == files  # no chunk written before staging returned
        storage.gate.set()
        assert handle.result().kind == "base" and storage.chunks == files + 4
        assert torch.equal(ckpt.load(1)["t"], t * 2)


class SlowChunks(SlowStorage):
    """:class:`SlowStorage` for chunk files, the others written at once (and not counted)."""

    def write(self, key, parts):
        if "/c." in key:
            super().write(key, parts)
        else:
            MemoryStorage.write(self, key, parts)


T = torch.randn(1 << 14, 64)  # 4 MiB: 4 chunks of 1 MiB


@contextlib.contextmanager
def bounded_to_one(monkeypatch) -> Iterator[tuple[Checkpointer, SlowChunks]]:
    """A checkpointer of 4 I/O threads whose non-blocking saves' writes are bounded to one, on
    :class:`SlowChunks`, after a blocking base of ``T`` and the warm of the buffers it asked for."""
    monkeypatch.setattr(checkpointer, "cores_beside_training", lambda workers: 1)
    storage = SlowChunks()
    with Checkpointer(storage, policy=EveryK(1), chunk_bytes=1 << 20, memory_budget=16 << 20,
                      threads=4, io_threads=4) as ckpt:
        ckpt.save(0, {"t": T})
        assert storage.most > 1  # the blocking base: every I/O thread
        warmed = threading.Event()
        run_ahead(warmed.set)  # after the buffers the first base asked to be touched
        assert warmed.wait(30)
        storage.most = 0
        yield ckpt, storage


def until_done(handle) -> None:
    """Training beside: nobody waits for the save."""
    while not handle.done():
        time.sleep(0.001)


def test_a_background_base_is_written_by_the_cores_training_leaves(monkeypatch):
    """Checkpointer to writer: the bound reaches a non-blocking save's files, not a blocking one's."""
    with bounded_to_one(monkeypatch) as (ckpt, storage):
        handle = ckpt.save(1, {"t": T * 2}, blocking=False)
        until_done(handle)
        assert handle.result().kind == "base"
        assert storage.most == 1 and torch.equal(ckpt.load(1)["t"], T * 2)


@pytest.mark.parametrize("waits", ["result", "wait", "next save"])
def test_waiting_for_a_background_base_lifts_the_bound_on_its_writes(monkeypatch, waits):
    """Once the caller waits for a non-blocking save, every I/O thread writes its files."""
    with bounded_to_one(monkeypatch) as (ckpt, storage):
        handle = ckpt.save(1, {"t": T * 2}, blocking=False)
        if waits == "result":
            assert handle.result().kind == "base"
        elif waits == "wait":
            assert ckpt.wait().kind == "base"
        else:  # itself bounded, written while nobody waits: only the first's writes may be lifted
            second = ckpt.save(2, {"t": T * 3}, blocking=False)
            assert handle.done()
            until_done(second)
            assert ckpt.steps() == [0, 1, 2]
        assert storage.most > 1 and torch.equal(ckpt.load(1)["t"], T * 2)
