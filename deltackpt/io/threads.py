"""Thread pools whose threads start when a checkpointer is built, not in its first save, and
jobs shared between such a pool and the thread that waits for them.

``ThreadPoolExecutor`` starts a thread on a submit that finds none idle, and ``Thread.start``
waits until the new thread runs: on a busy node each start cost the caller a scheduling delay,
and the I/O threads and the background-save thread started by the first save made it block
several times longer than the saves after it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor


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
