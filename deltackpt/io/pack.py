"""A delta's pack: the chunks one rank writes, back to back in one file.

A delta writes few bytes in many small chunks, and on a file system each file and folder costs
more than its bytes (a 1% delta of a 56-tensor DLRM made 218 files in 134 folders), so each
writing rank puts its chunks into one pack (``pack.<rank>``), a uint8 zarr array of one chunk,
``c.0``, exactly as long as the bytes in it. One chunk, not chunks of ``chunk_bytes``: zarr v3
stores an edge chunk at the full chunk size, and the last chunk's zeros were most of some deltas
(a 1% delta of 38 MB of payload wrote 67 MB). The file is written while rows are gathered, from
staging buffers handed to an I/O thread as they fill, so the disk works meanwhile and memory stays
bounded by the staging pool however long the pack grows.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
import xxhash

from ..format.zarr_meta import array_doc
from .staging import SHARED_PART, StagingPool

STREAM_BYTES = 1 << 20  # the pack file is handed to the disk in pieces of this size as it fills


class Pack:
    """The pack one rank fills in a delta.

    Args:
        pool: staging buffers the bytes pass through.
        write: queues the write of one file of the pack: ``write(name, parts, ended)``, where
            ``parts()`` yields the file's bytes in order and ``ended()`` is called once the write
            has ended, done or failed (both on an I/O thread).
    """

    def __init__(self, pool: StagingPool,
                 write: Callable[[str, Callable[[], Iterable[memoryview]], Callable[[], None]], None]):
        self._pool = pool
        self._write = write
        self._stream: _Stream | None = None
        self.size = 0

    def append(self, data: list[memoryview]) -> tuple[int, str, int]:
        """Adds one chunk's bytes; returns its size, xxh3-64 and offset in the pack."""
        offset = self.size
        h = xxhash.xxh3_64()
        for part in data:
            h.update(part)
            if self._stream is None:
                self._stream = _Stream(self._pool)
                self._write("c.0", self._stream.pieces, self._stream.drain)
            self._stream.put(np.frombuffer(part, np.uint8))
            self.size += part.nbytes
        return self.size - offset, h.hexdigest(), offset

    def close(self) -> None:
        """Ends the pack file and writes the array's metadata (nothing for an empty pack)."""
        if self._stream is None:
            return
        self._stream.end()
        self._stream = None
        doc = array_doc((self.size,), (self.size,), torch.uint8, raw=True)  # chunks coded on their own
        self._write("zarr.json", lambda: [memoryview(doc)], lambda: None)

    def discard(self) -> None:
        """Ends the pack file where it is (the save failed)."""
        if self._stream is not None:
            self._stream.end()
            self._stream = None


class _Stream:
    """The pack file's bytes: staging buffers (a quarter of the pool's each, see
    :data:`~deltackpt.io.staging.SHARED_PART`) filled by the saving thread, written in order by
    an I/O thread, each given back to the pool once written (or once the write has failed)."""

    def __init__(self, pool: StagingPool):
        self._pool = pool
        # (buffer, from, to, whether the buffer is done with), or None at the end.
        self._ready: queue.SimpleQueue[tuple[torch.Tensor, int, int, bool] | None] = queue.SimpleQueue()
        self._buf: torch.Tensor | None = None
        self._fill = 0
        self._sent = 0
        self._ended = False  # the I/O thread has seen the end

    def put(self, src: np.ndarray) -> None:
        """Copies ``src`` after the bytes so far; hands whole pieces to the writer."""
        while src.size:
            if self._buf is None:
                # A shared buffer's part: a base's small parts take little of the budget beside its tables.
                self._buf = self._pool.acquire(max(1, self._pool.nbytes // SHARED_PART))
                self._fill = self._sent = 0
            n = min(src.size, self._buf.numel() - self._fill)
            self._buf.numpy()[self._fill : self._fill + n] = src[:n]
            self._fill += n
            src = src[n:]
            if self._fill == self._buf.numel():
                self._send(self._fill, True)
            elif self._fill - self._sent >= STREAM_BYTES:
                self._send(self._fill // STREAM_BYTES * STREAM_BYTES, False)

    def end(self) -> None:
        self._send(self._fill, True)
        self._ready.put(None)

    def pieces(self) -> Iterator[memoryview]:
        """The file's bytes as they become ready (runs on the I/O thread)."""
        while (item := self._next()) is not None:
            buf, lo, hi, last = item
            try:
                if hi > lo:
                    yield buf.numpy().data[lo:hi]
            finally:
                if last:
                    self._pool.release(buf)

    def drain(self) -> None:
        """Once the file's write has ended, written or failed: gives back every buffer still to
        come until the pack ends, so the saving thread never waits for one."""
        while not self._ended:
            item = self._next()
            if item is not None and item[3]:
                self._pool.release(item[0])

    def _next(self) -> tuple[torch.Tensor, int, int, bool] | None:
        item = self._ready.get()
        self._ended = item is None
        return item

    def _send(self, upto: int, last: bool) -> None:
        if self._buf is None:
            return
        self._ready.put((self._buf, self._sent, upto, last))
        self._sent = upto
        if last:
            self._buf = None
