"""Long-lived host buffers for staging chunks between tensors and storage.

Fresh memory is slow on many VMs (the host reclaims idle pages, and touching them again costs a
page fault each), and allocating per save would make peak memory grow with the model. The pool
holds a fixed number of chunk-sized buffers, allocated on first use and reused by every save and
restore; a caller waits when all are in use, which bounds the memory a save or restore adds.
Buffers start on a 4 KiB boundary, so storage can write them past the page cache (``O_DIRECT``).
"""

from __future__ import annotations

import queue
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
            return self._aligned(nbytes)
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            buf = self._aligned(self.nbytes)
            with self._lock:
                self._buffers[buf.data_ptr()] = buf
        return buf[:nbytes]

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            pooled = self._buffers.get(buf.data_ptr())
        if pooled is not None:
            self._free.put(pooled)
        self._slots.release()

    def _aligned(self, nbytes: int) -> torch.Tensor:
        raw = torch.empty(nbytes + BLOCK, dtype=torch.uint8, pin_memory=self._pin)
        start = -raw.data_ptr() % BLOCK
        return raw[start : start + nbytes]
