"""Reading a step: the base of its chain, then every delta in order, into tensors.

Every chunk read is checked against the size and xxh3-64 checksum in its commit record before its
bytes are used, so a restore never returns corrupt data. Chunks of one tensor and step are read in
parallel; steps are replayed in order. Whole-chunk reads land straight in the destination tensor;
edge chunks, coded chunks and delta rows go through the staging pool, which bounds the memory a
restore adds to the tensors it fills.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future

import numpy as np
import torch
import xxhash

from . import dtypes
from .errors import IntegrityError, MissingChunkError
from .manifest import Manifest, TensorRecord
from .staging import StagingPool
from .storage import Storage
from .store import STEPS
from .writer import chunk_key, codec_for


def chunk_path(m: Manifest, key: str, name: str) -> str:
    return f"{STEPS}/{m.attempt}/{key}/{name}"


def fetch(storage: Storage, m: Manifest, key: str, name: str, into: torch.Tensor) -> None:
    """Reads chunk ``name`` of tensor ``key`` of step ``m`` into ``into`` (uint8, exactly its size)
    and checks it against the record.

    Raises:
        MissingChunkError: the record lists no such chunk, or the file is gone.
        IntegrityError: the file's size or checksum differs from the record.
    """
    path = chunk_path(m, key, name)
    entry = m.tensors[key].chunks.get(name)
    if entry is None:
        raise MissingChunkError(m.step, path)
    size, digest = entry
    try:
        got = storage.read_into(path, memoryview(into.numpy()))
    except FileNotFoundError:
        raise MissingChunkError(m.step, path) from None
    if got != size:
        raise IntegrityError(m.step, path, f"{got} bytes on disk, the record says {size}")
    if xxhash.xxh3_64_hexdigest(memoryview(into.numpy())) != digest:
        raise IntegrityError(m.step, path, "checksum mismatch")


def stored_size(storage: Storage, m: Manifest, key: str, name: str) -> int:
    """The recorded size of a chunk, once the file is known to have it (so no allocation is
    driven by a number read from a damaged record)."""
    path = chunk_path(m, key, name)
    entry = m.tensors[key].chunks.get(name)
    if entry is None:
        raise MissingChunkError(m.step, path)
    size = storage.size(path)
    if size is None:
        raise MissingChunkError(m.step, path)
    if size != entry[0]:
        raise IntegrityError(m.step, path, f"{size} bytes on disk, the record says {entry[0]}")
    return size


class ChainReader:
    """Replays tensors of one chain.

    Args:
        storage: where the store lives.
        chain: the records from the base to the step to read (see ``Store.chain``).
        pool: staging buffers.
        executor: the I/O threads.
    """

    def __init__(
        self, storage: Storage, chain: list[Manifest], pool: StagingPool, executor: Executor
    ):
        self._storage = storage
        self._chain = chain
        self._pool = pool
        self._executor = executor

    def read(self, key: str, dest: torch.Tensor) -> None:
        """Fills ``dest`` (CPU, contiguous, of the recorded dtype and shape) with ``key``'s value."""
        for m in self._chain:
            rec = m.tensors.get(key)
            if rec is None:
                raise IntegrityError(m.step, key, "the tensor is missing from this step's record")
            if rec.shape != tuple(dest.shape) or dtypes.from_name(rec.dtype) != dest.dtype:
                raise IntegrityError(m.step, key, "dtype or shape differs along the chain")
            jobs = {"full": self._full, "rows": self._rows, "chunks": self._chunks}[rec.encoding]
            self._run(jobs(m, key, rec, dest))

    def _run(self, jobs: list[Callable[[], None]]) -> None:
        futures: list[Future[None]] = [self._executor.submit(job) for job in jobs]
        error = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - wait for every read before raising
                error = error or e
        if error is not None:
            raise error

    def _staged(self, m: Manifest, key: str, name: str, decoded_bytes: int, use: Callable) -> None:
        """Reads a chunk through a staging buffer, decodes it if coded, and hands it to ``use``."""
        rec = m.tensors[key]
        buf = self._pool.acquire(stored_size(self._storage, m, key, name))
        try:
            fetch(self._storage, m, key, name, buf)
            codec = codec_for(torch.int64 if name.startswith("ids/") else dtypes.from_name(rec.dtype))
            if codec is not None:
                raw = np.frombuffer(codec.decode(buf.numpy()), np.uint8)
                if raw.nbytes != decoded_bytes:
                    raise IntegrityError(m.step, chunk_path(m, key, name), "decodes to a wrong size")
                use(torch.from_numpy(raw.copy()))
            else:
                use(buf)
        finally:
            self._pool.release(buf)

    def _full(self, m: Manifest, key: str, rec: TensorRecord, dest: torch.Tensor) -> list[Callable]:
        rows = dest.shape[0] if dest.dim() else 1
        if not dest.numel():
            return []
        flat = dest.reshape(-1).view(torch.uint8).reshape(rows, -1)
        cr = rec.chunk_shape[0] if rec.chunk_shape else 1
        raw = codec_for(dest.dtype) is None
        jobs = []
        for i in range(-(-rows // cr)):
            lo, hi = i * cr, min(rows, (i + 1) * cr)
            name = chunk_key(i, dest.dim())
            target = flat[lo:hi].reshape(-1)
            if raw and hi - lo == cr:
                jobs.append(lambda n=name, t=target: fetch(self._storage, m, key, n, t))
            else:
                size = cr * flat.shape[1]
                jobs.append(
                    lambda n=name, t=target, s=size: self._staged(
                        m, key, n, s, lambda b, t=t: t.copy_(b[: t.numel()])
                    )
                )
        return jobs

    def _rows(self, m: Manifest, key: str, rec: TensorRecord, dest: torch.Tensor) -> list[Callable]:
        n, cr = rec.changed, rec.chunk_shape[0]
        flat = dest.reshape(dest.shape[0], -1)
        row_bytes = flat.shape[1] * dest.element_size()

        def job(i: int) -> None:
            lo, hi = i * cr, min(n, (i + 1) * cr)
            ids_box: list[torch.Tensor] = []
            self._staged(
                m, key, f"ids/{chunk_key(i, 1)}", cr * 8,
                lambda b: ids_box.append(b.view(torch.int64)[: hi - lo].clone()),
            )
            ids = ids_box[0]
            bad = (ids < 0) | (ids >= dest.shape[0])
            if hi - lo > 1:
                bad[1:] |= ids[1:] <= ids[:-1]
            if bool(bad.any()):
                raise IntegrityError(m.step, chunk_path(m, key, f"ids/{chunk_key(i, 1)}"),
                                     "row ids out of range or not strictly increasing")
            self._staged(
                m, key, f"rows/{chunk_key(i, dest.dim())}", cr * row_bytes,
                lambda b: flat.index_copy_(
                    0, ids, b[: (hi - lo) * row_bytes].view(dest.dtype).view(hi - lo, -1)
                ),
            )

        return [lambda i=i: job(i) for i in range(-(-n // cr))]

    def _chunks(self, m: Manifest, key: str, rec: TensorRecord, dest: torch.Tensor) -> list[Callable]:
        (ce,) = rec.chunk_shape
        itemsize = dest.element_size()
        flat = dest.reshape(-1).view(torch.uint8)
        raw = codec_for(dest.dtype) is None
        jobs = []
        for name in rec.chunks:
            if name == "zarr.json":
                continue
            index = int(name[2:]) if name[:2] == "c/" and name[2:].isdigit() else -1
            lo, hi = index * ce * itemsize, min(dest.numel(), (index + 1) * ce) * itemsize
            if index < 0 or not 0 <= lo < hi:
                raise IntegrityError(m.step, chunk_path(m, key, name), "chunk index out of range")
            target = flat[lo:hi]
            if raw and hi - lo == ce * itemsize:
                jobs.append(lambda n=name, t=target: fetch(self._storage, m, key, n, t))
            else:
                jobs.append(
                    lambda n=name, t=target: self._staged(
                        m, key, n, ce * itemsize, lambda b, t=t: t.copy_(b[: t.numel()])
                    )
                )
        return jobs
