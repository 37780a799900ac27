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
import collections
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


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


def run_shared(executor: Executor, jobs: Sequence[Callable[[], object]], helpers: int | None = None) -> None:
    """Runs ``jobs`` on ``executor``'s threads and on this one, and waits for them; raises the
    first error once every job has ended.

    Each thread taking part runs the next job none has started until none is left, so this thread
    runs every job no I/O thread has started, and waits only for the jobs one has: so it never
    waits on a busy executor, whose threads may be waiting on this one (a pack's writer waits for
    the bytes this thread gathers), and on a node whose cores are busy elsewhere, it goes on with
    the work while the threads it woke wait for a core. Many small jobs cost a waiting thread at
    most one job per helper, and idle cores share the work as they are free.

    Args:
        executor: the threads that help.
        jobs: run in order of their start, each once.
        helpers: how many of ``executor``'s threads to ask for help (None: one per job but the
            first; more than its threads only queue behind them). An executor that takes no
            more jobs (at the interpreter's exit, which a save in flight outlives) gives none.
    """
    n = len(jobs)
    lock = threading.Lock()
    started = [0]  # jobs claimed, each by one thread
    done = [threading.Event() for _ in jobs]
    errors: list[BaseException | None] = [None] * n

    def claim() -> int:
        with lock:
            started[0] += 1
            return started[0] - 1

    def work() -> None:
        while (i := claim()) < n:
            try:
                jobs[i]()
            except BaseException as e:  # noqa: BLE001 - raised on the waiting thread
                errors[i] = e
            finally:
                done[i].set()

    futures: list[Future[None]] = []
    for _ in range(min(n - 1, n - 1 if helpers is None else helpers)):
        try:
            futures.append(executor.submit(work))
        except RuntimeError:  # shut down (the interpreter is exiting): this thread runs them all
            break
    work()
    for f in futures:
        f.cancel()
    for d in done:
        d.wait()
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error


class Lane(Executor):
    """Runs the jobs submitted to it one at a time, in order, on a thread of ``executor``: the
    work of a thread of its own (a delta's appends to its pack, beside the gathers and the
    pack's write) on threads a save has already, so that it works on no more than it is given.
    The thread it borrows runs its jobs until none is queued. An executor that takes no more
    jobs (at the interpreter's exit) leaves them to the submitting thread.

    Example:
        >>> pool = started_pool(2, "demo")
        >>> Lane(pool).submit(lambda: 7).result()
        7
        >>> pool.shutdown()
    """

    def __init__(self, executor: Executor):
        self._executor = executor
        self._lock = threading.Lock()
        self._queued: collections.deque[tuple[Callable[[], object], Future[object]]] = collections.deque()
        self._running = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        done: Future[Any] = Future()
        with self._lock:
            self._queued.append((partial(fn, *args, **kwargs), done))
            if self._running:
                return done
            self._running = True
        try:
            self._executor.submit(self._drain)
        except RuntimeError:  # shut down: the interpreter is exiting
            self._drain()
        return done

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queued:
                    self._running = False
                    return
                job, done = self._queued.popleft()
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(job())
                except BaseException as e:  # noqa: BLE001 - raised by the future
                    done.set_exception(e)


_LOADAVG = "/proc/loadavg"
_loadavg: list[int] = []  # its descriptor, opened at the first call (none where it is missing)


def cores_beside_training(workers: int) -> int:
    """How many of ``workers`` I/O threads a non-blocking save's writes may keep busy once it has
    returned: the CPUs this process may run on less torch's threads (the training's), at least
    one. On a 2-core VM beside one training thread, one: with two, the steps beside a
    2.2 GB background base took 1.54x their time alone, with one 0.92-1.16x, its call to commit
    with training beside 1.3-1.8x the blocking save's (a wait for it lifts the bound, see
    ``SaveHandle.result``: then 0.9-1.25x; ``bench/bench_async.py``). With
    the large files' writes (which mostly wait for the disk) beside that thread's other jobs,
    the commit took 0.7-1.4x the blocking save's, but the steps beside a base 1.31-1.33x their
    time alone against 1.03-1.15x in the same sitting: the bound counts every job.

    Example:
        >>> 1 <= cores_beside_training(2) <= 2
        True
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(workers, cpus - torch.get_num_threads()))


def idle_cores() -> int | None:
    """How many of the CPUs this process may run on no other process's task needs now, less one
    for this thread (less than zero when other processes' tasks wait for a core): from the
    kernel's count of runnable tasks in ``/proc/loadavg``, less this process's own runnable
    threads; None on a system without it.

    A save asks before it splits work across its threads: an idle core takes a share at once,
    while on a node whose cores are busy elsewhere a woken thread waits for one, and the thread
    that waits for its share with it (with the GIL, possibly, while it waits). This process's own
    threads do not count: the threads a save wakes come from its own bounded pool, and right
    after a training step torch's OpenMP workers spin for milliseconds before they sleep, which
    would make every core look busy at every save (a delta's hashing then ran on one thread).
    """
    if not _loadavg:
        try:
            _loadavg.append(os.open(_LOADAVG, os.O_RDONLY))
        except OSError:
            _loadavg.append(-1)
    if _loadavg[0] < 0:
        return None
    # "0.52 0.58 0.59 3/467 12345": the fourth field is runnable tasks / all tasks.
    running = int(os.pread(_loadavg[0], 128, 0).split()[3].split(b"/")[0])
    return len(os.sched_getaffinity(0)) - 1 - max(0, running - _running_here())


def _running_here() -> int:
    """This process's threads that are runnable now (state R in ``/proc/self/task``), this one
    included: ~50 us for a few threads."""
    n = 0
    try:
        tasks = os.scandir("/proc/self/task")
    except OSError:
        return 1
    with tasks:
        for task in tasks:
            try:
                fd = os.open(f"/proc/self/task/{task.name}/stat", os.O_RDONLY)
            except OSError:
                continue  # ended meanwhile
            try:
                stat = os.read(fd, 512)
            except OSError:
                continue
            finally:
                os.close(fd)
            # "tid (name) S ...": the state follows the name, which may hold spaces and ")".
            end = stat.rfind(b")")
            n += end >= 0 and stat[end + 2 : end + 3] == b"R"
    return max(n, 1)


_ahead: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
_ahead_thread: list[threading.Thread] = []
_ahead_lock = threading.Lock()
_exiting = threading.Event()  # set at the exit of the interpreter (see exiting)


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


def exiting() -> bool:
    """Whether the interpreter is exiting: a job of :func:`run_ahead` that loops (the staging pool's
    warm-up) stops, rather than hold the exit (a process that tracked a 1 GB table and exited at
    once ended 3.2 s after its last line with the warm, 0.7 s stopping it; 0.5 s without one)."""
    return _exiting.is_set()


def _stop_ahead() -> None:
    """At exit: drops the jobs not started and waits for the one running."""
    _exiting.set()
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
