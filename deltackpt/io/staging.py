"""Long-lived host buffers for staging chunks between tensors and storage.

Fresh memory is slow on many VMs (the host reclaims idle pages, and touching them again costs a
page fault each: 512 MiB copied into a fresh buffer took 0.29-0.42 s on one, into a touched one
0.03 s), and allocating per save would make peak memory grow with the model. The pool holds a
fixed number of chunk-sized buffers, allocated on first use and reused by every save and restore;
a caller waits when all are in use, which bounds the memory a save or restore adds. Small requests
share a buffer (see :data:`SHARED_PART`), so a budget the size of a state stages it whole. Buffers
start on a 4 KiB boundary, so storage can write them past the page cache (``O_DIRECT``), and large ones
are in huge pages where the kernel has them (:func:`aligned_buffer`).

A closed pool's buffers outlive it in the process's reserve, already touched, for the next pool of
their size (a job that builds a new checkpointer, a test suite): at most as many as the largest
pool closed holds, until :func:`release_staging_memory`. :meth:`StagingPool.warm` touches buffers
ahead of the first copy, a write per page, and makes none while a save copies into the pool
(:meth:`StagingPool.staging`).
"""

from __future__ import annotations

import contextlib
import mmap
import queue
import threading
from collections.abc import Iterator
from functools import partial

import torch

from ..storage.direct import BLOCK
from .threads import exiting, run_ahead

SHARED_PART = 4
"""A request of at most ``1/SHARED_PART`` of the pool's buffer size is cut from a buffer shared with
other such requests (on a 4 KiB boundary each) rather than taking a whole one. A base of 8 tables
of 256 MiB and their 8 row-wise Adagrad sums of 2 MiB took 72 buffers of 32 MiB, where its bytes
fill 65: with a budget of the state's size (65 buffers), a background base waited 0.17 s for
writes of the 0.42-0.45 s it blocked training. A shared buffer holds one of the pool's places
while any request cut from it is held."""


