"""Writing one step's arrays: whole tensors, changed rows, changed dense chunks.

Chunk files are written by a thread pool; each file's size and xxh3-64 checksum go into the
commit record. Rows and device data pass through the staging pool; whole CPU tensors are written
straight from their memory. Edge chunks are padded with zeros to the full chunk shape, as zarr v3
stores them, so any zarr v3 reader reads the arrays.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future

import numpy as np
import torch
import xxhash
from numcodecs import Blosc

from . import dtypes
from .manifest import TensorRecord
from .staging import StagingPool
from .storage import Storage
from .store import array_doc, group_doc


def rows_per_chunk(rows: int, row_bytes: int, chunk_bytes: int) -> int:
    """Rows per chunk: about ``chunk_bytes`` each, split evenly so the edge chunk pads little."""
    if rows == 0:
        return 1
    target = max(1, chunk_bytes // max(1, row_bytes))
    return -(-rows // -(-rows // target))


def chunk_key(index: int, ndim: int) -> str:
    """The zarr v3 default key of chunk ``index`` along dimension 0 (``c`` for a 0-d array)."""
    return "/".join(["c", str(index)] + ["0"] * (ndim - 1)) if ndim else "c"


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def codec_for(dtype: torch.dtype) -> Blosc | None:
    if not dtypes.compresses(dtype):
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    return Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE, typesize=itemsize, blocksize=0)


class StepWriter:
    """Writes the arrays of one save attempt under ``folder``; :meth:`finish` collects the records.

    Args:
        storage: where to write.
        folder: the attempt folder (``steps/ATTEMPT``).
        pool: staging buffers.
        executor: the I/O threads.
        chunk_bytes: target size of a chunk file.
    """

    def __init__(
        self,
        storage: Storage,
        folder: str,
        pool: StagingPool,
        executor: Executor,
        chunk_bytes: int,
    ):
        self._storage = storage
        self._folder = folder
        self._pool = pool
        self._executor = executor
        self._chunk_bytes = chunk_bytes
        self._futures: list[Future[None]] = []
        self._records: dict[str, TensorRecord] = {}
        self._lock = threading.Lock()
        self._stored: set[str] = set()  # keys with at least one file
        self.written: list[str] = []  # every file written, for the directory syncs

    # -- whole tensors, changed rows, changed chunks --------------------------------------------

    def full(self, key: str, t: torch.Tensor) -> None:
        """Writes all of ``t`` as one zarr array of its shape, chunked by rows."""
        rows = t.shape[0] if t.dim() else 1
        flat = t.reshape(rows, -1)
        row_bytes = flat.shape[1] * t.element_size()
        cr = rows_per_chunk(rows, row_bytes, self._chunk_bytes)
        chunk_shape = (cr, *t.shape[1:]) if t.dim() else ()
        self._start(key, t, "full", chunk_shape, rows)
        self._doc(key, "zarr.json", array_doc(tuple(t.shape), chunk_shape, t.dtype))
        for i in range(-(-rows // cr) if t.numel() else 0):
            lo, hi = i * cr, min(rows, (i + 1) * cr)
            self._put(key, chunk_key(i, t.dim()), flat[lo:hi], (cr - (hi - lo)) * row_bytes, t.dtype)

    def rows(self, key: str, t: torch.Tensor, ids: torch.Tensor) -> None:
        """Writes rows ``ids`` (sorted, unique, int64 on CPU) of ``t`` as arrays ``ids``, ``rows``."""
        n = ids.numel()
        flat = t.reshape(t.shape[0], -1)
        row_bytes = flat.shape[1] * t.element_size()
        cr = rows_per_chunk(n, row_bytes, self._chunk_bytes)
        self._start(key, t, "rows", (cr, *t.shape[1:]), n)
        if n == 0:
            return
        self._doc(key, "zarr.json", group_doc())
        self._doc(key, "ids/zarr.json", array_doc((n,), (cr,), torch.int64))
        self._doc(key, "rows/zarr.json", array_doc((n, *t.shape[1:]), (cr, *t.shape[1:]), t.dtype))
        for i in range(-(-n // cr)):
            lo, hi = i * cr, min(n, (i + 1) * cr)
            pad_rows = cr - (hi - lo)
            part = ids[lo:hi]
            self._put(key, f"ids/{chunk_key(i, 1)}", part, pad_rows * 8, torch.int64)
            buf = self._pool.acquire((hi - lo) * row_bytes)
            out = buf.view(t.dtype).view(hi - lo, flat.shape[1])
            if t.device.type == "cpu":
                torch.index_select(flat, 0, part, out=out)
            else:
                out.copy_(flat.index_select(0, part.to(t.device)))
            self._put(
                key,
                f"rows/{chunk_key(i, t.dim())}",
                out,
                pad_rows * row_bytes,
                t.dtype,
                release=lambda b=buf: self._pool.release(b),
            )

    def chunks(self, key: str, t: torch.Tensor, chunk_ids: Sequence[int], chunk_elems: int) -> None:
        """Writes chunks ``chunk_ids`` of ``t``'s flat elements (``chunk_elems`` each)."""
        numel = t.numel()
        self._start(key, t, "chunks", (chunk_elems,), len(chunk_ids))
        if not chunk_ids:
            return
        self._doc(key, "zarr.json", array_doc((numel,), (chunk_elems,), t.dtype))
        flat = t.reshape(-1)
        for c in chunk_ids:
            lo, hi = c * chunk_elems, min(numel, (c + 1) * chunk_elems)
            pad = (chunk_elems - (hi - lo)) * t.element_size()
            self._put(key, chunk_key(c, 1), flat[lo:hi], pad, t.dtype)

    def finish(self) -> dict[str, TensorRecord]:
        """Writes the group documents, waits for every write and returns the records.

        Raises the first write error, after every write has ended.
        """
        groups = {self._folder}
        for key in self._stored:
            parts = key.split("/")
            groups.update("/".join([self._folder, *parts[:i]]) for i in range(1, len(parts)))
        doc = memoryview(group_doc())
        for g in sorted(groups):
            self._submit(f"{g}/zarr.json", lambda: [doc], lambda: None, None)
        error = None
        for f in self._futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - every write must end before raising
                error = error or e
        if error is not None:
            raise error
        return self._records

    # -- internals ------------------------------------------------------------------------------

    def _start(
        self, key: str, t: torch.Tensor, encoding: str, chunk_shape: tuple[int, ...], changed: int
    ) -> None:
        self._records[key] = TensorRecord(
            dtype=dtypes.name(t.dtype),
            shape=tuple(t.shape),
            encoding=encoding,
            chunk_shape=chunk_shape,
            changed=changed,
            chunks={},
        )

    def _doc(self, key: str, name: str, doc: bytes) -> None:
        self._submit(f"{self._folder}/{key}/{name}", lambda: [memoryview(doc)], lambda: None, (key, name))

    def _put(
        self,
        key: str,
        name: str,
        data: torch.Tensor,
        pad: int,
        dtype: torch.dtype,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Queues one chunk: ``data`` (rows of a tensor) followed by ``pad`` zero bytes."""
        release = release or (lambda: None)
        if data.device.type != "cpu":
            host = self._pool.acquire(data.numel() * data.element_size())
            host.view(data.dtype).view(data.shape).copy_(data)
            data, inner = host, release
            release = lambda: (self._pool.release(host), inner())  # noqa: E731
        zeros = self._pool.zeros(pad)
        codec = codec_for(dtype)

        def parts() -> list[memoryview]:
            body = as_bytes(data.contiguous())
            if codec is None:
                return [body, zeros] if pad else [body]
            whole = np.concatenate([np.frombuffer(body, np.uint8), np.zeros(pad, np.uint8)])
            return [memoryview(codec.encode(whole))]

        self._submit(f"{self._folder}/{key}/{name}", parts, release, (key, name))

    def _submit(
        self,
        path: str,
        parts: Callable[[], list[memoryview]],
        release: Callable[[], None],
        record: tuple[str, str] | None,
    ) -> None:
        """Queues writing ``path``; ``record`` = (tensor key, chunk name) to list it under."""
        if record:
            self._stored.add(record[0])

        def job() -> None:
            try:
                data = parts()
                h = xxhash.xxh3_64()
                for p in data:
                    h.update(p)
                self._storage.write(path, data)
                size = sum(p.nbytes for p in data)
                with self._lock:
                    if record:
                        self._records[record[0]].chunks[record[1]] = (size, h.hexdigest())
                    self.written.append(path)
            finally:
                release()

        self._futures.append(self._executor.submit(job))


def state_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())

