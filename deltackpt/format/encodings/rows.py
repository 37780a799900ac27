"""``rows`` and ``qrows``: a delta's changed rows of a row-sparse part, with their global ids.

A part holds arrays ``ids`` (sorted global row ids, int64) and ``rows`` (those rows, restricted to
the part's columns), or for ``qrows`` (format 3) ``qrows``: each row quantized row-wise into one
fused uint8 row (codes, then scale and bias) by the rule its record's ``lossy`` scheme names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from ... import kernels  # installed from kernels/, see pyproject
from ...errors import IntegrityError, StateError
from ...kernels import rowwise
from ...quantization import QuantizationError, Rowwise
from .. import dtypes
from ..layout import chunk_key
from .base import REGISTRY, Array, ChunkSink, ChunkSource, Encoding, Job, Packed, register, rows_per_chunk

if TYPE_CHECKING:
    from ...io.cover import Covers
    from ...io.row_hashes import RowHashes
    from ...sharding import Box
    from ..lossy import Lossy
    from ..manifest import Manifest, PartRecord, TensorRecord

Index = slice | torch.Tensor


def put_rows(dest: torch.Tensor, at: torch.Tensor, rows: torch.Tensor) -> None:
    """``dest[at] = rows`` (CPU; ``at`` int64 row indices) on the calling thread.

    numpy's indexing on views of the same item size, not torch's ``index_copy_``: torch's wakes
    its thread pool from every I/O thread at once, and copying a delta's kept rows that way took
    about 5x as long (a chain of 64 deltas spent most of its replay on it beyond the reads).
    """
    dtypes.as_bits(dest).numpy()[at.numpy()] = dtypes.as_bits(rows).numpy()


@dataclass(frozen=True)
class RowChunks:
    """How the chunks of a row-sparse part's rows read back.

    Attributes:
        array: the array holding the rows (``rows``, ``qrows``).
        ndim: its dimensions (the chunk keys have as many indices).
        rows: rows per chunk.
        nbytes: the bytes a chunk decodes to.
        dtype: the array's dtype (its chunks are coded as arrays of it are, unless ``uncoded``).
        uncoded: the chunks are raw bytes.
        decode: rows ``index`` of a chunk's decoded bytes, in the tensor's dtype, one per row.
    """

    array: str
    ndim: int
    rows: int
    nbytes: int
    dtype: torch.dtype
    uncoded: bool
    decode: Callable[[torch.Tensor, Index], torch.Tensor]

    def name(self, j: int) -> str:
        return f"{self.array}/{chunk_key(j, self.ndim)}"


@register
class Rows(Encoding):
    """The changed rows of a tensor of two dimensions or more, or the changed elements of a 1-d
    tensor aligned with a table's rows (row-wise optimizer state), in chunks of about
    ``chunk_bytes``."""

    name = "rows"
    claims = "rows"

    def chosen(self, kind: str, shape: tuple[int, ...], quantized: bool, aligned: bool) -> bool:
        return kind == "delta" and not quantized and (len(shape) >= 2 or aligned and len(shape) == 1)

    def chunk_shape(self, shape: tuple[int, ...], itemsize: int, changed: int,
                    sizes: tuple[int, int], rule: Rowwise | None) -> tuple[int, ...]:
        return (rows_per_chunk(changed, math.prod(shape[1:]) * itemsize, sizes[0]), *shape[1:])

    def fits(self, chunk_shape: tuple[int, ...], shape: tuple[int, ...], changed: int) -> bool:
        return len(chunk_shape) == len(shape) >= 1 and changed <= shape[0]

    def arrays(self, dtype: torch.dtype, shape: tuple[int, ...], chunk_shape: tuple[int, ...],
               changed: int) -> tuple[Array, ...]:
        n = -(-changed // chunk_shape[0])
        return (Array("ids", (changed,), chunk_shape[:1], torch.int64, dtypes.compresses(torch.int64), n),
                self._rows_array(dtype, shape, chunk_shape, changed, n))

    def _rows_array(self, dtype: torch.dtype, shape: tuple[int, ...], chunk_shape: tuple[int, ...],
                    changed: int, n: int) -> Array:
        return Array("rows", (changed, *shape[1:]), chunk_shape, dtype, self.coded(dtype), n)

    def coded(self, dtype: torch.dtype) -> bool:
        """Whether the rows' chunks of a tensor of ``dtype`` are blosc coded."""
        return dtypes.compresses(dtype)

    def encode(self, sink: ChunkSink, key: str, path: str, t: torch.Tensor, changed: torch.Tensor | None,
               chunk_shape: tuple[int, ...], *, row_offset: int = 0,
               hash_into: torch.Tensor | None = None, rule: Rowwise | None = None) -> None:
        """Writes the rows ``changed`` of ``t`` as arrays ``ids`` and ``rows`` (``qrows``), each
        row gathered into a staging buffer; each row's hash, of its exact value, goes into
        ``hash_into``.

        Raises:
            QuantizationError: a row to quantize holds inf or NaN (or lies past a float16
                scale's range).
        """
        if changed is None:
            raise StateError(f"{key!r}: a {self.name} part needs its changed rows")
        flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
        row_bytes = flat.shape[1] * t.element_size()
        stored = _stored(changed, row_offset)
        bound = 0.0
        for i, lo, hi, pad_rows in _spans(changed.numel(), chunk_shape[0]):
            ids = changed[lo:hi]
            sink.put(key, path, f"ids/{chunk_key(i, 1)}", stored[lo:hi], pad_rows * 8, torch.int64, kept=True)
            buf = sink.pool.acquire((hi - lo) * row_bytes)
            out = buf.view(t.dtype).view(hi - lo, flat.shape[1])
            try:
                if t.device.type == "cpu":
                    sink.gather(flat, ids, out)
                else:
                    out.copy_(flat.index_select(0, ids.to(t.device)))
            except BaseException:
                sink.pool.release(buf)
                raise
            bound = max(bound, self._put_rows(sink, key, path, i, t.dim(), out, buf, pad_rows,
                                              stored[lo:hi], rule,
                                              None if hash_into is None else hash_into[lo:hi]))
        if self.quantized:
            sink.note_bound(key, bound)

    def encode_packed(self, sink: ChunkSink, parts: Sequence[Packed]) -> None:
        """:meth:`encode` of ``parts`` of small CPU tensors at once: each one's rows gathered into
        memory of its own (not a staging buffer: they are small), and every chunk of ids and rows
        appended to the pack in one call (the 576 small LoRA matrices and Adam moments of a
        12-layer model spent ~45 us a part in :meth:`encode`'s queueing)."""
        chunks: list[tuple[str, str, str, torch.Tensor, int]] = []
        for key, path, t, changed, chunk_shape, row_offset, hash_into in parts:
            src = kernels.small.flat_bytes(t).reshape(t.shape[0], -1)
            rows = torch.from_numpy(np.take(src, changed.numpy(), axis=0)).view(t.dtype)
            stored = _stored(changed, row_offset)
            for i, lo, hi, pad_rows in _spans(changed.numel(), chunk_shape[0]):
                chunks.append((key, path, f"ids/{chunk_key(i, 1)}", stored[lo:hi], pad_rows * 8))
                chunks.append((key, path, f"rows/{chunk_key(i, t.dim())}", rows[lo:hi],
                               pad_rows * rows.shape[1] * rows.element_size()))
            if hash_into is not None:  # every row at once: the chunks' spans cut nothing a hash sees
                hash_into[:] = kernels.hash_rows(rows, threads=1)
        sink.put_packed(chunks)

    def _put_rows(self, sink: ChunkSink, key: str, path: str, i: int, ndim: int, out: torch.Tensor,
                  buf: torch.Tensor, pad_rows: int, ids: torch.Tensor, rule: Rowwise | None,
                  hash_into: torch.Tensor | None) -> float:
        """Queues chunk ``i`` of the rows, gathered in ``out`` (in the staging buffer ``buf``,
        given back once written), their hashes going into ``hash_into`` by the thread that
        writes them; returns the largest bound of its rows (0: exact)."""
        sink.put(key, path, f"rows/{chunk_key(i, ndim)}", out, pad_rows * out.shape[1] * out.element_size(),
                 out.dtype, release=partial(sink.pool.release, buf), uncoded=not self.coded(out.dtype),
                 hash_into=hash_into)
        return 0.0

    def row_chunks(self, m: Manifest, key: str, rec: TensorRecord, part: PartRecord,
                   dtype: torch.dtype) -> RowChunks:
        """How the part's row chunks read back into a tensor of ``dtype``."""
        cr, rest = part.chunk_shape[0], part.shape[1:]
        row_bytes = math.prod(rest) * dtype.itemsize

        def decode(buf: torch.Tensor, index: Index) -> torch.Tensor:
            rows = buf[: cr * row_bytes].view(cr, row_bytes)
            rows = rows[index] if isinstance(index, slice) else torch.from_numpy(rows.numpy()[index.numpy()])
            return rows.view(dtype).view(rows.shape[0], *rest)

        return RowChunks("rows", len(rec.shape), cr, cr * row_bytes, dtype, not self.coded(dtype), decode)

    def read(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord, part: PartRecord,
             inter: Box, dest: torch.Tensor, box: Box, covers: Covers | None,
             hashes: RowHashes | None = None) -> list[Job]:
        """Reads of the chunks holding rows no newer delta wrote, and their copies (a quantized
        delta's kept rows alone decoded); a chunk whose rows newer deltas all wrote is not read.
        With ``hashes``, a row copied into every column of ``box`` is hashed from its decoded
        value."""
        if covers is None or covers.rows is None:
            raise IntegrityError(m.step, key, f"a {self.name!r} delta of a {dest.dim()}-d tensor")
        rc = self.row_chunks(m, key, rec, part, dest.dtype)
        ids = source.ids(m, key, part)
        # Only the rows inside the destination box: ids are sorted.
        p0 = int(torch.searchsorted(ids, inter.offset[0]))
        p1 = int(torch.searchsorted(ids, inter.offset[0] + inter.shape[0]))
        local = ids[p0:p1] - box.offset[0]
        cells = [(cell.slices(part.box)[1:], cell.slices(box)[1:], keep)
                 for cell, keep in covers.rows.claim(inter, local)]
        # A cell as wide as the box writes whole rows of dest.
        whole = len(cells) == 1 and cells[0][1] == tuple(slice(0, n) for n in box.shape[1:])
        cr = rc.rows
        jobs: list[Job] = []
        for j in range(p0 // cr, -(-p1 // cr)):
            lo = j * cr
            a, b = max(lo, p0), min(lo + cr, p1)
            picks: list[tuple[tuple[slice, ...], tuple[slice, ...], Index, torch.Tensor]] = []
            for src, dst, keep in cells:
                at = keep[a - p0 : b - p0].nonzero().squeeze(1)
                if len(at) == b - a:  # all kept: slices, not index copies
                    picks.append((src, dst, slice(a - lo, b - lo), local[a - p0 : b - p0]))
                elif len(at):
                    picks.append((src, dst, at + (a - lo), local[at + (a - p0)]))
            if not picks:
                continue  # every row of this chunk is written by a newer delta: not read at all

            def copy(buf: torch.Tensor, picks: list[tuple[tuple[slice, ...], tuple[slice, ...], Index,
                                                          torch.Tensor]] = picks) -> None:
                for src, dst, at, rows_at in picks:
                    rows = rc.decode(buf, at)[(slice(None), *src)]
                    put_rows(dest[(slice(None), *dst)], rows_at, rows)
                    if hashes is not None and whole:
                        hashes.took(rows_at, rows)
                    elif hashes is not None:
                        hashes.lost(rows_at)

            jobs.append(partial(source.staged, m, key, part, rc.name(j), rc.dtype, rc.nbytes, copy,
                                uncoded=rc.uncoded))
        return jobs

    def read_rows(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord,
                  part: PartRecord, want: torch.Tensor, first: int, dest: torch.Tensor) -> list[Job]:
        stored = source.ids(m, key, part)
        at = torch.searchsorted(stored, want)
        hit = at < stored.numel()
        hit[hit.clone()] = stored[at[hit]] == want[hit]
        where = torch.nonzero(hit).flatten() + first  # positions in dest
        at = at[hit]  # positions in the delta's rows
        cols = tuple(slice(o, o + n) for o, n in zip(part.offset[1:], part.shape[1:]))
        rc = self.row_chunks(m, key, rec, part, dest.dtype)
        groups = at // rc.rows
        jobs: list[Job] = []
        for g in torch.unique(groups).tolist():
            sel = groups == g

            def copy(buf: torch.Tensor, src: torch.Tensor = at[sel] - g * rc.rows,
                     dst: torch.Tensor = where[sel]) -> None:
                index: tuple[torch.Tensor | slice, ...] = (dst, *cols)
                dtypes.as_bits(dest)[index] = dtypes.as_bits(rc.decode(buf, src))

            jobs.append(partial(source.staged, m, key, part, rc.name(g), rc.dtype, rc.nbytes, copy,
                                uncoded=rc.uncoded))
        return jobs

    def changes(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord,
                part: PartRecord) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = dtypes.from_name(rec.dtype)
        ids = source.ids(m, key, part)
        rc = self.row_chunks(m, key, rec, part, dtype)
        cr = rc.rows
        values = torch.empty((ids.numel(), *part.shape[1:]), dtype=dtype)

        def rows(j: int, buf: torch.Tensor) -> None:
            n = min(cr, ids.numel() - j * cr)
            values[j * cr : j * cr + n] = rc.decode(buf, slice(0, n))

        source.run([partial(source.staged, m, key, part, rc.name(j), rc.dtype, rc.nbytes, partial(rows, j),
                            uncoded=rc.uncoded) for j in range(-(-ids.numel() // cr))])
        return ids, values


ROWS = cast(Rows, REGISTRY[Rows.name])


def _stored(changed: torch.Tensor, row_offset: int) -> torch.Tensor:
    """The global ids of rows ``changed`` of a part starting at row ``row_offset``, as written:
    added in numpy (torch's add of 32,768 ids or more wakes its thread pool, 1-8 ms when another
    process holds the cores)."""
    return changed if row_offset == 0 else torch.from_numpy(changed.numpy() + row_offset)


def _spans(n: int, chunk_rows: int) -> Iterator[tuple[int, int, int, int]]:
    """``(i, lo, hi, pad_rows)`` of each chunk ``i`` of ``n`` rows in chunks of ``chunk_rows``:
    rows ``lo:hi``, padded with ``pad_rows`` rows to the full chunk."""
    for i in range(-(-n // chunk_rows)):
        lo, hi = i * chunk_rows, min(n, (i + 1) * chunk_rows)
        yield i, lo, hi, chunk_rows - (hi - lo)


@register
class QRows(Rows):
    """The changed rows quantized row-wise (format 3, only where a ``quantize=`` rule names the
    tensor): array ``qrows`` holds each row's codes, scale and bias as one raw uint8 row."""

    name = "qrows"
    quantized = True

    def chosen(self, kind: str, shape: tuple[int, ...], quantized: bool, aligned: bool) -> bool:
        return kind == "delta" and quantized

    def chunk_shape(self, shape: tuple[int, ...], itemsize: int, changed: int,
                    sizes: tuple[int, int], rule: Rowwise | None) -> tuple[int, ...]:
        if rule is None:
            raise StateError(f"a {self.name} part of shape {list(shape)} needs a quantization rule")
        qbytes = rowwise.row_bytes(math.prod(shape[1:]), rule.bits, rule.scale_dtype)
        return (rows_per_chunk(changed, qbytes, sizes[0]), qbytes)

    def fits(self, chunk_shape: tuple[int, ...], shape: tuple[int, ...], changed: int) -> bool:
        return len(chunk_shape) == 2 and len(shape) >= 2 and changed <= shape[0]

    def _rows_array(self, dtype: torch.dtype, shape: tuple[int, ...], chunk_shape: tuple[int, ...],
                    changed: int, n: int) -> Array:
        return Array("qrows", (changed, chunk_shape[1]), chunk_shape, torch.uint8, False, n)

    def coded(self, dtype: torch.dtype) -> bool:
        return False

    def record_problem(self, dtype: str, lossy: Lossy | None) -> str | None:
        if lossy is None or dtype not in ("float32", "bfloat16", "float16"):
            return f"encoding {self.name!r} needs a 'lossy' record and a float dtype"
        return None

    def _put_rows(self, sink: ChunkSink, key: str, path: str, i: int, ndim: int, out: torch.Tensor,
                  buf: torch.Tensor, pad_rows: int, ids: torch.Tensor, rule: Rowwise | None,
                  hash_into: torch.Tensor | None) -> float:
        if rule is None:
            sink.pool.release(buf)
            raise StateError(f"{key!r}: a {self.name} part needs a quantization rule")
        try:
            if hash_into is not None:  # of the exact rows, before they are quantized
                hash_into.copy_(kernels.hash_rows(out, threads=1).cpu())
            packed, bounds = rowwise.quantize_rows(out, rule.bits, adaptive=rule.adaptive,
                                                   scale_dtype=rule.scale_dtype)
        except rowwise.RowError as e:
            raise QuantizationError(f"{key!r} row {int(ids[e.row])} {e.reason}") from None
        finally:
            sink.pool.release(buf)
        sink.put(key, path, f"qrows/{chunk_key(i, 2)}", packed, pad_rows * packed.shape[1], torch.uint8,
                 uncoded=True)
        return float(bounds.max())

    def row_chunks(self, m: Manifest, key: str, rec: TensorRecord, part: PartRecord,
                   dtype: torch.dtype) -> RowChunks:
        """As :meth:`Rows.row_chunks`, from quantized rows decoded to ``dtype``.

        Raises:
            IntegrityError: the part's row width does not fit its quantization scheme.
        """
        rule = Rowwise.from_scheme(rec.lossy.scheme if rec.lossy else None)
        cr, qbytes = part.chunk_shape
        rest = part.shape[1:]
        width = math.prod(rest)
        if qbytes != rowwise.row_bytes(width, rule.bits, rule.scale_dtype):
            raise IntegrityError(m.step, f"{key} part {part.path!r}",
                                 f"quantized rows of {qbytes} B do not fit {width} elements at {rule.scheme}")

        def decode(buf: torch.Tensor, index: Index) -> torch.Tensor:
            packed = buf[: cr * qbytes].view(cr, qbytes)[index]
            rows = rowwise.dequantize_rows(packed, rule.bits, width, dtype, scale_dtype=rule.scale_dtype)
            return rows.view(packed.shape[0], *rest)

        return RowChunks("qrows", 2, cr, cr * qbytes, torch.uint8, True, decode)

    def verify_chunk(self, rec: TensorRecord, part: PartRecord, name: str, buf: torch.Tensor) -> str | None:
        """A chunk of quantized rows must have a bound in the record that covers every row: half
        a row's scale is the least its bound can be, and scales and biases must be finite."""
        if not name.startswith("qrows/"):
            return None
        rule = Rowwise.from_scheme(rec.lossy.scheme if rec.lossy else None)
        cr, qbytes = part.chunk_shape
        j = int(name.rsplit(".", 2)[-2]) if name.count(".") >= 2 else -1
        count = min(part.changed, (j + 1) * cr) - j * cr
        if j < 0 or count <= 0 or buf.numel() != cr * qbytes:
            return "not a chunk of the part's rows"
        size = rule.scale_dtype.itemsize
        tail = buf.view(cr, qbytes)[:count, qbytes - 2 * size :].reshape(-1).clone().view(rule.scale_dtype)
        scales = tail[0::2].float()
        if not bool(torch.isfinite(tail).all()) or bool((scales < 0).any()):
            return "a row's scale or bias is not finite"
        need = float(scales.max()) / 2 if count else 0.0
        if rec.lossy is None or need > rec.lossy.bound * (1 + 2.0**-20):
            return (f"a row's scale needs a bound of at least {need:.6g}, the record says "
                    f"{rec.lossy.bound if rec.lossy else None}")
        return None
