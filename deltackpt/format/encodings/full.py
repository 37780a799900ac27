"""``full``: a base's part stored whole, one zarr array chunked by rows."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from .. import dtypes
from ..layout import chunk_key
from .base import REGISTRY, Array, ChunkSink, ChunkSource, Encoding, Job, dense_rows, register, rows_per_chunk

if TYPE_CHECKING:
    from ...io.cover import Covers
    from ...io.row_hashes import RowHashes
    from ...quantization import Rowwise
    from ...sharding import Box
    from ..manifest import Manifest, PartRecord, TensorRecord


# A base part of at most this many bytes that is one chunk goes into its writer's pack: a file
# and a folder cost more than a small part's bytes (a base of 20,000 tensors of up to 4 KiB each
# was 40,006 files).
SMALL_PART_BYTES = 1 << 20


def in_pack(shape: tuple[int, ...], itemsize: int, chunk_shape: tuple[int, ...]) -> bool:
    """Whether a base part of ``shape`` (chunked by ``chunk_shape``) lies in its writer's pack:
    one chunk of at most ``SMALL_PART_BYTES``, rather than a zarr array of its own.

    Example:
        >>> in_pack((16, 64), 4, (16, 64)), in_pack((16, 64), 4, (8, 64)), in_pack((), 8, ())
        (True, False, True)
    """
    return math.prod(shape) * itemsize <= SMALL_PART_BYTES and (not shape or chunk_shape[0] >= shape[0])


@register
class Full(Encoding):
    """Every row of the part (its one element, for a 0-d part), in chunks of about
    ``chunk_bytes``; a zarr v3 reader reads the array as it is."""

    name = "full"
    whole = True

    def chosen(self, kind: str, shape: tuple[int, ...], quantized: bool, aligned: bool) -> bool:
        return kind == "base"

    def chunk_shape(self, shape: tuple[int, ...], itemsize: int, changed: int,
                    sizes: tuple[int, int], rule: Rowwise | None) -> tuple[int, ...]:
        if not shape:
            return ()
        return (rows_per_chunk(shape[0], math.prod(shape[1:]) * itemsize, sizes[0]), *shape[1:])

    def fits(self, chunk_shape: tuple[int, ...], shape: tuple[int, ...], changed: int) -> bool:
        return len(chunk_shape) == len(shape)

    def arrays(self, dtype: torch.dtype, shape: tuple[int, ...], chunk_shape: tuple[int, ...],
               changed: int) -> tuple[Array, ...]:
        numel = math.prod(shape)
        n = -(-shape[0] // chunk_shape[0]) if shape and numel else int(not shape)
        return (Array("", shape, chunk_shape, dtype, dtypes.compresses(dtype), n),)

    def encode(self, sink: ChunkSink, key: str, path: str, t: torch.Tensor, changed: torch.Tensor | None,
               chunk_shape: tuple[int, ...], *, row_offset: int = 0,
               hash_into: torch.Tensor | None = None, rule: Rowwise | None = None) -> None:
        """Copies ``t`` chunk by chunk into staging buffers, each written and given back on its
        own (each row hashed into ``hash_into`` by the write threads, if given); a small
        part (:func:`in_pack`) goes into the pack at once instead."""
        if in_pack(tuple(t.shape), t.element_size(), chunk_shape):
            write_block(sink, key, path, t, chunk_shape, hash_into=hash_into, packed=True)
            return
        pool = sink.pool
        rows = t.shape[0] if t.dim() else 1
        flat = t.reshape(rows, math.prod(t.shape[1:]))  # -1 is ambiguous for a tensor without elements
        per_row = flat.shape[1]
        cr = chunk_shape[0] if chunk_shape else 1
        for i in range(-(-rows // cr) if t.numel() else 0):
            lo, hi = i * cr, min(rows, (i + 1) * cr)
            buf = pool.acquire((hi - lo) * per_row * t.element_size())
            try:
                staged = buf.view(t.dtype).view(hi - lo, per_row)
                if t.device.type == "cpu":
                    # numpy, on the writer's threads: torch's copy_ wakes its thread pool, and with
                    # the cores busy elsewhere it copied 32 MiB at 0.73 GB/s where numpy copied 2.8 GB/s.
                    sink.copy(buf.numpy(), flat[lo:hi].reshape(-1).view(torch.uint8).numpy())
                else:
                    staged.copy_(flat[lo:hi])
            except BaseException:
                pool.release(buf)
                raise
            write_block(sink, key, path, staged.view((hi - lo, *t.shape[1:]) if t.dim() else ()),
                        chunk_shape, first_chunk=i, release=partial(pool.release, buf),
                        hash_into=None if hash_into is None else hash_into[lo:hi], packed=False)

    def encode_packed(self, sink: ChunkSink, parts: Sequence[tuple[str, str, torch.Tensor, tuple[int, ...]]]
                      ) -> None:
        """:meth:`encode` of many small parts (:func:`in_pack`; ``(key, path, tensor, chunk
        shape)``, each tensor contiguous on the CPU with elements) at once: their one chunk
        each into the pack, with no row hashes (the change tracker hashes small tensors
        together, see :meth:`~deltackpt.tracking.changes.ChangeTracker.hash_whole`)."""
        chunks = []
        for key, path, t, cs in parts:
            rows = t.shape[0] if t.dim() else 1
            row_bytes = t.numel() // rows * t.element_size()
            chunks.append((key, path, chunk_key(0, t.dim()), t, ((cs[0] if cs else 1) - rows) * row_bytes))
        sink.put_packed(chunks)

    def read(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord, part: PartRecord,
             inter: Box, dest: torch.Tensor, box: Box, covers: Covers | None,
             hashes: RowHashes | None = None) -> list[Job]:
        """Every row the part holds in ``inter`` (a base's; no delta claims from ``covers``):
        whole raw chunks land straight in ``dest``, the others go through a staging buffer."""
        if not dest.dim():
            size = dest.element_size()

            def scalar(b: torch.Tensor) -> None:
                dest.view(1).view(torch.uint8).copy_(b[:size])

            return [partial(source.staged, m, key, part, "c", dest.dtype, size, scalar)]
        jobs = self._reads(source, m, key, part, inter, dest, box)
        if hashes is None:
            return [job for job, _, _ in jobs]
        # A part of the box's columns may have its rows' hashes stored: those of whole rows.
        stored = source.stored_hashes(m, key, part) if _same_columns(part, box) else None
        if stored is not None:
            at = box.offset[0] - part.offset[0]  # row d of dest is row d + at of the part
            return [partial(_given, job, hashes, rows, stored[rows.start + at : rows.stop + at])
                    for job, rows, _ in jobs]
        return [partial(_hashed, job, hashes, dest, rows, whole) for job, rows, whole in jobs]

    def _reads(self, source: ChunkSource, m: Manifest, key: str, part: PartRecord, inter: Box,
               dest: torch.Tensor, box: Box) -> list[tuple[Job, slice, bool]]:
        """:meth:`read`'s jobs for a destination with rows, each with the rows of ``dest`` it
        writes and whether it writes them whole (every column of ``box``)."""
        dtype = dest.dtype
        prows = part.shape[0]
        cr = part.chunk_shape[0]
        rest = part.shape[1:]
        row_bytes = math.prod(rest) * dest.element_size()
        r0 = inter.offset[0] - part.offset[0]
        r1 = r0 + inter.shape[0]
        # Columns of the intersection within the part and within the destination.
        src_cols, dst_cols = inter.slices(part.box)[1:], inter.slices(box)[1:]
        same_cols = _same_columns(part, box)
        whole_rows = inter.offset[1:] == box.offset[1:] and inter.shape[1:] == box.shape[1:]
        raw = not dtypes.compresses(dtype)
        dest_bytes = dest.reshape(dest.shape[0], -1).view(torch.uint8) if dest.numel() else None
        jobs: list[tuple[Job, slice, bool]] = []
        for i in range(r0 // cr, -(-r1 // cr)):
            lo, hi = i * cr, min(prows, (i + 1) * cr)
            a, b = max(lo, r0), min(hi, r1)
            name = chunk_key(i, dest.dim())
            d0 = part.offset[0] + a - box.offset[0]
            if raw and same_cols and (a, b) == (lo, hi) and hi - lo == cr and dest_bytes is not None:
                target = dest_bytes[d0 : d0 + (b - a)].reshape(-1)
                jobs.append((partial(source.fetch, m, key, part, name, target), slice(d0, d0 + b - a), True))
                continue

            def copy(buf: torch.Tensor, lo: int = lo, a: int = a, b: int = b, d0: int = d0) -> None:
                rows = buf[: cr * row_bytes].view(dtype).view(cr, *rest)
                dest[(slice(d0, d0 + b - a), *dst_cols)] = rows[(slice(a - lo, b - lo), *src_cols)]

            jobs.append((partial(source.staged, m, key, part, name, dtype, cr * row_bytes, copy),
                         slice(d0, d0 + b - a), whole_rows))
        return jobs

    def read_rows(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord,
                  part: PartRecord, want: torch.Tensor, first: int, dest: torch.Tensor) -> list[Job]:
        return dense_rows(source, m, key, part, want, first, dest, sparse=False)


FULL = cast(Full, REGISTRY[Full.name])


def _same_columns(part: PartRecord, box: Box) -> bool:
    """Whether ``part`` spans exactly the columns (every dimension but the first) of ``box``."""
    return part.offset[1:] == box.offset[1:] and part.shape[1:] == box.shape[1:]


def _hashed(job: Job, hashes: RowHashes, dest: torch.Tensor, rows: slice, whole_rows: bool) -> None:
    """Runs a read job, then hashes the rows of ``dest`` it wrote whole, on the same thread."""
    job()
    if whole_rows:
        hashes.took(rows, dest[rows])
    else:
        hashes.lost(rows)


def _given(job: Job, hashes: RowHashes, rows: slice, stored: torch.Tensor) -> None:
    """Runs a read job, then takes ``stored`` as the hashes of the rows ``rows`` it wrote whole."""
    job()
    hashes.given(rows, stored)


def write_block(sink: ChunkSink, key: str, path: str, t: torch.Tensor, chunk_shape: tuple[int, ...],
                first_chunk: int = 0, release: Callable[[], None] | None = None,
                hash_into: torch.Tensor | None = None, packed: bool | None = None) -> None:
    """Queues every chunk of ``t``, rows of a ``full`` part from chunk ``first_chunk`` on, already
    in memory that the writes may read; ``release`` runs once all of them are written (without
    it, ``t`` may be a live tensor: a packed chunk is copied before this returns). With
    ``hash_into`` (int64, a slot a row), the write threads put each row's hash there.
    ``packed``: as :meth:`ChunkSink.put` takes it."""
    rows = t.shape[0] if t.dim() else 1
    cr = chunk_shape[0] if chunk_shape else 1
    n = -(-rows // cr) if t.numel() else 0
    if n == 0:  # nothing to write (a tensor without elements has no chunks)
        if release is not None:
            release()
        return
    flat = t.reshape(rows, -1)
    row_bytes = flat.shape[1] * t.element_size()
    left = [n]
    lock = threading.Lock()

    def one_done() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and release is not None:
            release()

    for i in range(n):
        lo, hi = i * cr, min(rows, (i + 1) * cr)
        sink.put(key, path, chunk_key(first_chunk + i, t.dim()), flat[lo:hi],
                 (cr - (hi - lo)) * row_bytes, t.dtype, release=None if release is None else one_done,
                 hash_into=None if hash_into is None else hash_into[lo:hi], packed=packed)
