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

import threading
from collections.abc import Callable, Collection
from concurrent.futures import Executor
from functools import partial

import numpy as np
import torch

from ..errors import IntegrityError
from ..format import dtypes
from ..format.encodings import Job
from ..format.hash_files import decode_hashes
from ..format.layout import chunk_key, chunk_path
from ..format.lazy_records import LazyTensors
from ..format.manifest import Manifest, PartRecord, TensorRecord
from ..format.part_tables import path_column
from ..format.record_io import hashes_key
from ..format.zarr_meta import decode
from ..sharding import Box
from ..storage import Storage
from .cover import Covers
from .fetch import fetch, fetch_file, file_size, stored_size
from .row_hashes import RowHashes
from .staging import StagingPool
from .threads import run_shared


INLINE_BYTES = 1 << 16
"""A tensor of at most this many bytes is read on the calling thread: handing its few reads to
the I/O threads and waiting costs more than the reads (a state of 20,000 tiny tensors)."""


def whole(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


def _idle(m: Manifest, keys: Collection[str], like: Manifest) -> frozenset[str]:
    """Of ``keys``, those the delta ``m`` left as they were, whatever the box read, told at
    once (of deltas read from a store; a base leaves none as it was)."""
    ours, theirs = m.tensors, like.tensors
    if keys and m.kind == "delta" and isinstance(ours, LazyTensors) and isinstance(theirs, LazyTensors):
        return ours.idle(keys, theirs)
    return frozenset()


class ChainReader:
    """Replays tensors of one chain.

    Args:
        storage: where the store lives.
        chain: the records from the base to the step to read (see ``Store.chain``).
        pool: staging buffers.
        executor: the I/O threads.
        keys: the tensors the reader will read, where it reads many (say a load's): the records
            that left them as they were are told apart at once, here (most of a delta's, in a
            chain of a state of thousands of tensors), and a read skips them unlooked at.
    """

    def __init__(self, storage: Storage, chain: list[Manifest], pool: StagingPool, executor: Executor,
                 keys: Collection[str] = ()):
        self._storage = storage
        self._chain = chain
        self._pool = pool
        self._executor = executor
        self._idle = [_idle(m, keys, chain[-1]) for m in chain[:-1]]
        self._ids: dict[tuple[int, str, str], torch.Tensor] = {}  # a delta part's row ids
        # A base's row hash files, by attempt and rank: the tensors' indexes and each part's hashes.
        self._hashes: dict[tuple[str, int], tuple[dict[str, int], dict[tuple[int, int], np.ndarray]]] = {}
        self._lock = threading.Lock()
        self._sized: set[str] = set()  # pack files whose size was checked
        # Per thread (an export reads ahead on a second one): whether the tensor it reads is
        # small, so that its jobs run on that thread.
        self._small = threading.local()

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
        for part in rec.parts_meeting(box):
            for name in part.chunks:
                if name != "zarr.json":
                    stored_size(self._storage, m, key, part, name, self._sized)

    def read(self, key: str, dest: torch.Tensor, box: Box | None = None,
             hashes: RowHashes | None = None) -> None:
        """Fills ``dest`` (CPU, contiguous, of the recorded dtype) with the box ``box`` (default:
        the whole tensor) of ``key``'s value.

        The last full record of the chain (its base) is read first; then the deltas after it,
        newest first, each writing only the rows and elements no newer delta wrote, so every
        delta's reads run at once and no row is copied twice. With ``hashes``, the read jobs
        hash the rows they write (see :mod:`.row_hashes`); :meth:`RowHashes.complete` finishes.
        """
        box = box or whole(tuple(dest.shape))
        self._small.here = dest.nbytes <= INLINE_BYTES
        try:
            self._read(key, dest, box, hashes)
        finally:
            self._small.here = False

    def _read(self, key: str, dest: torch.Tensor, box: Box, hashes: RowHashes | None) -> None:
        # Each record but the last that left the tensor as it was is skipped unlooked at.
        recs = [(m, self._checked(m, key, dest, box)) for m, idle in zip(self._chain, [*self._idle, ()])
                if key not in idle]
        start = max((i for i, (_, r) in enumerate(recs) if r.encoding.whole), default=0)
        steps = recs[start:]
        base, deltas = (steps[0], steps[1:]) if steps[0][1].encoding.whole else (None, steps)
        # A delta that left the tensor as it was is skipped before its parts are built (a
        # chain of a state of many tensors holds thousands of them a delta).
        deltas = [(m, rec) for m, rec in reversed(deltas) if not rec.untouched(box)]
        hits = [(m, rec, part, inter) for m, rec in deltas for part in rec.parts_meeting(box)
                for inter in [part.box.intersect(box)] if inter is not None]
        # A 1-d tensor's rows are its elements: its row and dense deltas claim from one cover.
        if len({rec.encoding.claims for _, rec, _, _ in hits}) > 1 and dest.dim() != 1:
            raise IntegrityError(self._chain[-1].step, key, "dense and row deltas mixed along the chain")
        # Nor has a part that changed nothing and lists no chunk anything to read, claim or check.
        hits = [hit for hit in hits if hit[2].touched]
        self.run([partial(self.ids, m, key, part) for m, rec, part, _ in hits if rec.encoding.claims == "rows"])
        jobs: list[Job] = []
        if hits:  # no delta to replay (a base's read, most tensors of a state): no cover to make
            covers = Covers.of(box, [part.box for _, _, part, _ in hits])
            jobs = [job for m, rec, part, inter in hits
                    for job in rec.encoding.read(self, m, key, rec, part, inter, dest, box, covers, hashes)]
        if base is not None:
            m, rec = base
            self.run([job for part in rec.parts_meeting(box) for inter in [part.box.intersect(box)]
                      if inter is not None
                      for job in rec.encoding.read(self, m, key, rec, part, inter, dest, box, None, hashes)])
        self.run(jobs)

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

    def run(self, jobs: list[Job]) -> None:
        """Runs ``jobs`` on the I/O threads and this one, which takes every job no I/O thread has
        started (a small tensor's all on this thread, see :data:`INLINE_BYTES`); raises the
        first error once every job ended."""
        error = None
        if getattr(self._small, "here", False):
            for job in jobs:
                try:
                    job()
                except BaseException as e:  # noqa: BLE001 - every job runs before raising
                    error = error or e
        else:
            run_shared(self._executor, jobs)
        if error is not None:
            raise error

    def fetch(self, m: Manifest, key: str, part: PartRecord, name: str, into: torch.Tensor) -> None:
        """Reads a chunk straight into ``into`` (see :func:`deltackpt.io.fetch.fetch`)."""
        fetch(self._storage, m, key, part, name, into)

    def staged(self, m: Manifest, key: str, part: PartRecord, name: str, dtype: torch.dtype,
               decoded_bytes: int, use: Callable[[torch.Tensor], None], uncoded: bool = False) -> None:
        """Reads a chunk through a staging buffer, decodes it if coded (``uncoded``: never), and hands
        the uint8 bytes to ``use``."""
        size = stored_size(self._storage, m, key, part, name, self._sized)
        if uncoded and size != decoded_bytes:
            raise IntegrityError(m.step, chunk_path(m, key, part, name),
                                 f"{size} B, where the record's shapes make {decoded_bytes} B")
        buf = self._pool.acquire(size)
        try:
            fetch(self._storage, m, key, part, name, buf)
            if uncoded or not dtypes.compresses(dtype):
                use(buf)
                return
            try:
                raw = decode(buf.numpy(), decoded_bytes)
            except ValueError as e:
                raise IntegrityError(m.step, chunk_path(m, key, part, name), str(e)) from None
            use(torch.from_numpy(raw))
        finally:
            self._pool.release(buf)

    def stored_hashes(self, m: Manifest, key: str, part: PartRecord) -> torch.Tensor | None:
        """The hash of every row of a base's part as its writer stored them (see
        :mod:`deltackpt.format.hash_files`), or None where it stored none; each rank's file is
        read and checked once per reader.

        Raises:
            MissingChunkError, IntegrityError: the file is gone, its size or checksum is not the
                record's, or it lists another number of rows for the part.
            ManifestError: the file is no row hash file of the record.
        """
        if part.rank not in m.hashes:
            return None
        with self._lock:
            got = self._hashes.get((m.attempt, part.rank))
            if got is None:
                path, entry = hashes_key(m.attempt, part.rank), m.hashes[part.rank]
                buf = torch.empty(file_size(self._storage, m.step, path, entry), dtype=torch.uint8)
                fetch_file(self._storage, m.step, path, entry, buf)
                got = self._hashes[m.attempt, part.rank] = (
                    {k: i for i, k in enumerate(m.tensors)}, decode_hashes(buf.numpy(), path, len(m.tensors)))
        index, by_part = got
        rows = by_part.get((index[key], path_column(part.path)))
        if rows is None:
            return None
        if rows.size != part.shape[0]:
            raise IntegrityError(m.step, hashes_key(m.attempt, part.rank),
                                 f"{rows.size} row hashes for part {part.path!r} of {key!r} of {part.shape[0]} rows")
        return torch.from_numpy(rows)

    def ids(self, m: Manifest, key: str, part: PartRecord) -> torch.Tensor:
        """All row ids of a delta part (small: 8 bytes a row), checked: sorted, unique, inside
        the part; read once per reader."""
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

            self.staged(m, key, part, f"ids/{chunk_key(i, 1)}", torch.int64, cr * 8, take)
        ids = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
        bad = (ids < part.offset[0]) | (ids >= part.offset[0] + part.shape[0])
        bad[1:] |= ids[1:] <= ids[:-1]
        if bool(bad.any()):
            raise IntegrityError(m.step, chunk_path(m, key, part, "ids"),
                                 "row ids outside the part or not strictly increasing")
        return ids
