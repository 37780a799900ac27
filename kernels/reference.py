"""CPU reference kernels: the CPU path and the oracle the Triton kernels are tested against.

The row and chunk hash is XXH64 (seed 0) of the raw little-endian bytes, so every value can be
checked against the ``xxhash`` library. XXH64 was chosen over XXH3 because it is short enough to
write as a Triton kernel that agrees bit for bit, it passes SMHasher, and compiled here it hashes
at 7.5 GB/s per core in 128 B rows, 11 GB/s in 512 B rows and 14 GB/s in 1 MiB chunks (measured on
the 2-core AMD EPYC dev VM, where a memcpy runs at 13 GB/s; see ``bench/bench_kernels.py``), far
above any write path.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import numba
import numpy as np
import torch
from numba import njit, prange, uint64
from numba.core import cgutils
from numba.extending import intrinsic

from . import PARALLEL_MIN
from .small import flat_bytes

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
def _converge(v):
    h = _rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)
    h = _merge(h, v[0])
    h = _merge(h, v[1])
    h = _merge(h, v[2])
    return _merge(h, v[3])


@njit(inline="always")
def _avalanche(h):
    h ^= h >> uint64(33)
    h *= _P2
    h ^= h >> uint64(29)
    h *= _P3
    h ^= h >> uint64(32)
    return h


@njit(inline="always")
def _lanes():
    # The four lanes' start for seed 0.
    return (_P1 + _P2, _P2, uint64(0), uint64(0) - _P1)


@njit(inline="always")
def _stripe(v, w, p):
    # One 32-byte stripe, words p..p+3 of w, into the four lanes v. Indices into w are uint64,
    # here and in the word functions below: numba checks every signed index for wraparound, a
    # shift, a compare and a cmov per load.
    return (
        _round(v[0], w[p]),
        _round(v[1], w[p + uint64(1)]),
        _round(v[2], w[p + uint64(2)]),
        _round(v[3], w[p + uint64(3)]),
    )


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
        stripes = n // 32
        w = b[start : start + stripes * 32].view(np.uint64)
        v = _lanes()
        for s in range(stripes):
            v = _stripe(v, w, uint64(4 * s))
        h = _converge(v)
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
def _finish_words(w, h, p, end, n):
    # The words p..end-1 left after the stripes, then the final mix.
    h += uint64(n)
    while p < end:
        h ^= _round(uint64(0), w[p])
        h = _rotl(h, 27) * _P1 + _P4
        p += uint64(1)
    return _avalanche(h)


@njit(inline="always")
def _xxh64_words(w, start, n):
    # XXH64 of n bytes (a multiple of 8) starting at word ``start`` of the uint64 array w: the
    # same function as _xxh64, without per-row array views or byte-by-byte loads.
    p = uint64(start)
    end = p + uint64(n // 8)
    if n >= 32:
        v = _lanes()
        for _ in range(n // 32):
            v = _stripe(v, w, p)
            p += uint64(4)
        h = _converge(v)
    else:
        h = _P5
    return _finish_words(w, h, p, end, n)


@njit(inline="always")
def _xxh64_words_pair(w, start, n):
    # _xxh64_words of the two rows of n >= 32 bytes from word ``start``, interleaved so that one
    # row's multiplies fill the latency of the other's converge and avalanche.
    step = uint64(n // 8)
    p = uint64(start)
    q = p + step
    a = _lanes()
    b = _lanes()
    for _ in range(n // 32):
        a = _stripe(a, w, p)
        b = _stripe(b, w, q)
        p += uint64(4)
        q += uint64(4)
    end = uint64(start) + step
    ha = _finish_words(w, _converge(a), p, end, n)
    hb = _finish_words(w, _converge(b), q, end + step, n)
    return ha, hb


@njit(parallel=True, cache=True, nogil=True)
def _hash_words(w, piece, total, out):
    # Pieces of ``piece`` bytes (a multiple of 8) of ``total`` bytes (a multiple of 8). Whole
    # pieces first, so that their length is loop-invariant, then the short last one if any: a
    # min(piece, total - i * piece) in the loop cost a multiply and spills a piece.
    step = piece // 8
    full = total // piece
    # Pieces of 32-256 bytes go two at a time: 128 B rows 7.2 -> 7.4 GB/s and 256 B rows 9.35 ->
    # 9.65 GB/s on one core here. Not longer ones: 512 B did not gain, and from 544 B (17 stripes)
    # on pairing halved the speed on this AMD EPYC (1 KiB rows 12.6 -> 6.0 GB/s).
    pairs = full // 2 if 32 <= piece <= 256 else 0
    for j in prange(pairs):
        out[2 * j], out[2 * j + 1] = _xxh64_words_pair(w, 2 * j * step, piece)
    for i in prange(2 * pairs, full):
        out[i] = _xxh64_words(w, i * step, piece)
    if full < out.shape[0]:
        out[full] = _xxh64_words(w, full * step, total - full * piece)


@njit(parallel=True, cache=True, nogil=True)
def _hash_pieces(b, piece, out):
    # Hashes b in consecutive pieces of `piece` bytes; the last piece may be shorter.
    total = b.shape[0]
    for i in prange(out.shape[0]):
        start = i * piece
        out[i] = _xxh64(b, start, min(piece, total - start))


_NUMBA_THREADS: int = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # the most it runs



def _serial(f: Callable[..., None]) -> Callable[..., None]:
    """The same loop compiled for one thread (prange runs as range): no thread pool is woken.

    Compiled from a copy of the function under its own name: numba's cache files are named by
    the function's qualified name and line, and do not tell a parallel build from a serial one, so
    under the same name whichever variant was compiled first would be loaded for both.
    """
    g = types.FunctionType(f.__code__, f.__globals__, f"{f.__name__}_serial", f.__defaults__, f.__closure__)
    g.__qualname__ = f"{f.__qualname__}_serial"
    return njit(cache=True, nogil=True)(g)


_hash_words_serial = _serial(_hash_words.py_func)
_hash_pieces_serial = _serial(_hash_pieces.py_func)


def _hash(b: np.ndarray, piece: int, out: np.ndarray, threads: int | None) -> None:
    words = piece % 8 == 0 and b.shape[0] % 8 == 0 and b.ctypes.data % 8 == 0
    threads = torch.get_num_threads() if threads is None else threads
    threads = min(threads, _NUMBA_THREADS, b.shape[0] // PARALLEL_MIN)
    if threads <= 1:
        if words:
            _hash_words_serial(b.view(np.uint64), piece, b.shape[0], out)
        else:
            _hash_pieces_serial(b, piece, out)
        return
    # numba's OpenMP threading layer sets the OpenMP thread count that torch uses too: put it
    # back, or training would silently change thread count (and bits) after a save.
    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    try:
        numba.set_num_threads(threads)
        if words:
            _hash_words(b.view(np.uint64), piece, b.shape[0], out)
        else:
            _hash_pieces(b, piece, out)
    finally:
        numba.set_num_threads(numba_threads)
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


def hash_bytes(b: np.ndarray, piece: int, out: np.ndarray) -> None:
    """XXH64 of every ``piece``-byte piece of the flat uint8 array ``b`` (the last may be short)
    into the uint64 array ``out``, on the calling thread: a slice of :func:`flat_bytes` that
    starts on a row or chunk boundary hashes those rows or chunks, in one compiled call."""
    _hash(b, piece, out, 1)


def hash_rows(t: torch.Tensor, threads: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """XXH64 of every row (``t[i]``) of a CPU tensor, as int64 bit patterns, on at most
    ``threads`` threads (None: ``torch.get_num_threads()``; see :data:`PARALLEL_MIN`), into
    ``out`` (a contiguous int64 tensor of ``t.shape[0]``) if given."""
    rows = t.shape[0]
    result = _out(out, rows)
    if rows and t.numel():
        _hash(flat_bytes(t), t.numel() // rows * t.element_size(), result, threads)
    elif rows:
        result[:] = _EMPTY_HASH
    return torch.from_numpy(result.view(np.int64))


@intrinsic
def _pointer(typingctx, address):  # type: ignore[no-untyped-def]
    """The int64 ``address`` as a pointer, to read a tensor's bytes where they lie."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return numba.types.voidptr(numba.types.int64), codegen


