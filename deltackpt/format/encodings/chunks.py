"""``chunks``: a delta's changed dense chunks of a 0-d or 1-d tensor's flat elements."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, cast

import torch

from ... import kernels  # installed from kernels/, see pyproject
from ...errors import IntegrityError, StateError
from .. import dtypes
from ..layout import chunk_key, chunk_path
from .base import (
    Array,
    ChunkSink,
    ChunkSource,
    Encoding,
    REGISTRY,
    Job,
    Packed,
    dense_chunk_elems,
    dense_rows,
    register,
)

if TYPE_CHECKING:
    from ...io.cover import Covers
    from ...io.row_hashes import RowHashes
    from ...quantization import Rowwise
    from ...sharding import Box
    from ..manifest import Manifest, PartRecord, TensorRecord


@register
class Chunks(Encoding):
    """A flat zarr array of the part's elements in chunks of about ``dense_chunk_bytes``, of
    which a delta writes only the chunks that changed."""

    name = "chunks"
    sparse = True
    claims = "spans"

    def chosen(self, kind: str, shape: tuple[int, ...], quantized: bool, aligned: bool) -> bool:
        return kind == "delta" and not quantized and len(shape) < 2 and not (aligned and len(shape) == 1)

    def chunk_shape(self, shape: tuple[int, ...], itemsize: int, changed: int,
                    sizes: tuple[int, int], rule: Rowwise | None) -> tuple[int, ...]:
        return (dense_chunk_elems(math.prod(shape), itemsize, sizes[1]),)

    def fits(self, chunk_shape: tuple[int, ...], shape: tuple[int, ...], changed: int) -> bool:
        return len(chunk_shape) == 1

    def arrays(self, dtype: torch.dtype, shape: tuple[int, ...], chunk_shape: tuple[int, ...],
               changed: int) -> tuple[Array, ...]:
        numel = math.prod(shape)
        return (Array("", (numel,), chunk_shape, dtype, dtypes.compresses(dtype),
                      -(-max(1, numel) // chunk_shape[0])),)

    def encode(self, sink: ChunkSink, key: str, path: str, t: torch.Tensor, changed: torch.Tensor | None,
               chunk_shape: tuple[int, ...], *, row_offset: int = 0,
               hash_into: torch.Tensor | None = None, rule: Rowwise | None = None) -> None:
        """Writes chunks ``changed`` of ``t``'s flat elements into the sink's pack (a delta's
        writer has one; a CPU tensor's in one call, see :meth:`encode_packed`); puts each
        chunk's hash in ``hash_into`` if given."""
        if changed is None:
            raise StateError(f"{key!r}: a {self.name} part needs its changed chunks")
        if t.is_cpu:
            self.encode_packed(sink, [(key, path, t, changed, chunk_shape, row_offset, hash_into)])
            return
        for _, _, name, data, pad in self._chunks(key, path, t, changed, chunk_shape, hash_into):
            sink.put(key, path, name, data, pad, t.dtype)

    def encode_packed(self, sink: ChunkSink, parts: Sequence[Packed]) -> None:
        """:meth:`encode` of ``parts`` (of CPU tensors) at once: their chunks into the pack in one
        call (a delta of the 1,200 small tensors of 300 layer norms and their Adam state spent ~30
        us a part in :meth:`~deltackpt.io.writer.StepWriter.put`'s queueing)."""
        sink.put_packed([chunk for key, path, t, changed, chunk_shape, _, hash_into in parts
                         for chunk in self._chunks(key, path, t, changed, chunk_shape, hash_into)])

    def _chunks(self, key: str, path: str, t: torch.Tensor, changed: torch.Tensor, chunk_shape: tuple[int, ...],
                hash_into: torch.Tensor | None) -> list[tuple[str, str, str, torch.Tensor, int]]:
        """The ``(key, path, name, data, pad)`` of chunks ``changed`` of ``t``'s flat elements,
        each chunk's hash put in ``hash_into`` if given."""
        (chunk_elems,) = chunk_shape
        numel = t.numel()
        flat = t.reshape(-1)
        out = []
        for j, c in enumerate(changed.tolist()):
            lo, hi = c * chunk_elems, min(numel, (c + 1) * chunk_elems)
            if hash_into is not None:
                hash_into[j] = kernels.hash_rows(flat[lo:hi].view(1, -1), threads=1)[0]
            out.append((key, path, chunk_key(c, 1), flat[lo:hi], (chunk_elems - (hi - lo)) * t.element_size()))
        return out

    def read(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord, part: PartRecord,
             inter: Box, dest: torch.Tensor, box: Box, covers: Covers | None,
             hashes: RowHashes | None = None) -> list[Job]:
        """Reads of the chunks holding elements no newer delta wrote, and their copies; with
        ``hashes`` (a 1-d ``dest``, a row an element), the elements written are marked unknown
        (their chunk is not their row)."""
        if covers is None:
            raise IntegrityError(m.step, key, f"a {self.name!r} part is a delta's, not a base's")
        (ce,) = part.chunk_shape
        itemsize = dest.element_size()
        pstart = part.offset[0] if part.offset else 0
        pn = part.box.numel
        i0 = (inter.offset[0] if inter.offset else 0) - pstart  # within the part
        i1 = i0 + inter.numel
        dstart = box.offset[0] if box.offset else 0
        flat = dest.reshape(-1).view(torch.uint8)
        raw = not dtypes.compresses(dest.dtype)
        jobs: list[Job] = []
        for name in part.chunks:
            k = _index(name)
            lo, hi = k * ce, min(pn, (k + 1) * ce)
            if k < 0 or lo >= pn:
                raise IntegrityError(m.step, chunk_path(m, key, part, name), "chunk index out of range")
            a, b = max(lo, i0), min(hi, i1)
            if a >= b:
                continue
            free = covers.spans.claim(pstart + a, pstart + b)
            if raw and free == [(pstart + lo, pstart + hi)] and hi - lo == ce:
                d = (pstart + lo - dstart) * itemsize
                job: Job = partial(source.fetch, m, key, part, name, flat[d : d + ce * itemsize])
            elif free:
                pieces = [(flat[(x - dstart) * itemsize : (y - dstart) * itemsize], (x - pstart - lo) * itemsize)
                          for x, y in free]
                job = partial(source.staged, m, key, part, name, dest.dtype, ce * itemsize,
                              partial(_copy_pieces, pieces))
            else:
                continue
            if hashes is not None:
                job = partial(_unhashed, job, hashes, [slice(x - dstart, y - dstart) for x, y in free])
            jobs.append(job)
        return jobs

    def read_rows(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord,
                  part: PartRecord, want: torch.Tensor, first: int, dest: torch.Tensor) -> list[Job]:
        return dense_rows(source, m, key, part, want, first, dest, sparse=True)

    def changes(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord,
                part: PartRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The changed elements, by element id."""
        dtype = dtypes.from_name(rec.dtype)
        size = dtype.itemsize
        (ce,) = part.chunk_shape
        start = part.offset[0] if part.offset else 0
        total = part.box.numel
        pieces: dict[int, torch.Tensor] = {}

        def keep(k: int, n: int, buf: torch.Tensor) -> None:
            pieces[k] = buf[: ce * size].view(dtype)[:n].clone()

        for name in part.chunks:
            k = _index(name)
            if not 0 <= k * ce < max(total, 1):
                raise IntegrityError(m.step, f"{key}/{name}", "chunk index out of range")
            n = min(ce, total - k * ce)
            source.staged(m, key, part, name, dtype, ce * size, partial(keep, k, n))
        order = sorted(pieces)
        ids = torch.cat([torch.arange(start + k * ce, start + k * ce + pieces[k].numel()) for k in order]) \
            if order else torch.empty(0, dtype=torch.int64)
        values = torch.cat([pieces[k] for k in order]) if order else torch.empty(0, dtype=dtype)
        return ids, values


CHUNKS = cast(Chunks, REGISTRY[Chunks.name])


def _index(name: str) -> int:
    """The index of chunk ``name`` (``c.<k>``), or -1."""
    return int(name[2:]) if name[:2] == "c." and name[2:].isdigit() else -1


def _unhashed(job: Job, hashes: RowHashes, rows: list[slice]) -> None:
    """Runs a read job, then marks the rows (elements) it wrote as unknown to ``hashes``; in the
    job, so after the base's phase has hashed them."""
    job()
    for r in rows:
        hashes.lost(r)


def _copy_pieces(pieces: list[tuple[torch.Tensor, int]], buf: torch.Tensor) -> None:
    """Copies the bytes of ``buf`` from each offset on into its target."""
    for target, offset in pieces:
        target.copy_(buf[offset : offset + target.numel()])
