"""Hashing on a save's own threads: small tensors on the calling thread, large ones (and the one
call that hashes a state's small tensors together, when it holds megabytes) split into pieces
shared by the calling thread and as many I/O threads as there are idle cores, so a save
never wakes more threads than it was given, uses the cores that are idle, and leaves to the
calling thread the work of cores that are busy elsewhere.

The compiled kernels could run a large hash in parallel themselves, but their thread pool is
another set of threads beside the I/O threads; splitting the hash into pieces run by the
single-threaded kernel on the I/O threads keeps every thread a save uses in one bounded pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from functools import partial

import numpy as np
import torch

from .. import kernels  # installed from kernels/, see pyproject
from ..format.zarr_meta import codec_for
from ..io.threads import idle_cores, run_ahead, run_shared

PIECE_BYTES = 1 << 20
"""The least bytes a split hash gives a job: inputs of at least two are split (a piece is ~0.1-0.2
ms of hashing, the call ~20 us), so an idle core takes a share of a table of a few MiB, and a core
that becomes busy elsewhere meanwhile holds back the calling thread by one piece at most."""

MAX_PIECE_BYTES = 16 << 20
"""The most bytes of a job of a split hash."""

BUSY_SPLIT_BYTES = 16 << 20
"""A share of a split hash that pays for a thread even when other processes hold every core
(~3.5 ms of hashing at this machine's memory speed, against a woken thread's wait for a core of
about a millisecond), so it is split whatever :func:`~deltackpt.io.threads.idle_cores` says: the
140 MiB of dense weights a 1% delta of ``bench/bench_busy.py`` hashes took 65 ms on the calling
thread alone and 35 ms on two threads with both cores busy elsewhere (16 ms on idle cores)."""

JOBS_PER_THREAD = 8
"""Jobs a split hash aims at for each thread: a 512 MiB table in 1 MiB pieces took 66-72 ms on
two threads, in 8 MiB pieces 61 ms (numba's own parallel loop: 51-60 ms)."""


class Hasher:
    """Row and chunk hashes on at most ``threads`` threads of ``executor``.

    A CPU tensor of at least ``2 * PIECE_BYTES`` bytes is split into pieces (about
    ``JOBS_PER_THREAD`` a thread, of ``PIECE_BYTES`` to ``MAX_PIECE_BYTES``), hashed into one result
    by the caller and up to ``threads - 1`` threads of the executor, as many as there are idle
    cores (:func:`~deltackpt.io.threads.idle_cores`), or all of them for large work
    (``BUSY_SPLIT_BYTES`` a thread), each taking the next piece none has started. Anything
    smaller, or smaller work while no core is idle, is hashed on the calling thread, and a device
    tensor by its kernels. :meth:`many` hashes several tensors in one such run, so the threads are
    woken once for them all.

    Args:
        executor: the save's worker threads; None hashes everything on the calling thread.
        threads: how many of them may hash at once.

    Example:
        >>> Hasher().rows(torch.zeros(3, 4)).shape
        torch.Size([3])
    """

    def __init__(self, executor: Executor | None = None, threads: int = 1):
        self._executor = executor
        self._threads = threads if executor is not None else 1

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every row's hash of ``t`` (see :func:`deltackpt.kernels.hash_rows`), on the CPU."""
        return self.many([(t, None)])[0]

    def rows_at(self, inputs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """:meth:`rows` of ``t[ids]`` for each ``(t, ids)`` (``ids`` int64 on the CPU): the rows of a
        contiguous CPU tensor gathered and hashed by one job, the jobs of all of them shared with
        as many I/O threads as :meth:`many` would wake for their bytes. Rows drawn from all over a
        table are gathered at the pace of memory's latency, which a second thread halves: the
        canary's samples of a delta of 8 tables of 524,288 x 128 (1,024 rows each and of their
        sums) took 3.3 ms one table after another, on the calling thread."""
        out: list[torch.Tensor] = []
        jobs: list[Callable[[], object]] = []
        nbytes = 0
        for t, ids in inputs:
            if t.device.type != "cpu" or not t.is_contiguous() or not t.numel() or not ids.numel():
                out.append(self.rows(kernels.gather_rows(t, ids.to(t.device))))
                continue
            src = kernels.reference.flat_bytes(t).reshape(t.shape[0], -1)
            out.append(torch.empty(ids.numel(), dtype=torch.int64))
            jobs.append(partial(_gather_hash, src, ids.numpy(), out[-1].numpy().view(np.uint64)))
            nbytes += ids.numel() * src.shape[1]
        helpers = self._helpers(nbytes) if len(jobs) > 1 else 0
        if helpers:
            assert self._executor is not None  # helpers are its threads
            run_shared(self._executor, jobs, helpers)
        else:
            for job in jobs:
                job()
        return out

    def chunks(self, t: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
        """Every ``chunk_bytes`` piece's hash of ``t``'s flat bytes (see
        :func:`deltackpt.kernels.hash_chunks`), on the CPU."""
        return self.many([(t, chunk_bytes)])[0]

    def many(self, inputs: Sequence[tuple[torch.Tensor, int | None]]) -> list[torch.Tensor]:
        """:meth:`rows` (chunk bytes None) or :meth:`chunks` of each ``(tensor, chunk_bytes)``,
        the pieces of all the large ones in one run: a scan of a few dozen tables of a few MiB
        wakes the I/O threads once, not once a table (each wake-up cost ~0.3 ms of a 1 ms hash)."""
        out: list[torch.Tensor] = []
        jobs: list[Callable[[], object]] = []
        large = sum(t.numel() * t.element_size() for t, _ in inputs if self._large(t))
        helpers = self._helpers(large) if large else 0
        piece = _piece(large, helpers)
        for t, chunk_bytes in inputs:
            if not helpers or not self._large(t):
                out.append((kernels.hash_rows(t, threads=1) if chunk_bytes is None
                            else kernels.hash_chunks(t, chunk_bytes, threads=1)).cpu())
                continue
            if chunk_bytes is None:  # rows
                unit = t.numel() // t.shape[0] * t.element_size()
                count = t.shape[0]
            else:
                unit, count = chunk_bytes, -(-t.numel() * t.element_size() // chunk_bytes)
            out.append(torch.empty(count, dtype=torch.int64))
            jobs += _pieces(t, unit, out[-1], piece)
        if jobs:
            assert self._executor is not None  # helpers are its threads
            run_shared(self._executor, jobs, helpers)
        return out

    def segments(self, segments: kernels.Segments) -> torch.Tensor:
        """``segments.hash()``, split as :meth:`many` splits a large tensor when it holds at least
        two pieces' bytes, in runs of whole tensors: the one call that hashes a state's small
        tensors (35 MB for 20,000 tiny tensors: 16 ms on one thread, 11 ms on two)."""
        helpers = self._helpers(segments.nbytes) if segments.nbytes >= 2 * PIECE_BYTES else 0
        if not helpers:
            return segments.hash()
        assert self._executor is not None  # helpers are its threads
        out = torch.empty(segments.count, dtype=torch.int64)
        run_shared(self._executor, segments.jobs(out, _piece(segments.nbytes, helpers)), helpers)
        return out

    def _large(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is worth splitting: on the CPU, at least two pieces."""
        return t.device.type == "cpu" and t.numel() * t.element_size() >= 2 * PIECE_BYTES

    def _helpers(self, large: int) -> int:
        """How many I/O threads may help hash ``large`` bytes now: ``threads - 1`` when each
        thread's share is at least BUSY_SPLIT_BYTES, else one per idle core, at most that."""
        if self._executor is None or self._threads <= 1:
            return 0
        if large >= BUSY_SPLIT_BYTES * self._threads:
            return self._threads - 1
        idle = idle_cores()
        return max(0, self._threads - 1 if idle is None else min(self._threads - 1, idle))


def _piece(nbytes: int, helpers: int) -> int:
    """The bytes of a job of a split hash of ``nbytes`` on ``helpers`` threads and the caller:
    about JOBS_PER_THREAD jobs a thread, none under PIECE_BYTES (a job costs two hand-offs of the
    GIL, ~20 us each, and the last one keeps one thread while the others are done)."""
    return min(MAX_PIECE_BYTES, max(PIECE_BYTES, nbytes // (JOBS_PER_THREAD * (helpers + 1))))


def _pieces(t: torch.Tensor, unit: int, out: torch.Tensor, piece: int) -> list[Callable[[], object]]:
    """Jobs that hash ``t``'s bytes in units of ``unit`` bytes (rows or chunks; the last may be
    short) into ``out``, about ``piece`` bytes a job, each one compiled call on arrays sliced here
    (a job runs no tensor operation, which would keep the thread waiting for the GIL)."""
    b, o = kernels.reference.flat_bytes(t), out.numpy().view(np.uint64)
    step = max(1, piece // unit)  # units a job
    return [partial(kernels.reference.hash_bytes, b[lo * unit : (lo + step) * unit], unit, o[lo : lo + step])
            for lo in range(0, o.shape[0], step)]


def _gather_hash(src: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """Hashes rows ``ids`` of the 2-d uint8 array ``src`` into ``out`` (uint64): gathered by
    numpy, which holds no lock while it copies, then hashed in one compiled call (no tensor
    operation, which would keep the thread waiting for the GIL)."""
    kernels.reference.hash_bytes(np.take(src, ids, axis=0).reshape(-1), src.shape[1], out)


_warming: list[bool] = []


def warm_kernels() -> None:
    """Compiles the hash and mark kernels once per process, ahead of the first save (see
    :func:`~deltackpt.io.threads.run_ahead`), so the first save does not wait for the compiler;
    before them, imports the codec of the ids every delta writes (numcodecs: 30 ms of the first
    delta's blocked time otherwise).

    Both hold the GIL for much of their ~0.5 s, in C calls the switch interval does not cut
    (numcodecs reads the entry points of every installed package, numba loads and links its
    cached kernels): a thread beside them went without it for 0.23-0.37 s of that time, so a
    first background save of 2.4 MiB called right after the checkpointer was built blocked
    66-104 ms, the saves right after it 2-5 ms; one called after a second of matrix products
    3.0-3.6 ms, as long as the saves after it that came as long after the last one committed."""
    if not _warming:
        _warming.append(True)
        run_ahead(partial(codec_for, torch.int64))
        run_ahead(kernels.warm)