@njit(cache=True, nogil=True)
def _hash_segments(addresses, sizes, pieces, out):
    # Segment s is sizes[s] bytes at addresses[s], hashed in pieces of pieces[s] bytes; the
    # hashes go to out one segment after another.
    k = 0
    for s in range(addresses.shape[0]):
        b = numba.carray(_pointer(addresses[s]), (sizes[s],), np.uint8)
        p = pieces[s]
        for i in range(sizes[s] // p):
            out[k] = _xxh64(b, i * p, p)
            k += 1


def addresses_of(tensors: list[torch.Tensor]) -> np.ndarray:
    """Where each tensor's bytes lie now (int64)."""
    return np.fromiter(map(torch.Tensor.data_ptr, tensors), dtype=np.int64, count=len(tensors))


def hash_segments_at(addresses: np.ndarray, sizes: np.ndarray, steps: np.ndarray, out: np.ndarray) -> None:
    """XXH64 of every ``steps[i]``-byte piece of the ``sizes[i]`` bytes at ``addresses[i]`` (a
    contiguous CPU tensor's, where it lies now: no copy; :class:`~deltackpt.kernels.Segments`
    checks), one segment after another, into ``out`` (uint64), in one compiled call that holds
    no lock."""
    _hash_segments(addresses, sizes, steps, out)


def _out(out: torch.Tensor | None, n: int) -> np.ndarray:
    if out is None:
        return np.empty(n, dtype=np.uint64)
    if out.dtype != torch.int64 or out.shape != (n,) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 tensor of {n} elements, got {out.dtype} "
                         f"{tuple(out.shape)}")
    return out.numpy().view(np.uint64)


