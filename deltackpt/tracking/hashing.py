"""Hashing on a save's own threads: small tensors on the calling thread, large ones split into
pieces shared by the calling thread and as many I/O threads as there are idle cores, so a save
never wakes more threads than it was given, uses the cores that are idle, and leaves to the
calling thread the work of cores that are busy elsewhere.

The compiled kernels could run a large hash in parallel themselves, but their thread pool is
another set of threads beside the I/O threads; splitting the hash into pieces run by the
single-threaded kernel on the I/O threads keeps every thread a save uses in one bounded pool.
"""

from __future__ import annotations

from concurrent.futures import Executor
from functools import partial

import torch

from .. import kernels  # installed from kernels/, see pyproject
from ..io.threads import idle_cores, run_ahead, run_shared

PIECE_BYTES = 1 << 20
"""A split hash's piece: inputs of at least two are split into pieces of about this many bytes,
which the calling thread and the I/O threads take one at a time as each is free (see
:func:`~deltackpt.io.threads.run_shared`). A piece is ~0.1-0.2 ms of hashing (the call costs
~20 us): an idle core takes a share of an input of a few MiB, and a core that becomes busy
elsewhere meanwhile holds back the calling thread by one piece at most. Pieces of the input over
the threads, 4 MiB at least, left 6.4 MB tables to one thread."""


class Hasher:
    """Row and chunk hashes on at most ``threads`` threads of ``executor``.

    A CPU tensor of at least ``2 * PIECE_BYTES`` bytes is split into pieces of about
    ``PIECE_BYTES``, hashed into one result by the caller and up to ``threads - 1`` threads of the
    executor, as many as there are idle cores (:func:`~deltackpt.io.threads.idle_cores`), each
    taking the next piece none has started. Anything smaller, or any input while no core is
    idle, is hashed on the calling thread, and a device tensor by its kernels.

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
        pieces, helpers = self._split(t)
        if pieces <= 1 or not t.shape[0] or self._executor is None:
            return kernels.hash_rows(t, threads=1).cpu()
        t = t.contiguous()
        out = torch.empty(t.shape[0], dtype=torch.int64)
        step = -(-t.shape[0] // pieces)
        run_shared(self._executor, [partial(kernels.reference.hash_rows, t[lo : lo + step], 1, out[lo : lo + step])
                                    for lo in range(0, t.shape[0], step)], helpers)
        return out

    def chunks(self, t: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
        """Every ``chunk_bytes`` piece's hash of ``t``'s flat bytes (see
        :func:`deltackpt.kernels.hash_chunks`), on the CPU."""
        count = -(-t.numel() * t.element_size() // chunk_bytes)
        pieces, helpers = self._split(t)
        pieces = min(pieces, count)
        if pieces <= 1 or self._executor is None:
            return kernels.hash_chunks(t, chunk_bytes, threads=1).cpu()
        flat = t.contiguous().reshape(-1)
        per_chunk = chunk_bytes // t.element_size()
        out = torch.empty(count, dtype=torch.int64)
        step = -(-count // pieces)  # chunks a piece; pieces end on chunk boundaries
        run_shared(self._executor, [partial(kernels.reference.hash_chunks, flat[lo * per_chunk : (lo + step) * per_chunk],
                                            chunk_bytes, 1, out[lo : lo + step])
                                    for lo in range(0, count, step)], helpers)
        return out

    def _split(self, t: torch.Tensor) -> tuple[int, int]:
        """How many pieces to hash ``t`` in, and how many I/O threads to ask for help (1, 0: all
        on this thread)."""
        if self._executor is None or self._threads <= 1 or t.device.type != "cpu":
            return 1, 0
        pieces = t.numel() * t.element_size() // PIECE_BYTES
        if pieces <= 1:
            return 1, 0
        idle = idle_cores()
        helpers = self._threads - 1 if idle is None else min(self._threads - 1, idle)
        return (pieces, helpers) if helpers > 0 else (1, 0)


_warming: list[bool] = []


def warm_kernels() -> None:
    """Compiles the hash and mark kernels once per process, ahead of the first save (see
    :func:`~deltackpt.io.threads.run_ahead`), so the first save does not wait for the compiler."""
    if not _warming:
        _warming.append(True)
        run_ahead(kernels.warm)
