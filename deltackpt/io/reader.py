"""Reading a step: the base of its chain, then the deltas after it, into a box of a tensor.

A reader fills a destination box (a rank's shard, or the whole tensor) and reads only the parts,
chunks and rows that intersect it. Every chunk read is checked against the size and xxh3-64
checksum in its commit record before its bytes are used, so a restore never returns corrupt data.
The base's chunks are read in parallel; then the deltas', all at once: each delta writes only the
rows and elements no newer delta wrote (see :mod:`.cover`), so no row is copied twice and a
chunk whose rows are all newer elsewhere is not read. Whole-chunk reads land straight in the
destination; edge chunks, coded chunks, partial chunks and delta rows go through the staging
pool, which bounds the memory a restore adds to the tensors it fills.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from functools import partial

import numpy as np
import torch

from ..errors import IntegrityError
from ..format import dtypes
from ..format.layout import chunk_key
from ..format.limits import coded_problem
from ..format.manifest import Manifest, PartRecord, TensorRecord
from ..format.zarr_meta import codec_for
from ..kernels import rowwise
from ..quantization import Rowwise
from ..sharding import Box
from ..storage import Storage
from .cover import RowCover, SpanCover
from .fetch import chunk_path, fetch, stored_size
from .staging import StagingPool

Job = Callable[[], object]


def whole(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


class ChainReader:
    """Replays tensors of one chain.

    Args:
        storage: where the store lives.
        chain: the records from the base to the step to read (see ``Store.chain``).
        pool: staging buffers.
        executor: the I/O threads.
    """

    def __init__(self, storage: Storage, chain: list[Manifest], pool: StagingPool, executor: Executor):
        self._storage = storage
        self._chain = chain
        self._pool = pool
        self._executor = executor
        self._ids: dict[tuple[int, str, str], torch.Tensor] = {}  # a delta part's row ids

    def check_files(self, key: str, box: Box) -> None:
        """Checks that every file of the base parts of ``key`` that intersect ``box`` has its
        recorded size, so a tensor is allocated for ``box`` only once the store's real files
        justify it (the record's grid ties the tensor's bytes to its chunks' sizes)."""
        m, head = self._chain[0], self._chain[-1].tensors.get(key)
        rec = m.tensors.get(key)
        if rec is None or head is None:
            raise IntegrityError(m.step, key, "the tensor is missing from this step's record")
        if (rec.dtype, rec.shape) != (head.dtype, head.shape):
            raise IntegrityError(m.step, key, "dtype or shape differs along the chain")
        for part in rec.parts:
            inter = part.box.intersect(box)
            if inter is not None and inter.numel:
                for name in part.chunks:
                    if name != "zarr.json":
                        stored_size(self._storage, m, key, part, name)

    def read(self, key: str, dest: torch.Tensor, box: Box | None = None) -> None:
        """Fills ``dest`` (CPU, contiguous, of the recorded dtype) with the box ``box`` (default:
        the whole tensor) of ``key``'s value.

        The last full record of the chain (its base) is read first; then the deltas after it,
        newest first, each writing only the rows and elements no newer delta wrote, so every
        delta's reads run at once and no row is copied twice.
        """
        box = box or whole(tuple(dest.shape))
        recs = [self._checked(m, key, dest, box) for m in self._chain]
        start = max((i for i, r in enumerate(recs) if r.encoding == "full"), default=0)
        steps = list(zip(self._chain, recs))[start:]
        base, deltas = (steps[0], steps[1:]) if recs[start].encoding == "full" else (None, steps)
        deltas.reverse()
        hits = [(m, rec, part, inter) for m, rec in deltas for part in rec.parts
                for inter in [part.box.intersect(box)] if inter is not None and inter.numel]
        if len({rec.encoding == "chunks" for _, rec, _, _ in hits}) > 1:
            raise IntegrityError(self._chain[-1].step, key, "dense and row deltas mixed along the chain")
        self._run([partial(self._ids_of, m, key, part) for m, rec, part, _ in hits if rec.encoding != "chunks"])
        rows = RowCover(box, [part.box for _, _, part, _ in hits]) if dest.dim() else None
        spans = SpanCover()
        jobs: list[Job] = []
        for m, rec, part, inter in hits:
            if rec.encoding == "chunks":
                jobs += self._chunks(m, key, part, inter, dest, box, spans)
            elif rec.encoding in ("rows", "qrows") and rows is not None:
                jobs += self._rows(m, key, rec, part, inter, dest, box, rows)
            else:
                raise IntegrityError(m.step, key, f"a {rec.encoding!r} delta of a {dest.dim()}-d tensor")
        if base is not None:
            m, rec = base
            self._run([job for part in rec.parts for inter in [part.box.intersect(box)]
                       if inter is not None and inter.numel
                       for job in self._full(m, key, rec, part, inter, dest, box)])
        self._run(jobs)

    def _checked(self, m: Manifest, key: str, dest: torch.Tensor, box: Box) -> TensorRecord:
        """``key``'s record in step ``m``, once it matches ``dest`` and ``box``."""
        rec = m.tensors.get(key)
        if rec is None:
            raise IntegrityError(m.step, key, "the tensor is missing from this step's record")
        fits = len(rec.shape) == len(box.shape) and (
            not box.numel or whole(rec.shape).intersect(box) == box)
        if dtypes.from_name(rec.dtype) != dest.dtype or not fits:
            raise IntegrityError(m.step, key, "dtype or shape differs along the chain")
        return rec

    def _run(self, jobs: list[Job]) -> None:
        futures: list[Future[object]] = [self._executor.submit(job) for job in jobs]
        error = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - wait for every read before raising
                error = error or e
        if error is not None:
            raise error

    def _staged(self, m: Manifest, key: str, part: PartRecord, name: str, dtype: torch.dtype,
                decoded_bytes: int, use: Callable[[torch.Tensor], None], uncoded: bool = False) -> None:
        """Reads a chunk through a staging buffer, decodes it if coded (``uncoded``: never), and hands
        the uint8 bytes to ``use``."""
        size = stored_size(self._storage, m, key, part, name)
        if uncoded and size != decoded_bytes:
            raise IntegrityError(m.step, chunk_path(m, key, part, name),
                                 f"{size} B, where the record's shapes make {decoded_bytes} B")
        buf = self._pool.acquire(size)
        try:
            fetch(self._storage, m, key, part, name, buf)
            codec = None if uncoded else codec_for(dtype)
            if codec is None:
                use(buf)
                return
            # The header says what it decodes to: check before decompressing (a small chunk
            # with a matching checksum may decode to gigabytes).
            why = coded_problem(buf.numpy(), decoded_bytes)
            if why is not None:
                raise IntegrityError(m.step, chunk_path(m, key, part, name), why)
            raw = np.frombuffer(codec.decode(buf.numpy()), np.uint8)
            if raw.nbytes != decoded_bytes:
                raise IntegrityError(m.step, chunk_path(m, key, part, name), "decodes to a wrong size")
            use(torch.from_numpy(raw.copy()))
        finally:
            self._pool.release(buf)

    def _full(self, m: Manifest, key: str, rec: TensorRecord, part: PartRecord, inter: Box,
              dest: torch.Tensor, box: Box) -> list[Job]:
        dtype = dest.dtype
        if not dest.dim():
            size = dest.element_size()

            def scalar(b: torch.Tensor) -> None:
                dest.view(1).view(torch.uint8).copy_(b[:size])

            return [partial(self._staged, m, key, part, "c", dtype, size, scalar)]
        prows = part.shape[0]
        cr = part.chunk_shape[0]
        rest = part.shape[1:]
        row_bytes = int(np.prod(rest, dtype=np.int64)) * dest.element_size()
        r0 = inter.offset[0] - part.offset[0]
        r1 = r0 + inter.shape[0]
        # Columns of the intersection within the part and within the destination.
        src_cols, dst_cols = inter.slices(part.box)[1:], inter.slices(box)[1:]
        same_cols = part.offset[1:] == box.offset[1:] and rest == box.shape[1:]
        raw = codec_for(dtype) is None
        dest_bytes = dest.reshape(dest.shape[0], -1).view(torch.uint8) if dest.numel() else None
        jobs: list[Job] = []
        for i in range(r0 // cr, -(-r1 // cr)):
            lo, hi = i * cr, min(prows, (i + 1) * cr)
            a, b = max(lo, r0), min(hi, r1)
            name = chunk_key(i, dest.dim())
            d0 = part.offset[0] + a - box.offset[0]
            if raw and same_cols and (a, b) == (lo, hi) and hi - lo == cr and dest_bytes is not None:
                target = dest_bytes[d0 : d0 + (b - a)].reshape(-1)
                jobs.append(partial(fetch, self._storage, m, key, part, name, target))
                continue

            def copy(buf: torch.Tensor, lo=lo, a=a, b=b, d0=d0) -> None:
                rows = buf[: cr * row_bytes].view(dtype).view(cr, *rest)
                dest[(slice(d0, d0 + b - a), *dst_cols)] = rows[(slice(a - lo, b - lo), *src_cols)]

            jobs.append(partial(self._staged, m, key, part, name, dtype, cr * row_bytes, copy))
        return jobs

    def _rows(self, m: Manifest, key: str, rec: TensorRecord, part: PartRecord, inter: Box,
              dest: torch.Tensor, box: Box, cover: RowCover) -> list[Job]:
        """Reads of a row delta's chunks holding rows no newer delta wrote, and their copies; a
        ``qrows`` delta's rows are decoded to the tensor's dtype (the kept rows alone)."""
        rest = part.shape[1:]
        width = int(np.prod(rest, dtype=np.int64))
        if rec.encoding == "qrows":
            rule = Rowwise.from_scheme(rec.lossy.scheme if rec.lossy else None)
            cr, row_bytes = part.chunk_shape
            if row_bytes != rowwise.row_bytes(width, rule.bits, rule.scale_dtype):
                raise IntegrityError(m.step, f"{key} part {part.path!r}",
                                     f"quantized rows of {row_bytes} B do not fit {width} elements at {rule.scheme}")
            folder, dtype, uncoded = "qrows", torch.uint8, True

            def decode(packed: torch.Tensor) -> torch.Tensor:
                return rowwise.dequantize_rows(packed.view(-1, row_bytes), rule.bits, width, dest.dtype,
                                               scale_dtype=rule.scale_dtype).view(-1, *rest)
        else:
            cr = part.chunk_shape[0]
            row_bytes = width * dest.element_size()
            folder, dtype, uncoded = "rows", dest.dtype, False

            def decode(packed: torch.Tensor) -> torch.Tensor:
                return packed.view(dest.dtype).view(-1, *rest)
        ids = self._ids_of(m, key, part)
        # Only the rows inside the destination box: ids are sorted.
        p0 = int(torch.searchsorted(ids, inter.offset[0]))
        p1 = int(torch.searchsorted(ids, inter.offset[0] + inter.shape[0]))
        local = ids[p0:p1] - box.offset[0]
        cells = [(cell.slices(part.box)[1:], cell.slices(box)[1:], keep)
                 for cell, keep in cover.claim(inter, local)]
        jobs: list[Job] = []
        for j in range(p0 // cr, -(-p1 // cr)):
            lo = j * cr
            a, b = max(lo, p0), min(lo + cr, p1)
            picks: list[tuple[tuple[slice, ...], tuple[slice, ...], slice | torch.Tensor, torch.Tensor]] = []
            for src, dst, keep in cells:
                at = keep[a - p0 : b - p0].nonzero().squeeze(1)
                if len(at) == b - a:  # all kept: slices, not index copies
                    picks.append((src, dst, slice(a - lo, b - lo), local[a - p0 : b - p0]))
                elif len(at):
                    picks.append((src, dst, at + (a - lo), local[at + (a - p0)]))
            if not picks:
                continue  # every row of this chunk is written by a newer delta: not read at all

            def copy(buf: torch.Tensor, picks=picks) -> None:
                packed = buf[: cr * row_bytes].view(cr, row_bytes)
                for src, dst, at, rows_at in picks:
                    dest[(slice(None), *dst)].index_copy_(0, rows_at, decode(packed[at])[(slice(None), *src)])

            jobs.append(partial(self._staged, m, key, part, f"{folder}/{chunk_key(j, 2 if uncoded else dest.dim())}",
                                dtype, cr * row_bytes, copy, uncoded=uncoded))
        return jobs

    def _ids_of(self, m: Manifest, key: str, part: PartRecord) -> torch.Tensor:
        """The row ids of a delta part, read once per reader."""
        ids = self._ids.get((m.step, key, part.path))
        if ids is None:
            ids = self._ids[(m.step, key, part.path)] = self._read_ids(m, key, part)
        return ids

    def _read_ids(self, m: Manifest, key: str, part: PartRecord) -> torch.Tensor:
        """All row ids of a delta part (small: 8 bytes a row), checked."""
        n, cr = part.changed, part.chunk_shape[0]
        pieces: list[torch.Tensor] = []
        for i in range(-(-n // cr)):
            count = min(n, (i + 1) * cr) - i * cr

            def take(b: torch.Tensor, c: int = count) -> None:
                pieces.append(b.view(torch.int64)[:c].clone())

            self._staged(m, key, part, f"ids/{chunk_key(i, 1)}", torch.int64, cr * 8, take)
        ids = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
        bad = (ids < part.offset[0]) | (ids >= part.offset[0] + part.shape[0])
        bad[1:] |= ids[1:] <= ids[:-1]
        if bool(bad.any()):
            raise IntegrityError(m.step, chunk_path(m, key, part, "ids"),
                                 "row ids outside the part or not strictly increasing")
        return ids

    def _chunks(self, m: Manifest, key: str, part: PartRecord, inter: Box, dest: torch.Tensor, box: Box,
                cover: SpanCover) -> list[Job]:
        """Reads of a dense delta's chunks holding elements no newer delta wrote, and their copies."""
        (ce,) = part.chunk_shape
        itemsize = dest.element_size()
        pstart = part.offset[0] if part.offset else 0
        pn = part.box.numel
        i0 = (inter.offset[0] if inter.offset else 0) - pstart  # within the part
        i1 = i0 + inter.numel
        dstart = box.offset[0] if box.offset else 0
        flat = dest.reshape(-1).view(torch.uint8)
        raw = codec_for(dest.dtype) is None
        jobs: list[Job] = []
        for name in part.chunks:
            k = int(name[2:]) if name[:2] == "c." and name[2:].isdigit() else -1
            lo, hi = k * ce, min(pn, (k + 1) * ce)
            if k < 0 or lo >= pn:
                raise IntegrityError(m.step, chunk_path(m, key, part, name), "chunk index out of range")
            a, b = max(lo, i0), min(hi, i1)
            if a >= b:
                continue
            free = cover.claim(pstart + a, pstart + b)
            if raw and free == [(pstart + lo, pstart + hi)] and hi - lo == ce:
                d = (pstart + lo - dstart) * itemsize
                jobs.append(partial(fetch, self._storage, m, key, part, name, flat[d : d + ce * itemsize]))
            elif free:
                pieces = [(flat[(x - dstart) * itemsize : (y - dstart) * itemsize], (x - pstart - lo) * itemsize)
                          for x, y in free]
                jobs.append(partial(self._staged, m, key, part, name, dest.dtype, ce * itemsize,
                                    partial(_copy_pieces, pieces)))
        return jobs


def _copy_pieces(pieces: list[tuple[torch.Tensor, int]], buf: torch.Tensor) -> None:
    """Copies the bytes of ``buf`` from each offset on into its target."""
    for target, offset in pieces:
        target.copy_(buf[offset : offset + target.numel()])
