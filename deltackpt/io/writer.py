"""Writing one step's files: array metadata, and the chunks of whole parts, changed rows and
changed dense chunks.

Chunk files are written by a thread pool; each file's size and xxh3-64 checksum are recorded for
the commit record. Rows and device data pass through the staging pool; whole CPU tensors are
written straight from their memory. Edge chunks are padded with zeros to the full chunk shape, as
zarr v3 stores them, so any zarr v3 reader reads the arrays.

A delta's chunks go back to back into one pack per writing rank instead (see
:mod:`deltackpt.io.pack`), and the record gives each chunk's offset in it beside its size and
checksum.

The geometry functions are shared by the coordinator (which writes every array's metadata) and
the rank that writes a part's chunks, so both agree on the chunk grid.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from functools import partial

import numpy as np
import torch
import xxhash

from .. import kernels  # installed from kernels/, see pyproject
from ..kernels import rowwise
from ..quantization import QuantizationError, Rowwise
from ..format.layout import chunk_key, part_folder
from ..format.manifest import ChunkMap
from ..format.zarr_meta import array_doc, codec_for, group_doc
from ..storage import Storage
from .pack import Pack
from .staging import StagingPool


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data


MAX_PIECES = 8  # pieces a large gather is split into, for the I/O threads and the saving one


def run_shared(executor: Executor, jobs: list[Callable[[], None]]) -> None:
    """Runs ``jobs`` on ``executor``'s threads and on this one, and waits for them.

    This thread runs every job no I/O thread has started, and waits only for the jobs one has:
    so it never waits on a busy executor, whose threads may be waiting on this one (a pack's
    writer waits for the bytes this thread gathers).
    """
    taken = [threading.Lock() for _ in jobs]
    done = [threading.Event() for _ in jobs]
    errors: list[BaseException | None] = [None] * len(jobs)

    def run(i: int) -> None:
        if not taken[i].acquire(blocking=False):
            return
        try:
            jobs[i]()
        except BaseException as e:  # noqa: BLE001 - raised on the waiting thread
            errors[i] = e
        finally:
            done[i].set()

    futures = [executor.submit(run, i) for i in range(1, len(jobs))]
    for i in range(len(jobs)):
        run(i)
    for f in futures:
        f.cancel()
    for d in done:
        d.wait()
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error


class StepWriter:
    """Writes files of one save attempt under ``folder``; :meth:`finish` returns what was written.

    Args:
        storage: where to write.
        folder: the attempt folder (``steps/ATTEMPT``).
        pool: staging buffers.
        executor: the I/O threads.
        pack: the pack that takes every chunk (a delta's ``pack.<rank>``); None writes a file
            per chunk.
    """

    def __init__(self, storage: Storage, folder: str, pool: StagingPool, executor: Executor,
                 pack: str | None = None):
        self._storage = storage
        self._folder = folder
        self._pool = pool
        self._executor = executor
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self.results: dict[tuple[str, str], ChunkMap] = {}
        self.packs: dict[str, ChunkMap] = {}  # a pack's own files, by pack name
        self._pack = None
        if pack is not None:

            def write(name: str, parts: Callable[[], Iterable[memoryview]],
                      release: Callable[[], None]) -> None:
                def record(size: int, digest: str) -> None:
                    self.packs.setdefault(pack, {})[name] = (size, digest)

                self._submit_path(f"{folder}/{pack}/{name}", parts, record, release)

            self._pack = Pack(pool, write)
        self.written: list[str] = []  # every file written, for the directory syncs
        self.bounds: dict[str, float] = {}  # the largest bound of quantized rows, by tensor key

    # -- metadata (coordinator) ------------------------------------------------------------------

    def array(self, key: str, path: str, shape: tuple[int, ...], chunks: tuple[int, ...],
              dtype: torch.dtype) -> None:
        """Writes the zarr.json of a part that is one array (a part of a base)."""
        doc = array_doc(shape, chunks, dtype)
        self._submit(key, path, "zarr.json", lambda: [memoryview(doc)])

    def groups(self, folders: Iterable[str]) -> None:
        """Writes group documents for folders (relative to the attempt; "" is the attempt)."""
        doc = memoryview(group_doc())
        for g in folders:
            self._submit_path(f"{self._folder}/{g}/zarr.json" if g else f"{self._folder}/zarr.json",
                              lambda: [doc], None)

    # -- chunks (the part's writer) -------------------------------------------------------------

    def full(self, key: str, path: str, t: torch.Tensor, chunks: tuple[int, ...],
             first_chunk: int = 0, release: Callable[[], None] | None = None,
             hash_into: torch.Tensor | None = None) -> None:
        """Writes every chunk of ``t`` (a whole part, or the rows of a part from chunk
        ``first_chunk`` on), chunked by rows; ``release`` runs once all of them are written. With
        ``hash_into`` (int64, a slot a row), the write threads put each row's hash there first."""
        rows = t.shape[0] if t.dim() else 1
        cr = chunks[0] if chunks else 1
        n = -(-rows // cr) if t.numel() else 0
        if n == 0:  # nothing to write (a tensor without elements has no chunks)
            if release is not None:
                release()
            return
        flat = t.reshape(rows, -1)
        row_bytes = flat.shape[1] * t.element_size()
        left = [n]

        def one_done() -> None:
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last and release is not None:
                release()

        for i in range(n):
            lo, hi = i * cr, min(rows, (i + 1) * cr)
            self._put(key, path, chunk_key(first_chunk + i, t.dim()), flat[lo:hi],
                      (cr - (hi - lo)) * row_bytes, t.dtype, release=one_done,
                      hash_into=None if hash_into is None else hash_into[lo:hi])

    def rows(self, key: str, path: str, t: torch.Tensor, ids: torch.Tensor, row_offset: int,
             chunk_rows: int, hash_into: torch.Tensor | None = None, rule: Rowwise | None = None) -> float:
        """Writes rows ``ids`` (local, sorted, unique, int64 on CPU) of ``t`` as arrays ``ids``
        (global ids: ``ids + row_offset``) and ``rows``, or quantized by ``rule`` as ``ids`` and
        ``qrows`` (uint8, one fused quantized row each); puts each row's hash, of its exact
        value, in ``hash_into`` if given. Returns the largest bound of the quantized rows (0 if
        exact).

        Raises:
            QuantizationError: a row to quantize holds inf or NaN (or lies past a float16
                scale's range).
        """
        n = ids.numel()
        flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
        row_bytes = flat.shape[1] * t.element_size()
        bound = 0.0
        for i in range(-(-n // chunk_rows)):
            lo, hi = i * chunk_rows, min(n, (i + 1) * chunk_rows)
            pad_rows = chunk_rows - (hi - lo)
            part = ids[lo:hi]
            self._put(key, path, f"ids/{chunk_key(i, 1)}", part + row_offset, pad_rows * 8, torch.int64)
            buf = self._pool.acquire((hi - lo) * row_bytes)
            out = buf.view(t.dtype).view(hi - lo, flat.shape[1])
            if t.device.type == "cpu":
                self._gather(flat, part, out, None if hash_into is None else hash_into[lo:hi])
            else:
                out.copy_(flat.index_select(0, part.to(t.device)))
                if hash_into is not None:
                    hash_into[lo:hi] = kernels.hash_rows(out, threads=1)
            if rule is None:
                self._put(key, path, f"rows/{chunk_key(i, t.dim())}", out, pad_rows * row_bytes,
                          t.dtype, release=partial(self._pool.release, buf))
                continue
            try:
                packed, bounds = rowwise.quantize_rows(out, rule.bits, adaptive=rule.adaptive,
                                                       scale_dtype=rule.scale_dtype)
            except rowwise.RowError as e:
                raise QuantizationError(f"{key!r} row {int(part[e.row]) + row_offset} {e.reason}") from None
            finally:
                self._pool.release(buf)
            bound = max(bound, float(bounds.max()))
            self._put(key, path, f"qrows/{chunk_key(i, 2)}", packed, pad_rows * packed.shape[1],
                      torch.uint8, uncoded=True)
        if rule is not None:
            self.bounds[key] = max(self.bounds.get(key, 0.0), bound)
        return bound

    def _gather(self, flat: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                hash_into: torch.Tensor | None) -> None:
        """Copies rows ``ids`` of ``flat`` (CPU) into ``out``, and their hashes into ``hash_into``
        if given, in pieces of at least ``PARALLEL_MIN`` bytes run by the I/O threads and this one.

        numpy's take, not torch's index_select: on a busy node, waking torch's thread pool made
        gathering 5,000 rows of 128 B take 7 ms where one thread took 0.02 ms. The ids are
        checked rows of ``flat``, so no bounds check is needed ("clip").
        """
        src, idx, dst = flat.view(torch.uint8).numpy(), ids.numpy(), out.view(torch.uint8).numpy()
        n = len(idx)
        pieces = max(1, min(MAX_PIECES, n * dst.shape[1] // kernels.reference.PARALLEL_MIN))
        step = -(-n // pieces)

        def piece(lo: int) -> None:
            np.take(src, idx[lo : lo + step], axis=0, out=dst[lo : lo + step], mode="clip")
            if hash_into is not None:
                kernels.reference.hash_rows(out[lo : lo + step], 1, hash_into[lo : lo + step])

        run_shared(self._executor, [partial(piece, lo) for lo in range(0, n, step)])

    def chunks(self, key: str, path: str, t: torch.Tensor, chunk_ids: list[int], chunk_elems: int,
               hash_into: torch.Tensor | None = None) -> None:
        """Writes chunks ``chunk_ids`` of ``t``'s flat elements (``chunk_elems`` each); puts each
        chunk's hash in ``hash_into`` if given."""
        numel = t.numel()
        flat = t.reshape(-1)
        for j, c in enumerate(chunk_ids):
            lo, hi = c * chunk_elems, min(numel, (c + 1) * chunk_elems)
            pad = (chunk_elems - (hi - lo)) * t.element_size()
            if hash_into is not None:
                hash_into[j] = kernels.hash_rows(flat[lo:hi].view(1, -1), threads=1)[0]
            self._put(key, path, chunk_key(c, 1), flat[lo:hi], pad, t.dtype)

    def finish(self) -> dict[tuple[str, str], ChunkMap]:
        """Waits for every write and returns the chunks written per (tensor key, part path);
        the files of the pack, if any, are in :attr:`packs`.

        Raises the first write error, after every write has ended.
        """
        error = None
        if self._pack is not None:
            try:
                self._pack.close()
            except BaseException as e:  # noqa: BLE001 - the queued writes must still end
                error = e
        error = self._wait() or error
        if error is not None:
            raise error
        return self.results

    def abandon(self) -> None:
        """After a failure: waits for the queued writes and gives back every staging buffer,
        ignoring write errors (the failure that led here is the one to report)."""
        if self._pack is not None:
            self._pack.discard()
        self._wait()

    def _wait(self) -> BaseException | None:
        """Waits for every queued write; returns the first error."""
        error = None
        for f in self._futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - every write must end before raising
                error = error or e
        return error

    # -- internals ------------------------------------------------------------------------------

    def _put(self, key: str, path: str, name: str, data: torch.Tensor, pad: int, dtype: torch.dtype,
             release: Callable[[], None] | None = None, uncoded: bool = False,
             hash_into: torch.Tensor | None = None) -> None:
        """Queues one chunk: ``data`` (rows of a tensor) followed by ``pad`` zero bytes, coded as a
        zarr array of ``dtype`` would be (``uncoded``: not coded); with ``hash_into``, the hash
        of each of ``data``'s rows goes there first, on the write's thread."""
        release = release or (lambda: None)
        if data.device.type != "cpu":
            host = self._pool.acquire(data.numel() * data.element_size())
            host.view(data.dtype).view(data.shape).copy_(data)
            data, inner = host, release

            def release() -> None:
                self._pool.release(host)
                inner()

        zeros = self._pool.zeros(pad)
        codec = None if uncoded else codec_for(dtype)

        def parts() -> list[memoryview]:
            if hash_into is not None:
                kernels.reference.hash_rows(data.reshape(hash_into.numel(), -1), 1, hash_into)
            body = as_bytes(data.contiguous())
            if codec is None:
                return [body, zeros] if pad else [body]
            whole = np.concatenate([np.frombuffer(body, np.uint8), np.zeros(pad, np.uint8)])
            return [memoryview(codec.encode(whole))]

        self._submit(key, path, name, parts, release)

    def _submit(self, key: str, path: str, name: str, parts: Callable[[], list[memoryview]],
                release: Callable[[], None] = lambda: None) -> None:
        chunks = self.results.setdefault((key, path), {})
        if self._pack is not None:
            try:
                chunks[name] = self._pack.append(parts())
            finally:
                release()
            return

        def record(size: int, digest: str) -> None:
            chunks[name] = (size, digest)

        self._submit_path(f"{self._folder}/{part_folder(key, path)}/{name}", parts, record, release)

    def _submit_path(self, full_path: str, parts: Callable[[], Iterable[memoryview]],
                     record: Callable[[int, str], None] | None,
                     release: Callable[[], None] = lambda: None) -> None:
        def job() -> None:
            try:
                h = xxhash.xxh3_64()
                size = 0

                def hashed() -> Iterator[memoryview]:
                    nonlocal size
                    for p in parts():
                        h.update(p)
                        size += p.nbytes
                        yield p

                self._storage.write(full_path, hashed())
                with self._lock:
                    if record:
                        record(size, h.hexdigest())
                    self.written.append(full_path)
            finally:
                release()

        self._futures.append(self._executor.submit(job))
