"""Hashing on a save's own threads: small tensors on the calling thread, large ones split across
the I/O threads and the calling one, so a save never wakes more threads than it was given.

The compiled kernels could run a large hash in parallel themselves, but their thread pool is
another set of threads beside the I/O threads; splitting the hash into pieces run by the
single-threaded kernel on the I/O threads keeps every thread a save uses in one bounded pool.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial

import torch

from .. import kernels  # installed from kernels/, see pyproject
from ..io.threads import run_ahead, run_shared


class Hasher:
    """Row and chunk hashes on at most ``threads`` threads of ``executor``.

    A CPU tensor of at least ``2 * PARALLEL_MIN`` bytes is split into up to ``threads`` pieces
    of at least ``PARALLEL_MIN`` bytes, hashed into one result by the executor and the caller
    (which takes the pieces no I/O thread has started); anything smaller is hashed on the calling
    thread, and a device tensor by its kernels.

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
        pieces = self._pieces(t)
        if pieces <= 1 or not t.shape[0]:
            return kernels.hash_rows(t, threads=1).cpu()
        t = t.contiguous()
        out = torch.empty(t.shape[0], dtype=torch.int64)
        step = -(-t.shape[0] // pieces)
        self._run([partial(kernels.reference.hash_rows, t[lo : lo + step], 1, out[lo : lo + step])
                   for lo in range(0, t.shape[0], step)])
        return out

    def chunks(self, t: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
        """Every ``chunk_bytes`` piece's hash of ``t``'s flat bytes (see
        :func:`deltackpt.kernels.hash_chunks`), on the CPU."""
        pieces = self._pieces(t)
        if pieces <= 1:
            return kernels.hash_chunks(t, chunk_bytes, threads=1).cpu()
        flat = t.contiguous().reshape(-1)
        per_chunk = chunk_bytes // t.element_size()
        out = torch.empty(-(-flat.numel() // per_chunk), dtype=torch.int64)
        step = -(-out.numel() // pieces)  # chunks a piece; pieces end on chunk boundaries
        self._run([partial(kernels.reference.hash_chunks, flat[lo * per_chunk : (lo + step) * per_chunk],
                           chunk_bytes, 1, out[lo : lo + step])
                   for lo in range(0, out.numel(), step)])
        return out

    def _pieces(self, t: torch.Tensor) -> int:
        if self._threads <= 1 or t.device.type != "cpu":
            return 1
        return min(self._threads, t.numel() * t.element_size() // kernels.PARALLEL_MIN)

    def _run(self, jobs: list[Callable[[], torch.Tensor]]) -> None:
        """Runs the pieces (each writes its slice of the result) on the executor and this thread,
        which takes every piece no I/O thread has started (see :func:`run_shared`)."""
        if self._executor is None:
            for job in jobs:
                job()
            return
        run_shared(self._executor, jobs)


_warming: list[bool] = []


def warm_kernels() -> None:
    """Compiles the hash and mark kernels once per process, ahead of the first save (see
    :func:`~deltackpt.io.threads.run_ahead`), so the first save does not wait for the compiler."""
    if not _warming:
        _warming.append(True)
        run_ahead(kernels.warm)
