"""Triton kernels: hash, mark and gather rows; hash dense chunks. Bit-identical to the reference.

The hash is XXH64 (seed 0) of raw little-endian bytes, as in :mod:`deltackpt.kernels.reference`.
One lane hashes one piece (a row or a chunk), ``BLOCK`` pieces per program: XXH64 is serial within
a piece, so the parallelism is across pieces. Bytes are loaded as uint8 and assembled into uint64
words, which is exact for any piece size and alignment; when the piece size and base pointer are
multiples of 16, Triton's argument specialisation lets the compiler merge those loads into
vector loads anyway.

The kernels run on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before
triton was imported (that is how the tests run them). Importing this module needs only triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_P1 = tl.constexpr(0x9E3779B185EBCA87)
_P2 = tl.constexpr(0xC2B2AE3D27D4EB4F)
_P3 = tl.constexpr(0x165667B19E3779F9)
_P4 = tl.constexpr(0x85EBCA77C2B2AE63)
_P5 = tl.constexpr(0x27D4EB2F165667C5)

# XXH64 of zero bytes (seed 0) as an int64 bit pattern: rows of zero bytes skip the kernel,
# because an empty tensor may have no storage to point at.
_EMPTY_HASH = 0xEF46DB3751D8E999 - (1 << 64)


@triton.jit
def _rotl(x, r: tl.constexpr):
    return (x << r) | (x >> (64 - r))


@triton.jit
def _round(acc, lane):
    acc = acc + lane * _P2
    return _rotl(acc, 31) * _P1


@triton.jit
def _merge(acc, v):
    acc = acc ^ _round(tl.zeros_like(v), v)
    return acc * _P1 + _P4


@triton.jit
def _load_le(src, p, live, N: tl.constexpr):
    # N bytes at byte offsets p (one per lane) as a little-endian uint64. The bytes of a lane
    # occupy disjoint bit ranges, so summing them is the same as or-ing them.
    k = tl.arange(0, N)
    b = tl.load(src + p[:, None] + k[None, :], mask=live[:, None], other=0).to(tl.uint64)
    return tl.sum(b << (8 * k[None, :]).to(tl.uint64), axis=1)


@triton.jit
def _xxh64_kernel(src, out, start, piece, n_pieces, BLOCK: tl.constexpr):
    """XXH64 of ``n_pieces`` consecutive ``piece``-byte pieces from byte ``start`` of ``src``."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = idx < n_pieces
    p = start + idx * piece

    h = tl.zeros([BLOCK], tl.uint64) + _P5
    if piece >= 32:
        v1 = tl.zeros([BLOCK], tl.uint64) + _P1 + _P2
        v2 = tl.zeros([BLOCK], tl.uint64) + _P2
        v3 = tl.zeros([BLOCK], tl.uint64)
        v4 = tl.zeros([BLOCK], tl.uint64) - _P1
        for _ in range(piece // 32):
            v1 = _round(v1, _load_le(src, p, live, 8))
            v2 = _round(v2, _load_le(src, p + 8, live, 8))
            v3 = _round(v3, _load_le(src, p + 16, live, 8))
            v4 = _round(v4, _load_le(src, p + 24, live, 8))
            p += 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    h += piece

    rem = piece % 32
    for _ in range(rem // 8):
        h = h ^ _round(tl.zeros_like(h), _load_le(src, p, live, 8))
        h = _rotl(h, 27) * _P1 + _P4
        p += 8
    if rem % 8 >= 4:
        h = h ^ (_load_le(src, p, live, 4) * _P1)
        h = _rotl(h, 23) * _P2 + _P3
        p += 4
    for _ in range(rem % 4):
        h = h ^ (tl.load(src + p, mask=live, other=0).to(tl.uint64) * _P5)
        h = _rotl(h, 11) * _P1
        p += 1

    h = h ^ (h >> 33)
    h = h * _P2
    h = h ^ (h >> 29)
    h = h * _P3
    h = h ^ (h >> 32)
    tl.store(out + idx, h.to(tl.int64, bitcast=True), mask=live)


@triton.jit
def _mark_kernel(mask, stride, ids, n_ids, n_rows, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n_ids
    r = tl.load(ids + i, mask=live, other=0).to(tl.int64)
    r = tl.where(r < 0, r + n_rows, r)  # index_fill_ counts negative ids from the end
    tl.store(mask + r * stride, 1, mask=live & (r >= 0) & (r < n_rows))


@triton.jit
def _gather_kernel(
    src, ids, out, n_ids, n_rows, row_words, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = i < n_ids
    r = tl.load(ids + i, mask=live, other=0).to(tl.int64)
    ok = live & (r >= 0) & (r < n_rows)
    # Columns are looped over rather than put on a grid axis: CUDA caps grid axis 1 at 65535.
    for c0 in range(0, row_words, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        in_row = (c < row_words)[None, :]
        v = tl.load(src + r[:, None] * row_words + c[None, :], mask=ok[:, None] & in_row, other=0)
        tl.store(out + i[:, None] * row_words + c[None, :], v, mask=live[:, None] & in_row)


# True when triton was imported with TRITON_INTERPRET=1: the kernels then run on CPU tensors.
INTERPRETED = not isinstance(_xxh64_kernel, triton.runtime.JITFunction)
# The interpreter runs programs one after another at a fixed cost each, so it gets a few wide
# ones; on a GPU one thread per piece (4 warps of 32).
_PIECES_PER_PROGRAM = 1024 if INTERPRETED else 128
_IDS_PER_PROGRAM = 4096 if INTERPRETED else 1024
_GATHER_TILE = 1 << 16 if INTERPRETED else 4096  # ids x words moved per loop step


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            f"imported), got a tensor on {t.device}"
        )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _hash_pieces(b: torch.Tensor, start: int, piece: int, n_pieces: int, out: torch.Tensor) -> None:
    grid = (triton.cdiv(n_pieces, _PIECES_PER_PROGRAM),)
    _xxh64_kernel[grid](b, out, start, piece, n_pieces, BLOCK=_PIECES_PER_PROGRAM)


def hash_rows(t: torch.Tensor) -> torch.Tensor:
    """XXH64 of every row (``t[i]``) of a tensor, as int64 bit patterns.

    Args:
        t: a tensor with at least one dimension; rows are along dimension 0.

    Returns:
        An int64 tensor of ``t.shape[0]`` hashes on ``t``'s device.
    """
    _check_device(t)
    rows = t.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=t.device)
    if rows and t.numel():
        _hash_pieces(_bytes(t), 0, t.numel() // rows * t.element_size(), rows, out)
    elif rows:
        out.fill_(_EMPTY_HASH)
    return out


def hash_chunks(t: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """XXH64 of every ``chunk_bytes`` piece of a tensor's flat bytes; the last may be short.

    Args:
        t: any tensor; its bytes are taken in C order.
        chunk_bytes: the piece size in bytes, positive.

    Returns:
        An int64 tensor of ``ceil(t.nbytes / chunk_bytes)`` hashes on ``t``'s device.
    """
    _check_device(t)
    b = _bytes(t)
    full, rest = divmod(b.numel(), chunk_bytes)
    out = torch.empty(full + (rest > 0), dtype=torch.int64, device=t.device)
    if full:
        _hash_pieces(b, 0, chunk_bytes, full, out)
    if rest:
        # The short last piece has its own length, so it is a launch of its own.
        _hash_pieces(b, full * chunk_bytes, rest, 1, out[full:])
    return out


def mark_rows(mask: torch.Tensor, ids: torch.Tensor) -> None:
    """Sets ``mask[ids] = 1`` in place, as ``mask.index_fill_(0, ids, 1)``.

    Negative ids count from the end, as in ``index_fill_``. Ids outside ``[-len(mask), len(mask))``
    are skipped rather than raised on, because checking them would wait for the device.

    Args:
        mask: a 1-D bool or uint8 tensor.
        ids: int64 or int32 row ids on ``mask``'s device.
    """
    _check_device(mask)
    ids = ids.reshape(-1).contiguous()
    if ids.numel():
        grid = (triton.cdiv(ids.numel(), _IDS_PER_PROGRAM),)
        _mark_kernel[grid](
            mask.view(torch.uint8),
            mask.stride(0),
            ids,
            ids.numel(),
            mask.shape[0],
            BLOCK=_IDS_PER_PROGRAM,
        )


def _word_dtype(row_bytes: int, *ptrs: int) -> torch.dtype:
    # The widest integer that divides the row size and both base addresses, so each lane moves
    # as many bytes as it can.
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if row_bytes % size == 0 and all(p % size == 0 for p in ptrs):
            return dtype
    return torch.uint8


def gather_rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Returns ``t[ids]`` (rows along dimension 0) as a new contiguous tensor.

    Unlike ``index_select``, ids outside ``[0, len(t))`` are not raised on (checking them would
    wait for the device); their output rows are zeros.

    Args:
        t: a tensor with at least one dimension.
        ids: int64 or int32 row ids on ``t``'s device.

    Returns:
        A tensor of shape ``(len(ids), *t.shape[1:])`` and ``t``'s dtype.
    """
    _check_device(t)
    t = t.detach().contiguous()
    ids = ids.reshape(-1).contiguous()
    out = torch.empty((ids.numel(), *t.shape[1:]), dtype=t.dtype, device=t.device)
    if not out.numel():
        return out
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    word = _word_dtype(row_bytes, t.data_ptr(), out.data_ptr())
    src = t.reshape(t.shape[0], -1).view(torch.uint8).view(word)
    dst = out.reshape(out.shape[0], -1).view(torch.uint8).view(word)
    row_words = src.shape[1]
    block_c = min(triton.next_power_of_2(row_words), _GATHER_TILE)
    block_r = _GATHER_TILE // block_c
    grid = (triton.cdiv(ids.numel(), block_r),)
    _gather_kernel[grid](
        src, ids, dst, ids.numel(), t.shape[0], row_words, BLOCK_R=block_r, BLOCK_C=block_c
    )
    return out
