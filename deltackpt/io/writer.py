"""Writing one step's files: array metadata, and the chunks that each part's encoding queues
(see :mod:`deltackpt.format.encodings`, whose classes lay out and stage the data).

Chunk files are written by a thread pool (see :mod:`deltackpt.io.files`); each file's size and
xxh3-64 checksum are recorded for the commit record. Rows and device data pass through the
staging pool; whole CPU tensors are written straight from their memory. Edge chunks are padded with zeros to the full chunk shape, as
zarr v3 stores them, so any zarr v3 reader reads the arrays.

A delta's chunks go back to back into one pack per writing rank instead (see
:mod:`deltackpt.io.pack`), and the record gives each chunk's offset in it beside its size and
checksum. A chunk already in a staging buffer of its own (a delta's gathered rows) is appended
by the packer (an I/O thread's lane, if the writer has one), with its rows' hashes, so that the
saving thread only gathers: it returns to training sooner; for a non-blocking save (``defer``)
only once the caller has staged every chunk (:meth:`StepWriter.staged`), so that the packer's
hashing and copying do not take the cores from the caller's gathers. A small one is appended by
the saving thread (see :data:`HAND_OFF_BYTES`), or for a non-blocking save by its background
thread when it finishes the writer, while staging buffers allow (at most :data:`MAX_DEFERRED`);
so are the ids of a delta's rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future
from functools import partial

import numpy as np
import torch

from .. import kernels  # installed from kernels/, see pyproject
from ..format.layout import part_folder
from ..format.manifest import ChunkMap
from ..format.zarr_meta import array_doc, codec_for, group_doc
from ..storage import Storage
from .files import APART_BYTES, FileWrites, wait_all
from .pack import Pack
from .staging import StagingPool
from .threads import idle_cores, run_shared


MAX_PIECES = 8  # pieces a large gather is split into, for the I/O threads and the saving one
# The least bytes a gather gives each of its pieces. Rows from all over a table are gathered at the
# pace of memory's latency, not its bandwidth, so two threads take about half the time of one: the
# 2.6 MB of marked rows of each table of a 1% delta of bench/bench_async.py took 0.6-1.0 ms on one
# thread, 0.4-0.7 ms in pieces of 1 MiB (a piece costs a hand-off, ~50 us).
GATHER_PIECE_BYTES = 1 << 20
COPY_PIECE_BYTES = 4 << 20  # the least a staging copy shared with the I/O threads gives each
# A staged chunk under this many bytes is appended to the pack by the saving thread: copying and
# hashing it costs less than waking the pack thread and trading the GIL with it (a small
# state's delta is a few dozen such chunks).
HAND_OFF_BYTES = 1 << 20
# The most small staged chunks a non-blocking save leaves to its background: each spares the
# saving thread a copy and hash, but its append is ~50 us of Python there, whose GIL the training
# beside it waits for. 100 tables of 10,000 x 64: training steps beside a background delta took
# 87-89 ms with its 200 chunks left to it, 47-48 ms with 6 (bench_async.py --tables 100 --rows
# 10000 --dim 64); the tracked model of bench_tracking (two chunks of each of 8 tables), its 1%
# delta blocked 9.8-10.0 ms with all 16 left to it, 11.6-12.4 ms with 6.
MAX_DEFERRED = 16


def _then(job: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
    """``job``, then ``after`` however it ended."""

    def run() -> None:
        try:
            job()
        finally:
            after()

    return run


class StepWriter:
    """Writes files of one save attempt under ``folder``; :meth:`finish` returns what was written.

    Args:
        storage: where to write.
        folder: the attempt folder (``steps/ATTEMPT``).
        pool: staging buffers.
        executor: the I/O threads.
        pack: the pack that takes every chunk (a delta's ``pack.<rank>``); None writes a file
            per chunk.
        packer: one thread that appends staged chunks to the pack (None: the calling thread
            appends every chunk).
        defer: small staged chunks are appended by :meth:`finish` instead of the put (the saving
            thread of a non-blocking save returns without them), large ones from :meth:`staged`,
            while the staging pool keeps two places free (see :meth:`_room`).
        gate: every file waits for it before it is written, and fails with its error (the
            writer lease naming the attempt folder, see :class:`~deltackpt.save.saver.Saver`);
            it must not wait for ``executor``'s threads.
        hold: the files (a base's chunks) wait until every chunk is staged (:meth:`staged`), and
            the staging copies are shared with the idle cores' I/O threads meanwhile, so that a
            non-blocking save's training waits for its copies alone; but only while the held
            files leave two of the buffers already touched: a copy into fresh memory faults a
            page at a time, slowly enough on a VM that the writes had better start beside it (a
            2.15 GB base's call to commit took 1.6x its blocking save held into fresh buffers,
            0.9x not).
        workers: from the end of staging (:meth:`staged`) until :meth:`hurry`, the most I/O
            threads that write its files at once (None: every one free; a non-blocking save's,
            the cores its training leaves, see :func:`~deltackpt.io.threads.cores_beside_training`).
    """

    def __init__(self, storage: Storage, folder: str, pool: StagingPool, executor: Executor,
                 pack: str | None = None, packer: Executor | None = None, defer: bool = False,
                 gate: Future[None] | None = None, hold: bool = False, workers: int | None = None):
        self._storage = storage
        self._folder = folder
        self.pool = pool
        self._executor = executor
        self._files = FileWrites(storage, executor, gate, hold=hold)
        self._workers = workers
        self._touched = min(pool.buffers, pool.touched_bytes() // pool.nbytes)  # buffers touched already
        # Large chunks queued on the packer or held back, each holding its staging buffer: at
        # most all but two buffers, so that the pack (filling one) and the caller (gathering one)
        # always get one (held-back small chunks: see _room).
        self._packer = packer if pool.buffers > 2 else None
        self._ahead = threading.Semaphore(max(0, pool.buffers - 2))
        self._appends: list[Future[None]] = []
        # Appends left to finish() (small staged chunks, kept ones), each with what gives back
        # all it holds, had it never run (its buffer, and a large one's place among the _ahead).
        self._defer = defer
        self._deferred: list[tuple[Callable[[], None], Callable[[], None]]] = []
        self._small_deferred = 0  # owned small chunks among them (see MAX_DEFERRED)
        # Appends of large staged chunks held back for the packer until staged(), likewise.
        self._held: list[tuple[Callable[[], None], Callable[[], None]]] = []
        self._appending = threading.Lock()  # one append at a time, from either thread
        self._lock = threading.Lock()
        self.results: dict[tuple[str, str], ChunkMap] = {}
        self.packs: dict[str, ChunkMap] = {}  # a pack's own files, by pack name
        self._pack = None
        if pack is not None:

            def write(name: str, parts: Callable[[], Iterable[memoryview]],
                      release: Callable[[], None]) -> None:
                def record(size: int, digest: str) -> None:
                    self.packs.setdefault(pack, {})[name] = (size, digest)

                self._files.file(f"{folder}/{pack}/{name}", parts, record, release, at_once=True)

            self._pack = Pack(pool, write)
        self.written = self._files.written  # every file written, for the directory syncs
        self.bounds: dict[str, float] = {}  # the largest bound of quantized rows, by tensor key

    def note_bound(self, key: str, bound: float) -> None:
        """Records the largest error bound of the quantized rows written for ``key``."""
        with self._lock:
            self.bounds[key] = max(self.bounds.get(key, 0.0), bound)

    # -- metadata (coordinator) ------------------------------------------------------------------

    def array(self, key: str, path: str, shape: tuple[int, ...], chunks: tuple[int, ...],
              dtype: torch.dtype, *, raw: bool = False) -> None:
        """Writes the zarr.json of an array of a part (``raw``: its chunks are not coded)."""
        doc = array_doc(shape, chunks, dtype, raw=raw)
        self._submit(key, path, "zarr.json", lambda: [memoryview(doc)])

    def groups(self, folders: Iterable[str]) -> None:
        """Writes group documents for folders (relative to the attempt; "" is the attempt)."""
        doc = memoryview(group_doc())
        for g in folders:
            self._files.file(f"{self._folder}/{g}/zarr.json" if g else f"{self._folder}/zarr.json",
                             lambda: [doc], None)

    def finish(self, *, helping: bool = True) -> dict[tuple[str, str], ChunkMap]:
        """Waits for every write and returns the chunks written per (tensor key, part path);
        the files of the pack, if any, are in :attr:`packs`. ``helping``: this thread writes and
        checks the files no I/O thread has started (see :meth:`FileWrites.finish`).

        Raises the first write error, after every write has ended.
        """
        self.staged()
        error = self._run_deferred()
        error = wait_all(self._appends) or error
        if self._pack is not None:
            try:
                self._pack.close()
            except BaseException as e:  # noqa: BLE001 - the queued writes must still end
                error = error or e
        error = self._files.finish(helping=helping) or error
        if error is not None:
            raise error
        return self.results

    def abandon(self) -> None:
        """After a failure: waits for the queued writes and gives back every staging buffer,
        ignoring write errors (the failure that led here is the one to report)."""
        deferred, self._deferred, self._held = self._deferred + self._held, [], []
        for _, release in deferred:  # each gives back all its append holds
            release()
        wait_all(self._appends)  # before the pack ends: none may start it again
        if self._pack is not None:
            self._pack.discard()
        self._files.drop()

    def staged(self) -> None:
        """The caller has staged every chunk: the large ones held back go to the pack thread,
        the files held back to the I/O threads (at most ``workers`` of them from now on, until
        :meth:`hurry`)."""
        if self._workers is not None:
            self._files.bound(self._workers)
            self._workers = None
        self._let_go()

    def hurry(self) -> None:
        """Someone waits for the writes (after :meth:`staged`): every I/O thread free runs them."""
        self._files.bound(None)

    def _let_go(self) -> None:
        """The large chunks held back go to the pack thread, the files held back to the I/O
        threads."""
        held, self._held = self._held, []
        for job, _ in held:
            assert self._packer is not None  # only a writer with a packer holds chunks back
            self._appends.append(self._packer.submit(job))
        self._files.start()

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copies ``src`` into ``dst`` (uint8 arrays of one size): shared with the I/O threads of
        the idle cores while this writer's files wait for staging to end (their threads are
        free, and training waits for the copies), else on this thread."""
        n = dst.shape[0]
        most = n // COPY_PIECE_BYTES if self._files.holding else 1
        # Asked only for a copy worth splitting: idle_cores reads a file per thread of this
        # process, each read a hand-off of the GIL (15 ms beside the kernels' warm-up).
        pieces = min(most, 1 + max(0, idle_cores() or 0)) if most > 1 else 1
        if pieces <= 1:
            np.copyto(dst, src)
            return
        step = -(-n // (pieces * 4))  # a few jobs a thread: a core that turns busy holds back one
        run_shared(self._executor, [partial(np.copyto, dst[lo : lo + step], src[lo : lo + step])
                                    for lo in range(0, n, step)], pieces - 1)

    def _room(self) -> bool:
        """Whether a staged chunk may be held back (for :meth:`finish`, or a large one for
        :meth:`staged`) with its buffer: the pool then keeps two places free, the pack's and the
        next chunk's, so that neither waits for what only this thread gives back. Small chunks
        cut from one shared buffer hold one place: a background 1% delta of bench_tracking's
        model at the default budget (8 buffers) held back 6 of its 16 small chunks when each
        counted as a buffer, and all of them now (see :data:`MAX_DEFERRED`)."""
        return self.pool.buffers - self.pool.taken() >= 2

    def _run_deferred(self) -> BaseException | None:
        """Runs the appends left to :meth:`finish`; returns the first error."""
        error = None
        deferred, self._deferred = self._deferred, []
        for job, _ in deferred:
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - every buffer must go back
                error = error or e
        return error

    # -- chunks (an encoding's, see deltackpt.format.encodings) ---------------------------------

    def put(self, key: str, path: str, name: str, data: torch.Tensor, pad: int, dtype: torch.dtype,
            release: Callable[[], None] | None = None, uncoded: bool = False,
            hash_into: torch.Tensor | None = None, packed: bool | None = None, kept: bool = False) -> None:
        """Queues one chunk: ``data`` (rows of a tensor) followed by ``pad`` zero bytes, coded as a
        zarr array of ``dtype`` would be (``uncoded``: not coded); with ``hash_into``, the hash
        of each of ``data``'s rows goes there, on an I/O thread (a large file's beside its
        write, see :mod:`deltackpt.io.files`; for the pack, on the thread that appends it). ``packed``: into the pack, or a file (None: into the pack if the
        writer has one). With ``release``, ``data`` is the put's until it is called (a staging
        buffer of its own): the packer or :meth:`finish` may append it later; without, it is read
        before this returns, unless ``kept`` (``data`` does not change until the save ends, and
        holds no staging buffer: a change set's ids), when :meth:`finish` may append it later."""
        owned = release is not None
        release = release or (lambda: None)
        if data.device.type != "cpu":
            owned = True
            host = self.pool.acquire(data.numel() * data.element_size())
            host.view(data.dtype).view(data.shape).copy_(data)
            data, inner = host, release

            def release() -> None:
                self.pool.release(host)
                inner()

        zeros = self.pool.zeros(pad)
        codec = None if uncoded else codec_for(dtype)

        def rows() -> None:
            if hash_into is not None:
                hash_into.copy_(kernels.hash_rows(data.reshape(hash_into.numel(), -1), threads=1))

        def parts() -> list[memoryview]:
            body = kernels.small.flat_bytes(data).data
            if codec is None:
                return [body, zeros] if pad else [body]
            whole = np.concatenate([np.frombuffer(body, np.uint8), np.zeros(pad, np.uint8)])
            return [memoryview(codec.encode(whole))]

        self._submit(key, path, name, parts, release, before=rows,
                     packed=self._pack is not None if packed is None else packed, owned=owned, kept=kept,
                     nbytes=data.nbytes,
                     apart=codec is None and data.is_contiguous() and data.nbytes >= APART_BYTES)

    def put_packed(self, chunks: Sequence[tuple[str, str, str, torch.Tensor, int]]) -> None:
        """Appends each ``(key, path, name, data, pad)`` chunk (a contiguous CPU tensor's bytes,
        then ``pad`` zero bytes, coded as a zarr array of its dtype would be) to the pack at once,
        on this thread: a base of 20,000 tiny tensors spent ~30 us a chunk in :meth:`put`'s
        queueing, twice the copy and checksum."""
        assert self._pack is not None  # packed chunks come only to a writer with a pack
        for key, path, name, data, pad in chunks:
            codec = codec_for(data.dtype)
            body = kernels.small.flat_bytes(data).data
            if codec is not None:
                whole = np.concatenate([np.frombuffer(body, np.uint8), np.zeros(pad, np.uint8)])
                parts = [memoryview(codec.encode(whole))]
            else:
                parts = [body, self.pool.zeros(pad)] if pad else [body]
            with self._appending:  # a chunk at a time: the packer's appends go on between them
                self.results.setdefault((key, path), {})[name] = self._pack.append(parts)

    def run(self, jobs: Sequence[Callable[[], object]]) -> None:
        """Runs ``jobs`` on the I/O threads and this one; raises the first error once all ended
        (a :data:`deltackpt.storage.base.Run`)."""
        run_shared(self._executor, jobs)

    def gather(self, flat: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copies rows ``ids`` of ``flat`` (CPU) into ``out`` (a staging buffer), in pieces of at
        least ``GATHER_PIECE_BYTES`` run by the I/O threads and this one (one piece on this
        thread alone: a delta's gathers of a few kB, a table's sums, each cost ~70 us in the
        jobs' bookkeeping).

        numpy's take, not torch's index_select: on a busy node, waking torch's thread pool made
        gathering 5,000 rows of 128 B take 7 ms where one thread took 0.02 ms. The ids are
        checked rows of ``flat``, so no bounds check is needed ("clip").
        """
        src, idx, dst = flat.view(torch.uint8).numpy(), ids.numpy(), out.view(torch.uint8).numpy()
        n = len(idx)
        pieces = max(1, min(MAX_PIECES, n * dst.shape[1] // GATHER_PIECE_BYTES))
        if pieces == 1:
            np.take(src, idx, axis=0, out=dst[:n], mode="clip")
            return
        step = -(-n // pieces)

        def piece(lo: int) -> None:
            np.take(src, idx[lo : lo + step], axis=0, out=dst[lo : lo + step], mode="clip")

        run_shared(self._executor, [partial(piece, lo) for lo in range(0, n, step)])

    def _submit(self, key: str, path: str, name: str, parts: Callable[[], list[memoryview]],
                release: Callable[[], None] = lambda: None, *, before: Callable[[], None] = lambda: None,
                packed: bool = False, owned: bool = False, kept: bool = False, nbytes: int = 0,
                apart: bool = False) -> None:
        chunks = self.results.setdefault((key, path), {})
        if packed:
            pack = self._pack
            assert pack is not None  # packed chunks come only to a writer with a pack

            def append() -> None:
                try:
                    before()
                    data = parts()
                    with self._appending:
                        chunks[name] = pack.append(data)
                finally:
                    release()

            if owned and nbytes >= HAND_OFF_BYTES and self._packer is not None:
                slot = self._ahead.acquire(blocking=False)
                if not slot or (self._defer and not self._room()):
                    self._let_go()  # the held chunks hold the buffers, and only the packer frees them
                    error = self._run_deferred()  # they hold buffers only this thread gives back
                    if error is not None:
                        if slot:
                            self._ahead.release()
                        release()
                        raise error
                    if not slot:
                        self._ahead.acquire()
                if self._defer:
                    self._held.append((_then(append, self._ahead.release), _then(release, self._ahead.release)))
                else:
                    self._appends.append(self._packer.submit(_then(append, self._ahead.release)))
            elif owned and self._defer and self._small_deferred < MAX_DEFERRED and self._room():
                self._small_deferred += 1
                self._deferred.append((append, release))
            elif kept and self._defer:  # coding it is the background's work (blosc: ~70 us for 5,000 ids)
                self._deferred.append((append, release))
            else:
                append()
            return

        def record(size: int, digest: str) -> None:
            chunks[name] = (size, digest)

        if owned and self._files.holding and self.pool.taken() > self._touched - 2:
            self._files.start()  # the held files hold the touched buffers: from now on written as they come
        where = f"{self._folder}/{part_folder(key, path)}/{name}"
        if apart:
            self._files.large(where, parts, record, release, before)
        else:
            self._files.file(where, parts, record, release, before)
