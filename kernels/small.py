"""Hashes of small CPU inputs through the ``xxhash`` library, without the compiled kernels.

Loading the compiled kernels costs a fresh process a few tenths of a second even from numba's
cache (importing numba and building its typing context; seconds when the cache is empty), which
would dominate the first save of a small state. The ``xxhash`` library computes the same XXH64
(seed 0) of the same bytes, so inputs of at most :data:`SMALL_BYTES` in at most
:data:`SMALL_PIECES` pieces are hashed here, one library call a piece, with the same results
(tested against :mod:`deltackpt.kernels.reference`).
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

SMALL_BYTES = 1 << 20
"""Inputs of at most this many bytes may be hashed here (a 1 MiB chunk: ~0.1 ms)."""

SMALL_PIECES = 512
"""...in at most this many rows or chunks: one library call each, ~0.5 us apiece."""


def fits(t: torch.Tensor, pieces: int) -> bool:
    """Whether ``t`` (in ``pieces`` rows or chunks) is small enough to be hashed here."""
    return t.device.type == "cpu" and pieces <= SMALL_PIECES and t.numel() * t.element_size() <= SMALL_BYTES


def _hash(b: memoryview, piece: int, n: int) -> torch.Tensor:
    h = xxhash.xxh64_intdigest
    out = np.fromiter((h(b[i * piece : (i + 1) * piece]) for i in range(n)), dtype=np.uint64, count=n)
    return torch.from_numpy(out.view(np.int64))


def flat_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a flat uint8 array (a view where ``t`` is contiguous).

    Through numpy's views where numpy has the dtype: each of torch's views lets go of the GIL and
    takes it back, and when another thread holds it (a training loop) each take waits up to the
    switch interval (5 ms): 2.2-3.7 ms a call through torch's views against 0-0.4 ms through
    numpy's on a thread beside a pure-Python loop (2.5 us against 1.1 us alone)."""
    try:
        a = t.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), or a tensor that requires grad
        return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # a copy only if strided


def hash_rows(t: torch.Tensor) -> torch.Tensor:
    """XXH64 of every row ``t[i]`` of a small CPU tensor, as int64 bit patterns."""
    rows = t.shape[0]
    return _hash(flat_bytes(t).data, t.numel() // rows * t.element_size() if rows else 0, rows)


def hash_chunks(t: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """XXH64 of every ``chunk_bytes`` piece of a small CPU tensor's flat bytes (the last may be short)."""
    return _hash(flat_bytes(t).data, chunk_bytes, -(-t.numel() * t.element_size() // chunk_bytes))


def hash_segments(tensors: list[torch.Tensor], pieces: list[int]) -> torch.Tensor:
    """XXH64 of every ``pieces[i]``-byte piece of each small CPU tensor ``tensors[i]``, one tensor
    after another (the same as :func:`deltackpt.kernels.reference.hash_segments_at`)."""
    h = xxhash.xxh64_intdigest
    out = np.fromiter((h(b[i * p : (i + 1) * p]) for t, p in zip(tensors, pieces)
                       for b in [flat_bytes(t).data] for i in range(len(b) // p)), dtype=np.uint64)
    return torch.from_numpy(out.view(np.int64))
