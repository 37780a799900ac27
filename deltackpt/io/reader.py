"""Reading a step: the base of its chain, then every delta in order, into a box of a tensor.

A reader fills a destination box (a rank's shard, or the whole tensor) and reads only the parts,
chunks and rows that intersect it. Every chunk read is checked against the size and xxh3-64
checksum in its commit record before its bytes are used, so a restore never returns corrupt data.
Chunks of one tensor and step are read in parallel; steps are replayed in order. Whole-chunk reads
land straight in the destination; edge chunks, coded chunks, partial chunks and delta rows go
through the staging pool, which bounds the memory a restore adds to the tensors it fills.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from functools import partial

import numpy as np
import torch
import xxhash

from ..errors import IntegrityError, MissingChunkError
from ..format import dtypes
from ..format.layout import STEPS, chunk_key, part_folder
from ..format.limits import coded_problem
from ..format.manifest import Entry, Manifest, PartRecord, TensorRecord
from ..format.zarr_meta import codec_for
from ..kernels import rowwise
from ..quantization import Rowwise
from ..sharding import Box
from ..storage import Storage
from .staging import StagingPool

Job = Callable[[], None]


def chunk_path(m: Manifest, key: str, part: PartRecord, name: str) -> str:
    """Where a chunk is: its file, or for a chunk in a pack, its name and place in the pack."""
    path = f"{STEPS}/{m.attempt}/{part_folder(key, part.path)}/{name}"
    entry = part.chunks.get(name)
    if part.pack is not None and entry is not None and len(entry) == 3:
        return f"{path} (in {part.pack} at byte {entry[2]})"
    return path


def _pack_files(m: Manifest, pack: str, at: int, size: int) -> list[tuple[str, int, int]]:
    """The files of a pack that bytes ``[at, at + size)`` lie in: (name, offset there, bytes)."""
    chunk = m.pack_chunk(pack)
    out = []
    while size > 0:
        i, within = divmod(at, chunk)
        n = min(size, chunk - within)
        out.append((chunk_key(i, 1), within, n))
        at, size = at + n, size - n
    return out


def _check_size(step: int, path: str, entry: Entry | None, size: int | None) -> int:
    """``size`` (None: the file is absent) once it is the recorded one."""
    if entry is None or size is None:
        raise MissingChunkError(step, path)
    if size != entry[0]:
        raise IntegrityError(step, path, f"{size} bytes on disk, the record says {entry[0]}")
    return size


def file_size(storage: Storage, step: int, path: str, entry: Entry | None) -> int:
    """The recorded size of a file, once the file is known to have it, so no allocation is
    driven by a number read from a damaged record."""
    return _check_size(step, path, entry, storage.size(path))


def stored_size(storage: Storage, m: Manifest, key: str, part: PartRecord, name: str) -> int:
    """The recorded size of a chunk, once its file (or the files of its pack) have theirs."""
    entry = part.chunks.get(name)
    if part.pack is None or entry is None or len(entry) != 3:
        return file_size(storage, m.step, chunk_path(m, key, part, name), entry)
    folder = f"{STEPS}/{m.attempt}/{part.pack}"
    for file, _, _ in _pack_files(m, part.pack, entry[2], entry[0]):
        file_size(storage, m.step, f"{folder}/{file}", m.packs[part.pack].get(file))
    return entry[0]


def fetch(storage: Storage, m: Manifest, key: str, part: PartRecord, name: str,
          into: torch.Tensor) -> None:
    """Reads chunk ``name`` of a part into ``into`` (uint8, exactly the recorded size) and checks
    it against the record.

    Raises:
        MissingChunkError: the record lists no such chunk, or the file is gone.
        IntegrityError: the file's size or checksum differs from the record.
    """
    entry = part.chunks.get(name)
    if part.pack is None or entry is None or len(entry) != 3:
        fetch_file(storage, m.step, chunk_path(m, key, part, name), entry, into)
        return
    view = into.numpy().data
    folder = f"{STEPS}/{m.attempt}/{part.pack}"
    done = 0
    for file, within, n in _pack_files(m, part.pack, entry[2], entry[0]):
        path = f"{folder}/{file}"
        try:
            got = storage.read_into(path, view[done : done + n], within)
        except FileNotFoundError:
            got = None
        _check_size(m.step, path, m.packs[part.pack].get(file), got)
        done += n
    if xxhash.xxh3_64_hexdigest(view) != entry[1]:
        raise IntegrityError(m.step, chunk_path(m, key, part, name), "checksum mismatch")


def fetch_file(storage: Storage, step: int, path: str, entry: Entry | None, into: torch.Tensor) -> None:
    """Reads the file ``path`` into ``into`` (uint8, exactly the recorded size) and checks it
    against its record ``entry`` (None: the record lists no such file)."""
    if entry is None:
        raise MissingChunkError(step, path)
    view = into.numpy().data
    try:
        got = storage.read_into(path, view)
    except FileNotFoundError:
        got = None
    _check_size(step, path, entry, got)
    if xxhash.xxh3_64_hexdigest(view) != entry[1]:
        raise IntegrityError(step, path, "checksum mismatch")


def fetch_file_in_pieces(storage: Storage, step: int, path: str, entry: Entry | None,
                         buf: torch.Tensor) -> None:
    """As :func:`fetch_file`, for a file of any size: reads it through ``buf`` (uint8, any size
    from one byte on) a piece at a time."""
    if entry is None:
        raise MissingChunkError(step, path)
    view = buf.numpy().data
    h = xxhash.xxh3_64()
    at = 0
    while True:
        try:
            got = storage.read_into(path, view, at)
        except FileNotFoundError:
            got = None
        size = _check_size(step, path, entry, got)
        n = min(len(view), size - at)
        h.update(view[:n])
        at += n
        if at >= size:
            break
    if h.hexdigest() != entry[1]:
        raise IntegrityError(step, path, "checksum mismatch")


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
        the whole tensor) of ``key``'s value."""
        box = box or whole(tuple(dest.shape))
        for m in self._chain:
            rec = m.tensors.get(key)
            if rec is None:
                raise IntegrityError(m.step, key, "the tensor is missing from this step's record")
            fits = len(rec.shape) == len(box.shape) and (
                not box.numel or whole(rec.shape).intersect(box) == box)
            if dtypes.from_name(rec.dtype) != dest.dtype or not fits:
                raise IntegrityError(m.step, key, "dtype or shape differs along the chain")
            jobs: list[Job] = []
            for part in rec.parts:
                inter = part.box.intersect(box)
                if inter is not None and inter.numel:
                    make = {"full": self._full, "rows": self._rows, "chunks": self._chunks,
                            "qrows": self._qrows}[rec.encoding]
                    jobs += make(m, key, rec, part, inter, dest, box)
            self._run(jobs)

    def _run(self, jobs: list[Job]) -> None:
        futures: list[Future[None]] = [self._executor.submit(job) for job in jobs]
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
              dest: torch.Tensor, box: Box) -> list[Job]:
        cr = part.chunk_shape[0]
        rest = part.shape[1:]
        row_bytes = int(np.prod(rest, dtype=np.int64)) * dest.element_size()
        ids = self._ids.get((m.step, key, part.path))
        if ids is None:
            ids = self._ids[(m.step, key, part.path)] = self._read_ids(m, key, part)
        # Only the rows inside the destination box: ids are sorted.
        p0 = int(torch.searchsorted(ids, inter.offset[0]))
        p1 = int(torch.searchsorted(ids, inter.offset[0] + inter.shape[0]))
        src_cols, dst_cols = inter.slices(part.box)[1:], inter.slices(box)[1:]
        jobs: list[Job] = []
        for j in range(p0 // cr, -(-p1 // cr)):
            lo = j * cr
            a, b = max(lo, p0), min(lo + cr, p1)
            local = ids[a:b] - box.offset[0]

            def copy(buf: torch.Tensor, lo=lo, a=a, b=b, local=local) -> None:
                rows = buf[: cr * row_bytes].view(dest.dtype).view(cr, *rest)
                dest[(local, *dst_cols)] = rows[(slice(a - lo, b - lo), *src_cols)]

            jobs.append(partial(self._staged, m, key, part, f"rows/{chunk_key(j, dest.dim())}",
                                dest.dtype, cr * row_bytes, copy))
        return jobs

    def _qrows(self, m: Manifest, key: str, rec: TensorRecord, part: PartRecord, inter: Box,
               dest: torch.Tensor, box: Box) -> list[Job]:
        """Like :meth:`_rows`, from quantized rows decoded to the tensor's dtype."""
        rule = Rowwise.from_scheme(rec.lossy.scheme if rec.lossy else None)
        cr, qbytes = part.chunk_shape
        rest = part.shape[1:]
        width = int(np.prod(rest, dtype=np.int64))
        if qbytes != rowwise.row_bytes(width, rule.bits, rule.scale_dtype):
            raise IntegrityError(m.step, f"{key} part {part.path!r}",
                                 f"quantized rows of {qbytes} B do not fit {width} elements at {rule.scheme}")
        ids = self._ids.get((m.step, key, part.path))
        if ids is None:
            ids = self._ids[(m.step, key, part.path)] = self._read_ids(m, key, part)
        p0 = int(torch.searchsorted(ids, inter.offset[0]))
        p1 = int(torch.searchsorted(ids, inter.offset[0] + inter.shape[0]))
        src_cols, dst_cols = inter.slices(part.box)[1:], inter.slices(box)[1:]
        jobs: list[Job] = []
        for j in range(p0 // cr, -(-p1 // cr)):
            lo = j * cr
            a, b = max(lo, p0), min(lo + cr, p1)
            local = ids[a:b] - box.offset[0]

            def copy(buf: torch.Tensor, lo=lo, a=a, b=b, local=local) -> None:
                packed = buf[: cr * qbytes].view(cr, qbytes)[a - lo : b - lo]
                rows = rowwise.dequantize_rows(packed, rule.bits, width, dest.dtype,
                                               scale_dtype=rule.scale_dtype).view(b - a, *rest)
                dest[(local, *dst_cols)] = rows[(slice(None), *src_cols)]

            jobs.append(partial(self._staged, m, key, part, f"qrows/{chunk_key(j, 2)}", torch.uint8,
                                cr * qbytes, copy, uncoded=True))
        return jobs

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

    def _chunks(self, m: Manifest, key: str, rec: TensorRecord, part: PartRecord, inter: Box,
                dest: torch.Tensor, box: Box) -> list[Job]:
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
            d = (pstart + a - dstart) * itemsize
            target = flat[d : d + (b - a) * itemsize]
            if raw and (a, b) == (lo, hi) and hi - lo == ce:
                jobs.append(partial(fetch, self._storage, m, key, part, name, target))
            else:
                jobs.append(partial(self._staged, m, key, part, name, dest.dtype, ce * itemsize,
                                    partial(_copy_at, target, (a - lo) * itemsize)))
        return jobs


def _copy_at(target: torch.Tensor, offset: int, buf: torch.Tensor) -> None:
    """Copies the bytes of ``buf`` from ``offset`` on into ``target``."""
    target.copy_(buf[offset : offset + target.numel()])
