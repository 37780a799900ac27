"""Long-lived host buffers for staging chunks between tensors and storage.

Fresh memory is slow on many VMs (the host reclaims idle pages, and touching them again costs a
page fault each: 512 MiB copied into a fresh buffer took 0.29-0.42 s on one, into a touched one
0.03 s), and allocating per save would make peak memory grow with the model. The pool holds a
fixed number of chunk-sized buffers, allocated on first use and reused by every save and restore;
a caller waits when all are in use, which bounds the memory a save or restore adds. Buffers start
on a 4 KiB boundary, so storage can write them past the page cache (``O_DIRECT``).

A closed pool's buffers outlive it in the process's reserve, already touched, for the next pool of
their size (a job that builds a new checkpointer, a test suite): at most as many as the largest
pool closed holds, until :func:`release_staging_memory`. :meth:`StagingPool.warm` touches buffers
ahead of the first copy, in the kernel's batch (``MADV_POPULATE_WRITE``) where it has one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import queue
import sys
import threading

import torch

from ..storage.direct import BLOCK


class StagingPool:
    """A bounded set of reusable byte buffers.

    Args:
        buffers: how many buffers may exist at once.
        nbytes: size of each buffer.
        pin: allocate in pinned memory (for copies from CUDA).
    """

    def __init__(self, buffers: int, nbytes: int, *, pin: bool = False):
        self.buffers = buffers
        self.nbytes = nbytes
        self._pin = pin
        self._free: queue.LifoQueue[torch.Tensor] = queue.LifoQueue()
        self._buffers: dict[int, torch.Tensor] = {}  # every pooled buffer, by address
        self._slots = threading.Semaphore(buffers)
        self._zeros = torch.zeros(0, dtype=torch.uint8)
        self._lock = threading.Lock()
        self._coming = 0  # buffers being warmed, not yet in _buffers
        self._closed = False  # closed: warm() makes no more

    def zeros(self, nbytes: int) -> memoryview:
        """``nbytes`` zero bytes from a long-lived buffer (for padding edge chunks); read-only use."""
        with self._lock:
            if nbytes > self._zeros.numel():
                self._zeros = torch.zeros(max(nbytes, self.nbytes), dtype=torch.uint8)
            return self._zeros.numpy().data[:nbytes]

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly ``nbytes``; blocks while all buffers are in use.

        A request larger than the pool's buffer size (a single row bigger than a chunk) gets a
        one-off buffer of its own, still counted against the pool's slots.
        """
        self._slots.acquire()
        if nbytes > self.nbytes:
            return _aligned(nbytes, self._pin)
        return self._take()[:nbytes]

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            pooled = self._buffers.get(buf.data_ptr())
        if pooled is not None:
            self._free.put(pooled)
        self._slots.release()

    def touched_bytes(self) -> int:
        """The bytes of the buffers the pool holds or may take from the reserve, every page of
        which has been touched (a buffer a save or :meth:`warm` made stays touched)."""
        with self._lock:
            held = len(self._buffers)
        return min(self.buffers, held + _RESERVE.count(self.nbytes, self._pin)) * self.nbytes

    def warm(self, buffers: int) -> None:
        """Makes up to ``buffers`` of the pool's buffers (never more than it may hold) exist with
        every page touched, so that the copies into them fault no page; from any thread. Once
        the pool is closed it makes no more, and the one it was making goes to the reserve."""
        while True:
            with self._lock:
                if self._closed or len(self._buffers) + self._coming >= min(buffers, self.buffers):
                    return
                self._coming += 1
            buf: torch.Tensor | None = None
            try:
                buf = _RESERVE.take(self.nbytes, self._pin)
                if buf is None:
                    buf = _touch(_aligned(self.nbytes, self._pin))
            finally:
                with self._lock:
                    self._coming -= 1
                    if buf is not None and not self._closed:
                        self._buffers[buf.data_ptr()] = buf
                        self._free.put(buf)
                        buf = None
            if buf is not None:  # closed meanwhile: the next pool's
                _RESERVE.give(self.nbytes, self._pin, [buf], self.buffers)

    def close(self) -> None:
        """Gives the pool's free buffers to the process's reserve, for the next pool of their
        size (a buffer still in use is not given), and stops :meth:`warm` (one still running
        behind the last save would make buffers that go with the pool, and the next checkpointer
        would stage into fresh memory)."""
        free = []
        with self._lock:
            self._closed = True
            while True:
                try:
                    free.append(self._free.get_nowait())
                except queue.Empty:
                    break
            for buf in free:
                del self._buffers[buf.data_ptr()]
        _RESERVE.give(self.nbytes, self._pin, free, self.buffers)

    def _take(self) -> torch.Tensor:
        """A buffer of the pool's size, for a caller holding a slot: a free one, one from the
        reserve, a new one while fewer than ``buffers`` exist or are being warmed, else the next
        one given back (this caller's slot is free, so one is free or on its way)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if len(self._buffers) + self._coming < self.buffers:
                buf = _RESERVE.take(self.nbytes, self._pin)
                buf = _aligned(self.nbytes, self._pin) if buf is None else buf
                self._buffers[buf.data_ptr()] = buf
                return buf
        return self._free.get()


class _Reserve:
    """Buffers of closed pools, by size and pinning, kept touched for the next pool."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}

    def take(self, nbytes: int, pin: bool) -> torch.Tensor | None:
        with self._lock:
            kept = self._free.get((nbytes, pin))
            return kept.pop() if kept else None

    def count(self, nbytes: int, pin: bool) -> int:
        with self._lock:
            return len(self._free.get((nbytes, pin), ()))

    def give(self, nbytes: int, pin: bool, buffers: list[torch.Tensor], keep: int) -> None:
        """Keeps ``buffers``, up to ``keep`` buffers of their kind in all."""
        with self._lock:
            kept = self._free.setdefault((nbytes, pin), [])
            kept.extend(buffers[: max(0, keep - len(kept))])

    def release(self) -> int:
        with self._lock:
            freed = sum(nbytes * len(kept) for (nbytes, _), kept in self._free.items())
            self._free.clear()
        return freed