class _Shared:
    """A buffer that small requests are cut from: the bytes cut so far, the requests held."""

    __slots__ = ("buf", "used", "held")

    def __init__(self, buf: torch.Tensor):
        self.buf, self.used, self.held = buf, 0, 0


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
        self._taken = 0  # places taken (of _slots), a shared buffer once
        self._shared: _Shared | None = None  # the buffer small requests are cut from now
        self._cuts: dict[int, _Shared] = {}  # every request cut and held, by address
        self._zeros = torch.zeros(0, dtype=torch.uint8)
        self._lock = threading.Lock()
        self._coming = 0  # buffers being warmed, not yet in _buffers
        self._closed = False  # closed: warm() makes no more
        self._copying = 0  # saves copying into the pool now (see staging)
        self._resumed = threading.Condition(self._lock)  # the last of them has ended, or closed

    def zeros(self, nbytes: int) -> memoryview:
        """``nbytes`` zero bytes from a long-lived buffer (for padding edge chunks); read-only use."""
        with self._lock:
            if nbytes > self._zeros.numel():
                self._zeros = torch.zeros(max(nbytes, self.nbytes), dtype=torch.uint8)
            return self._zeros.numpy().data[:nbytes]

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly ``nbytes``, starting on a 4 KiB boundary; blocks while all
        buffers are in use.

        A request of at most ``1/SHARED_PART`` of the buffer size is cut from a buffer shared with
        others (see :data:`SHARED_PART`). One larger than the pool's buffer size (a single row
        bigger than a chunk) gets a one-off buffer of its own, still counted against the pool's
        slots.
        """
        if nbytes * SHARED_PART <= self.nbytes:
            return self._cut(nbytes)
        self._take_place()
        if nbytes > self.nbytes:
            return aligned_buffer(nbytes, self._pin)
        return self._take()[:nbytes]

    def release(self, buf: torch.Tensor) -> None:
        address = _address(buf)
        with self._lock:
            shared = self._cuts.pop(address, None)
            if shared is not None:
                shared.held -= 1
                if shared.held:
                    return
                if shared is self._shared:
                    self._shared = None
                address = _address(shared.buf)
            pooled = self._buffers.get(address)
            self._taken -= 1
        if pooled is not None:
            self._free.put(pooled)
        self._slots.release()

    def taken(self) -> int:
        """How many of the pool's places are taken now (a buffer shared by small requests once)."""
        with self._lock:
            return self._taken

    def _take_place(self) -> None:
        self._slots.acquire()
        with self._lock:
            self._taken += 1

    def _cut(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` cut from the shared buffer, or from a fresh one when too few bytes are left
        (the one before goes back once every request cut from it has)."""
        size = max(1, -(-nbytes // BLOCK)) * BLOCK
        with self._lock:
            shared = self._shared
            if shared is not None and shared.used + size <= self.nbytes:
                return self._cut_from(shared, nbytes, size)
        self._take_place()
        fresh = _Shared(self._take())
        with self._lock:
            self._shared = fresh
            return self._cut_from(fresh, nbytes, size)

    def _cut_from(self, shared: _Shared, nbytes: int, size: int) -> torch.Tensor:
        out = shared.buf[shared.used : shared.used + nbytes]
        shared.used += size
        shared.held += 1
        self._cuts[_address(out)] = shared
        return out

    def touched_bytes(self) -> int:
        """The bytes of the buffers the pool holds or may take from the reserve, every page of
        which has been touched (a buffer a save or :meth:`warm` made stays touched)."""
        with self._lock:
            held = len(self._buffers)
        return min(self.buffers, held + _RESERVE.count(self.nbytes, self._pin)) * self.nbytes

    def warm(self, buffers: int) -> None:
        """Makes up to ``buffers`` of the pool's buffers (never more than it may hold) exist with
        every page touched, so that the copies into them fault no page; from any thread. Once
        the pool is closed it makes no more, and the one it was making goes to the reserve; nor
        once the interpreter exits (:func:`~deltackpt.io.threads.exiting`), which would wait."""
        while True:
            with self._lock:
                while self._copying and not self._closed:
                    self._resumed.wait()
                if self._closed or exiting() or len(self._buffers) + self._coming >= min(buffers, self.buffers):
                    return
                self._coming += 1
            buf: torch.Tensor | None = None
            try:
                buf = _RESERVE.take(self.nbytes, self._pin)
                if buf is None:
                    buf = _touch(aligned_buffer(self.nbytes, self._pin))
            finally:
                with self._lock:
                    self._coming -= 1
                    if buf is not None and not self._closed:
                        self._buffers[buf.data_ptr()] = buf
                        self._free.put(buf)
                        buf = None
            if buf is not None:  # closed meanwhile: the next pool's
                _RESERVE.give(self.nbytes, self._pin, [buf], self.buffers)

    def warm_ahead(self, nbytes: int) -> None:
        """:meth:`warm`, behind the caller (:func:`~deltackpt.io.threads.run_ahead`), of the buffers
        a save of ``nbytes`` takes and the two any save may take besides."""
        run_ahead(partial(self.warm, -(-nbytes // self.nbytes) + 2))

    @contextlib.contextmanager
    def staging(self) -> Iterator[None]:
        """While a save copies into the pool, or a restore reads into it: :meth:`warm` makes no
        buffer (it goes on once the last of them has ended). The save takes the touched buffers
        and makes the others as it copies. A warm beside it faulted pages at the same time and held
        the process's memory map lock: a base staged two training steps after the first (2.2 GB,
        the warm not done) spent 0.17-0.22 s in the allocations of its row hashes alone, 0.01 s
        with the warm waiting, and blocked training 0.20-0.93 s (median 0.79 s of 6) against
        0.34-0.87 s (median 0.55 s); a restore of it right after ``track()`` (a budget of 256 MiB)
        took 0.65-0.78 s against 0.50-0.58 s."""
        with self._lock:
            self._copying += 1
        try:
            yield
        finally:
            with self._lock:
                self._copying -= 1
                self._resumed.notify_all()

    def close(self) -> None:
        """Gives the pool's free buffers to the process's reserve, for the next pool of their
        size (a buffer still in use is not given), and stops :meth:`warm` (one still running
        behind the last save would make buffers that go with the pool, and the next checkpointer
        would stage into fresh memory)."""
        free = []
        with self._lock:
            self._closed = True
            self._resumed.notify_all()
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
                buf = aligned_buffer(self.nbytes, self._pin) if buf is None else buf
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


def _address(buf: torch.Tensor) -> int:
    """Where ``buf`` starts, an empty one too (whose ``data_ptr`` is 0)."""
    return buf.untyped_storage().data_ptr() + int(buf.storage_offset()) * buf.element_size()


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


HUGE_PAGE = 2 << 20
"""Host buffers of at least this many bytes start on a boundary of this size and are advised into
transparent huge pages (``MADV_HUGEPAGE``) where the kernel has them: a direct write from huge
pages pins a few pages, not thousands, and on this project's VM 68 files of 32 MiB, each written
with ``O_DIRECT`` and fsynced, went at 2.08-2.20 GB/s from huge pages against 1.87 GB/s from
4 KiB ones, the kernel spending 0.009-0.013 s of CPU a GB against 0.039 s (a whole base of
2.19 GB: 2.29 against 2.20 GB/s, medians of 6 side by side). The advice is a hint:
where the kernel has none to give, the pages are 4 KiB ones. (Pinned memory is the CUDA
allocator's, not advised.)"""


def aligned_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """``nbytes`` of fresh host memory (uint8) on a 4 KiB boundary, as ``O_DIRECT`` needs, in huge
    pages where it is large (see :data:`HUGE_PAGE`); pinned for copies from CUDA with ``pin``.

    A mapping of its own, not the allocator's: memory the process freed and took back would be in
    the 4 KiB pages it had. The slack mapped around it for the alignment is never touched, so it
    takes no memory.

    Example:
        >>> aligned_buffer(4 << 20).data_ptr() % 4096
        0
    """
    if pin or not hasattr(mmap, "MAP_PRIVATE"):  # CUDA's allocator; or Windows: the allocator's
        raw = torch.empty(nbytes + BLOCK, dtype=torch.uint8, pin_memory=pin)
        start = -raw.data_ptr() % BLOCK
        return raw[start : start + nbytes]
    huge = nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    # Private (a shared one is shared memory, which has no anonymous huge pages), on a page boundary.
    region = mmap.mmap(-1, max(1, nbytes + (HUGE_PAGE if huge else 0)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping while the tensor lives
    start = -raw.data_ptr() % HUGE_PAGE if huge else 0
    if huge:
        # Advice: where the kernel has no huge pages to give, the pages are 4 KiB ones.
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return raw[start : start + nbytes]


def _touch(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` (4 KiB aligned) with every page faulted in, by a write per page (numpy's, which
    lets the GIL go). Not by the kernel's batch (``MADV_POPULATE_WRITE``), which holds the
    process's memory map lock through each call of 2 MiB, so that a training step's allocations
    wait for it (a fault faults one page). Beside a warm of 65 buffers of 32 MiB into memory the
    host had to give back, on this project's 2-core VM, 2 processes of 3 rounds a side: training
    steps took 0.94-1.04x their time alone against 1.95-2.66x with the kernel faulting 2 MiB a
    call, and the warm 2.2-5.1 s against 2.8-6.3 s (beside a thread holding the GIL, each call's
    return waiting for it: 3.2-3.3 s against 9.3-11.2 s)."""
    buf.numpy()[::BLOCK] = 0
    return buf
