"""CPU reference kernels: the CPU path and the oracle the Triton kernels are tested against.

The row and chunk hash is XXH64 (seed 0) of the raw little-endian bytes, so every value can be
checked against the ``xxhash`` library. XXH64 was chosen over XXH3 because it is short enough to
write as a Triton kernel that agrees bit for bit, it passes SMHasher, and compiled here it hashes
at 7-8 GB/s per core (see ``bench/bench_kernels.py``), far above any write path.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, uint64

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


@njit(inline="always")
def _rotl(x, r):
    return (x << uint64(r)) | (x >> uint64(64 - r))


@njit(inline="always")
def _round(acc, lane):
    acc += lane * _P2
    return _rotl(acc, 31) * _P1


@njit(inline="always")
def _merge(acc, v):
    acc ^= _round(uint64(0), v)
    return acc * _P1 + _P4


@njit(inline="always")
def _converge(v1, v2, v3, v4):
    h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
    h = _merge(h, v1)
    h = _merge(h, v2)
    h = _merge(h, v3)
    return _merge(h, v4)


@njit(inline="always")
def _avalanche(h):
    h ^= h >> uint64(33)
    h *= _P2
    h ^= h >> uint64(29)
    h *= _P3
    h ^= h >> uint64(32)
    return h


@njit(inline="always")
def _load(b, p, n):
    k = uint64(0)
    for i in range(n):
        k |= uint64(b[p + i]) << uint64(8 * i)
    return k


@njit(inline="always")
def _xxh64(b, start, n):
    p = start
    end = start + n
    if n >= 32:
        v1 = _P1 + _P2
        v2 = _P2
        v3 = uint64(0)
        v4 = uint64(0) - _P1
        stripes = n // 32
        w = b[start : start + stripes * 32].view(np.uint64)
        for s in range(stripes):
            v1 = _round(v1, w[4 * s])
            v2 = _round(v2, w[4 * s + 1])
            v3 = _round(v3, w[4 * s + 2])
            v4 = _round(v4, w[4 * s + 3])
        h = _converge(v1, v2, v3, v4)
        p = start + stripes * 32
    else:
        h = _P5
    h += uint64(n)
    while p + 8 <= end:
        h ^= _round(uint64(0), _load(b, p, 8))
        h = _rotl(h, 27) * _P1 + _P4
        p += 8
    if p + 4 <= end:
        h ^= _load(b, p, 4) * _P1
        h = _rotl(h, 23) * _P2 + _P3
        p += 4
    while p < end:
        h ^= uint64(b[p]) * _P5
        h = _rotl(h, 11) * _P1
        p += 1
    return _avalanche(h)


@njit(inline="always")
def _xxh64_words(w, start, n):
    # XXH64 of n bytes (a multiple of 8) starting at word ``start`` of the uint64 array w: the
    # same function as _xxh64, without per-row array views or byte-by-byte loads.
    p = start
    end = start + n // 8
    if n >= 32:
        v1 = _P1 + _P2
        v2 = _P2
        v3 = uint64(0)
        v4 = uint64(0) - _P1
        for s in range(n // 32):
            v1 = _round(v1, w[p])
            v2 = _round(v2, w[p + 1])
            v3 = _round(v3, w[p + 2])
            v4 = _round(v4, w[p + 3])
            p += 4
        h = _converge(v1, v2, v3, v4)
    else:
        h = _P5
    h += uint64(n)
    while p < end:
        h ^= _round(uint64(0), w[p])
        h = _rotl(h, 27) * _P1 + _P4
        p += 1
    return _avalanche(h)


@njit(parallel=True, cache=True, nogil=True)
def _hash_words(w, piece, total, out):
    # Pieces of ``piece`` bytes (a multiple of 8) of ``total`` bytes (a multiple of 8).
    step = piece // 8
    for i in prange(out.shape[0]):
        out[i] = _xxh64_words(w, i * step, min(piece, total - i * piece))


@njit(parallel=True, cache=True, nogil=True)
def _hash_pieces(b, piece, out):
    # Hashes b in consecutive pieces of `piece` bytes; the last piece may be shorter.
    total = b.shape[0]
    for i in prange(out.shape[0]):
        start = i * piece
        out[i] = _xxh64(b, start, min(piece, total - start))


def _hash(b: np.ndarray, piece: int, out: np.ndarray) -> None:
    # numba's OpenMP threading layer sets the OpenMP thread count that torch uses too: put it
    # back, or training would silently change thread count (and bits) after a save.
    threads = torch.get_num_threads()
    try:
        if piece % 8 == 0 and b.shape[0] % 8 == 0 and b.ctypes.data % 8 == 0:
            _hash_words(b.view(np.uint64), piece, b.shape[0], out)
        else:
            _hash_pieces(b, piece, out)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def hash_rows(t: torch.Tensor) -> torch.Tensor:
    """XXH64 of every row (``t[i]``) of a CPU tensor, as int64 bit patterns."""
    rows = t.shape[0]
    out = np.empty(rows, dtype=np.uint64)
    if rows and t.numel():
        _hash(_bytes(t), t.numel() // rows * t.element_size(), out)
    elif rows:
        out[:] = _EMPTY_HASH
    return torch.from_numpy(out.view(np.int64))


def hash_chunks(t: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """XXH64 of every ``chunk_bytes`` piece of a CPU tensor's flat bytes; the last may be short."""
    nbytes = t.numel() * t.element_size()
    out = np.empty(-(-nbytes // chunk_bytes), dtype=np.uint64)
    if nbytes:
        _hash(_bytes(t), chunk_bytes, out)
    return torch.from_numpy(out.view(np.int64))


@njit(cache=True, nogil=True)
def _mark(mask, ids):
    # mask[ids] = 1, negative ids counting from the end; returns the position of the first id
    # out of range, or -1.
    n = mask.shape[0]
    for i in range(ids.shape[0]):
        j = ids[i]
        if j < 0:
            j += n
        if j < 0 or j >= n:
            return i
        mask[j] = 1
    return -1


def mark_rows(mask: torch.Tensor, ids: torch.Tensor) -> None:
    """Sets ``mask[ids] = 1`` in place; ``ids`` may be int64 or int32, negative ones count from
    the end, and an id out of range raises IndexError."""
    if not (mask.is_contiguous() and ids.is_contiguous() and ids.dim() == 1):
        mask.index_fill_(0, ids.long(), 1)
        return
    # A plain compiled loop: about 2x faster than index_fill_ (1.2 vs 2.1 ns an id here).
    bad = _mark(mask.view(torch.uint8).numpy(), ids.numpy())
    if bad >= 0:
        raise IndexError(f"row id {int(ids[bad])} is out of range for {mask.shape[0]} rows")


def gather_rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Returns ``t[ids]`` as a new tensor."""
    return t.index_select(0, ids)


_EMPTY_HASH = np.uint64(0xEF46DB3751D8E999)  # XXH64 of zero bytes, seed 0