_RESERVE = _Reserve()


def release_staging_memory() -> int:
    """Frees the staging buffers that closed checkpointers left for the next one of the process
    (open ones keep theirs); returns how many bytes they held.

    Example:
        >>> import tempfile, torch, deltackpt
        >>> with deltackpt.Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     _ = ckpt.save(1, {"t": torch.zeros(8)})
        >>> deltackpt.release_staging_memory() > 0
        True
    """
    return _RESERVE.release()


def _aligned(nbytes: int, pin: bool) -> torch.Tensor:
    raw = torch.empty(nbytes + BLOCK, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % BLOCK
    return raw[start : start + nbytes]


_MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None

POPULATE_BYTES = 2 << 20
"""The most :func:`_touch` faults in one call. The call holds the process's memory map lock
throughout, and every ``mmap`` and ``munmap`` of the process waits for it: a training step
allocates and frees its large tensors so, and its steps beside a warm of 2 GiB took 2.3-8.9x their
time alone in calls of 32 MiB, 1.1-1.6x in calls of 2 MiB (a write per page: 0.9-1.3x)."""


def _touch(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` (4 KiB aligned) with every page faulted in: by the kernel in calls of
    ``POPULATE_BYTES`` where it can (2 GiB in 0.74-0.75 s on this project's VM, against 0.79-0.81 s
    by a write per page, and 0.70-0.73 s in calls of 32 MiB), else by a write per page."""
    whole = buf.numel() // BLOCK * BLOCK
    start = buf.data_ptr()
    if not (whole and _libc is not None and all(_libc.madvise(
            ctypes.c_void_p(start + lo), ctypes.c_size_t(min(POPULATE_BYTES, whole - lo)),
            _MADV_POPULATE_WRITE) == 0 for lo in range(0, whole, POPULATE_BYTES))):
        buf.numpy()[::BLOCK] = 0
    return buf
