"""Thread pools whose threads start when a checkpointer is built, not in its first save, jobs
shared between such a pool and the thread that waits for them, and the process's one thread for
work done ahead of the first save (compiling kernels, touching staging buffers).

``ThreadPoolExecutor`` starts a thread on a submit that finds none idle, and ``Thread.start``
waits until the new thread runs: on a busy node each start cost the caller a scheduling delay,
and the I/O threads and the background-save thread started by the first save made it block
several times longer than the saves after it.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

log = logging.getLogger(__name__)


def started_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads named ``prefix``-N, every one of them started.

    Example:
        >>> pool = started_pool(2, "demo")
        >>> len(pool._threads)
        2
        >>> pool.shutdown()
    """
    pool = ThreadPoolExecutor(workers, thread_name_prefix=prefix)
    # Each job holds its thread until all have one, so every submit finds no idle thread.
    everyone = threading.Barrier(workers, timeout=30)
    for _ in range(workers):
        pool.submit(everyone.wait)
    return pool


def run_shared(executor: Executor, jobs: Sequence[Callable[[], object]]) -> None:
    """Runs ``jobs`` on ``executor``'s threads and on this one, and waits for them; raises the
    first error once every job has ended.

    This thread runs every job no I/O thread has started, and waits only for the jobs one has:
    so it never waits on a busy executor, whose threads may be waiting on this one (a pack's
    writer waits for the bytes this thread gathers), and on a node whose cores are busy
    elsewhere, it goes on with the work while the threads it woke wait for a core.
    """
    taken = [threading.Lock() for _ in jobs]
    done = [threading.Event() for _ in jobs]
    errors: list[BaseException | None] = [None] * len(jobs)

    def run(i: int) -> None:
        if not taken[i].acquire(blocking=False):
            return
        try:
            jobs[i]()
        except BaseException as e:  # noqa: BLE001 - raised on the waiting thread
            errors[i] = e
        finally:
            done[i].set()

    futures = [executor.submit(run, i) for i in range(1, len(jobs))]
    for i in range(len(jobs)):
        run(i)
    for f in futures:
        f.cancel()
    for d in done:
        d.wait()
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error


_ahead: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
_ahead_thread: list[threading.Thread] = []
_ahead_lock = threading.Lock()


def run_ahead(job: Callable[[], object]) -> None:
    """Runs ``job`` on the process's one ``deltackpt-warm`` thread, after the jobs queued before
    it; a failure is logged (the save that needs the job's work does it, and raises, itself).

    The interpreter's exit waits for the job running then and drops the others: left running,
    a kernel's parallel worker threads outlive the interpreter, and the process may abort at exit
    ("terminate called without an active exception", status 134; 6 of 12 processes that exited
    right after starting a compile).

    Example:
        >>> done = threading.Event()
        >>> run_ahead(done.set)
        >>> done.wait(10)
        True
    """
    with _ahead_lock:
        if not _ahead_thread:
            thread = threading.Thread(target=_run_ahead, name="deltackpt-warm", daemon=True)
            thread.start()
            _ahead_thread.append(thread)
            atexit.register(_stop_ahead)
    _ahead.put(job)


def _run_ahead() -> None:
    while (job := _ahead.get()) is not None:
        try:
            job()
        except Exception:  # noqa: BLE001 - work ahead of a save; the save does it itself
            log.warning("work ahead of a save failed", exc_info=True)


def _stop_ahead() -> None:
    """At exit: drops the jobs not started and waits for the one running."""
    while True:
        try:
            _ahead.get_nowait()
        except queue.Empty:
            break
    _ahead.put(None)
    _ahead_thread[0].join()


def _forked() -> None:
    """In a forked child, which has no thread of its parent's: a thread of its own at its first job."""
    global _ahead, _ahead_lock
    _ahead, _ahead_lock = queue.SimpleQueue(), threading.Lock()
    if _ahead_thread:
        atexit.unregister(_stop_ahead)
        _ahead_thread.clear()


os.register_at_fork(after_in_child=_forked)
