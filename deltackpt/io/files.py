"""The files of a step outside its pack: each written by an I/O thread, with its size and
xxh3-64 checksum recorded for the commit record, in the order that keeps the disk busy.

A large file (a base's chunk, see :data:`APART_BYTES`) is two jobs: its write, and apart from
it, its checksum and whatever else must read its bytes (the hash of each row, which the change
tracker needs). The disk starts on the file at once instead of after the hashing: on a 2-core
VM a 30 MB chunk's rows took 8-50 ms to hash, about as long as the write itself. The jobs wait
in queues, taken in order by the I/O threads (one job asked of them for each one queued) and by
the thread that waits for them all in :meth:`FileWrites.finish`: a large file's write when no
file's bytes are being written (the end of a write, an fsync where its bytes went through the
page cache, may overlap the next one's bytes), else a check, which gives back the staging buffer
the saving thread waits for, else a write, else a small file (a base's zarr metadata: each one's
fsync waits for the journal, and queued first they kept both I/O threads from the first chunk
for 30-60 ms on a busy disk). A writer may bound how many I/O threads run its jobs at once (a
non-blocking save's, to the cores its training leaves idle, until the caller waits for it).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Executor, Future

import xxhash

from ..storage import Storage

APART_BYTES = 1 << 20  # a file at least this large is checked apart from its write
_DISK, _HASH, _REST = range(3)  # the queues, in the order they are taken

Record = Callable[[int, str], None]  # takes a written file's size and checksum


def _nothing() -> None:
    pass


class _Dropped(Exception):
    """A file of an abandoned writer, not written."""


def wait_all(futures: list[Future[None]]) -> BaseException | None:
    """Waits for every one of ``futures`` not cancelled; returns the first error."""
    error = None
    for f in futures:
        if f.cancelled():
            continue
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - every write must end before raising
            error = error or e
    return error


class FileWrites:
    """The file writes of one writer.

    Args:
        storage: where to write.
        executor: the I/O threads.
        gate: every file waits for it before it is written, and fails with its error (see
            :class:`~deltackpt.io.writer.StepWriter`); the checks do not wait.
        hold: the queued files wait for :meth:`start` (a non-blocking save's, until the saving
            thread has staged them all: their writes and hashes would take the cores and the
            memory bandwidth from its copies).
    """

    def __init__(self, storage: Storage, executor: Executor, gate: Future[None] | None = None,
                 *, hold: bool = False):
        self._storage = storage
        self._gate = gate
        self._executor = executor
        self._lock = threading.Lock()
        self._queues: tuple[deque[Callable[[], None]], ...] = (deque(), deque(), deque())
        self._writing = 0  # large files whose bytes are being written
        self._held = 0 if hold else None  # jobs queued while held, no I/O thread asked yet
        self._dropped = False  # abandoned: the queued files are not written
        self._workers: int | None = None  # the most I/O threads running the queued jobs (see bound)
        self._running = 0  # I/O threads asked to run the queued jobs and not done yet
        self._asks: list[Future[None]] = []  # each runs queued jobs until none is left
        self._futures: list[Future[None]] = []  # the files written at once
        self.written: list[str] = []  # every file written, for the directory syncs

    def file(self, path: str, parts: Callable[[], Iterable[memoryview]], record: Record | None,
             release: Callable[[], None] = _nothing, before: Callable[[], None] = _nothing, *,
             at_once: bool = False) -> None:
        """Queues the write of file ``path`` from ``parts()``, after ``before()`` on the same
        thread; ``record`` takes its size and checksum once written, and ``release`` runs once
        the write has ended, done or failed. ``at_once``: on an I/O thread as soon as one is free,
        outside the queues (a pack's file, which holds its thread until the pack ends)."""

        def job() -> None:
            h = xxhash.xxh3_64()
            size = 0

            def hashed() -> Generator[memoryview, None, None]:
                nonlocal size
                for p in parts():
                    h.update(p)
                    size += p.nbytes
                    yield p

            pieces = hashed()
            try:
                self._pass_gate()
                before()
                self._storage.write(path, pieces)
                with self._lock:
                    if record:
                        record(size, h.hexdigest())
                    self.written.append(path)
            finally:
                # Closed here, and with it the stream it reads: a write that failed part way
                # leaves both suspended in its error's frames, a pack's staging buffer with them,
                # for as long as the error is kept.
                pieces.close()
                release()

        if at_once:
            self._futures.append(self._executor.submit(job))
        else:
            self._queue(_REST, job)

    def large(self, path: str, parts: Callable[[], list[memoryview]], record: Record,
              release: Callable[[], None], before: Callable[[], None]) -> None:
        """Queues a large file's write, and apart from it ``before()`` and the file's checksum;
        ``parts()`` gives the same bytes at every call. ``record`` takes the file's size and
        checksum once both jobs have succeeded; ``release`` runs once both have ended."""
        left = [2]
        digest: list[tuple[int, str]] = []
        wrote: list[bool] = []

        def ended() -> None:
            with self._lock:
                left[0] -= 1
                if left[0]:
                    return
                if digest and wrote:
                    record(*digest[0])
            release()

        def write() -> None:
            writing = [True]

            def given() -> Iterator[memoryview]:
                yield from parts()
                self._wrote(writing)

            try:
                self._pass_gate()
                self._storage.write(path, given())
                with self._lock:
                    wrote.append(True)
                    self.written.append(path)
            finally:
                self._wrote(writing)  # if the write failed before its last byte
                ended()

        def check() -> None:
            try:
                if self._dropped:
                    return
                before()
                h = xxhash.xxh3_64()
                size = 0
                for p in parts():
                    h.update(p)
                    size += p.nbytes
                digest.append((size, h.hexdigest()))
            finally:
                ended()

        self._queue(_DISK, write)
        self._queue(_HASH, check)

    def start(self) -> None:
        """Asks the I/O threads for the jobs queued while held; queues the next at once."""
        held, self._held = self._held, None
        for _ in range(held or 0):
            self._ask()

    def bound(self, workers: int | None) -> None:
        """From now on at most ``workers`` I/O threads run the queued jobs at once (any more
        stop after the job they run); None: every one free does, asked now for what is queued."""
        with self._lock:
            self._workers = workers
            queued = sum(map(len, self._queues)) if workers is None and self._held is None else 0
        for _ in range(queued):
            self._ask()

    @property
    def holding(self) -> bool:
        return self._held is not None

    def drop(self) -> None:
        """After a failure: the files queued and not started are not written (their buffers go
        back); waits for the others."""
        self._dropped = True
        self._held = None
        while any(self._queues):
            try:
                self._next()
            except BaseException:  # noqa: BLE001 - dropped: the failure that led here is the one reported
                pass
        self.wait()

    def finish(self, *, helping: bool = True) -> BaseException | None:
        """Runs every queued job no I/O thread has started, then waits for every write; returns
        the first error. Without ``helping``, the I/O threads run the queued jobs first, and this
        thread only any they left: so a non-blocking save's background thread, hashing beside the
        I/O threads, takes no third core from the training beside it."""
        self.start()
        if not helping:
            wait_all(self._asks)  # their errors are the ones wait() returns below
        error = None
        while any(self._queues):
            try:
                self._next()
            except BaseException as e:  # noqa: BLE001 - every buffer must go back
                error = error or e
        for f in self._asks:  # the queues are empty: those not started have nothing to run
            f.cancel()
        return self.wait() or error

    def wait(self) -> BaseException | None:
        """Waits for every write (the I/O threads run every job still queued); returns the
        first error."""
        error = wait_all(self._asks)
        return wait_all(self._futures) or error

    def _pass_gate(self) -> None:
        if self._dropped:
            raise _Dropped
        if self._gate is not None:
            self._gate.result()

    def _queue(self, queue: int, job: Callable[[], None]) -> None:
        self._queues[queue].append(job)
        if self._held is not None:
            self._held += 1
        else:
            self._ask()

    def _ask(self) -> None:
        """Asks an I/O thread to run the queued jobs, unless ``workers`` already are."""
        with self._lock:
            if self._workers is not None and self._running >= self._workers:
                return
            self._running += 1
        self._asks.append(self._executor.submit(self._run))

    def _run(self) -> None:
        """Runs queued jobs until none is left; raises the first error once they ran."""
        error = None
        while (job := self._take(asked=True)) is not None:
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - the next jobs' buffers must go back too
                error = error or e
        if error is not None:
            raise error

    def _next(self) -> None:
        """Runs the next queued job, if any, on this thread."""
        job = self._take()
        if job is not None:
            job()

    def _take(self, *, asked: bool = False) -> Callable[[], None] | None:
        """The next queued job, in the order the module's docstring gives; None if none is left,
        or for an ``asked`` I/O thread beyond the bound, which is then done (one more may be asked)."""
        with self._lock:
            order = (_HASH, _DISK, _REST) if self._writing else (_DISK, _HASH, _REST)
            queue = next((q for q in order if self._queues[q]), None)
            if queue is None or asked and self._workers is not None and self._running > self._workers:
                self._running -= asked
                return None
            if queue == _DISK:
                self._writing += 1
            return self._queues[queue].popleft()

    def _wrote(self, writing: list[bool]) -> None:
        """A large file's bytes have all gone to storage, or its write failed (once a file)."""
        with self._lock:
            if writing[0]:
                writing[0] = False
                self._writing -= 1