def hash_chunks(t: torch.Tensor, chunk_bytes: int, threads: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """XXH64 of every ``chunk_bytes`` piece of a CPU tensor's flat bytes (the last may be short),
    on at most ``threads`` threads (None: ``torch.get_num_threads()``), into ``out`` if given."""
    nbytes = t.numel() * t.element_size()
    result = _out(out, -(-nbytes // chunk_bytes))
    if nbytes:
        _hash(flat_bytes(t), chunk_bytes, result, threads)
    return torch.from_numpy(result.view(np.int64))


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


@njit(cache=True, nogil=True)
def _mark_logged(mask, ids, start, log, count):
    # _mark of ids[start:], each id it newly sets (from the start) appended to log[count:];
    # returns (position, count): position -1 once all are set, else that of the first id out of
    # range or of the first new one the full log has no room for (not set yet).
    n = mask.shape[0]
    for i in range(start, ids.shape[0]):
        j = ids[i]
        if j < 0:
            j += n
        if j < 0 or j >= n:
            return i, count
        if mask[j] == 0:
            if count == log.shape[0]:
                return i, count
            mask[j] = 1
            log[count] = j
            count += 1
    return -1, count


def mark_rows_logged(mask: torch.Tensor, ids: torch.Tensor, start: int, log: np.ndarray,
                     count: int) -> tuple[int, int]:
    """:func:`mark_rows` of ``ids[start:]`` (a contiguous 1-D CPU tensor) that also appends
    every id it newly sets, counted from the start, to the int64 array ``log`` after its first
    ``count``: so ``log[:count]`` lists the set rows, each once, without a pass over the mask.
    Returns ``(position, count)``: position -1 once every id is set, else that of the first id
    out of range or of the first new id the full log had no room for (it and those after it are
    not set yet; those before it are set and logged).
    """
    return _mark_logged(mask.view(torch.uint8).numpy(), ids.numpy(), start, log, count)


def gather_rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Returns ``t[ids]`` as a new tensor."""
    return t.index_select(0, ids)


_EMPTY_HASH = np.uint64(0xEF46DB3751D8E999)  # XXH64 of zero bytes, seed 0
