"""Thread pools whose threads start when a checkpointer is built, not in its first save.

``ThreadPoolExecutor`` starts a thread on a submit that finds none idle, and ``Thread.start``
waits until the new thread runs: on a busy node each start cost the caller a scheduling delay,
and the I/O threads and the background-save thread started by the first save made it block
several times longer than the saves after it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


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
