"""Long-lived host buffers for staging chunks between tensors and storage.

Fresh memory is slow on many VMs (the host reclaims idle pages, and touching them again costs a
page fault each), and allocating per save would make peak memory grow with the model. The pool
holds a fixed number of chunk-sized buffers, allocated on first use and reused by every save and
restore; a caller waits when all are in use, which bounds the memory a save or restore adds.
"""

from __future__ import annotations

import queue
import threading

import torch


class StagingPool:
    """A bounded set of reusable byte buffers.

    Args:
        buffers: how many buffers may exist at once.
        nbytes: size of each buffer.
        pin: allocate in pinned memory (for copies from CUDA).
    """

    def __init__(self, buffers: int, nbytes: int, *, pin: bool = False):
        self.nbytes = nbytes
        self._pin = pin
        self._free: queue.LifoQueue[torch.Tensor] = queue.LifoQueue()
        self._slots = threading.Semaphore(buffers)
        self._zeros = torch.zeros(0, dtype=torch.uint8)
        self._lock = threading.Lock()

    def zeros(self, nbytes: int) -> memoryview:
        """``nbytes`` zero bytes from a long-lived buffer (for padding edge chunks); read-only use."""
        with self._lock:
            if nbytes > self._zeros.numel():
                self._zeros = torch.zeros(max(nbytes, self.nbytes), dtype=torch.uint8)
            return memoryview(self._zeros.numpy())[:nbytes]

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly ``nbytes``; blocks while all buffers are in use.

        A request larger than the pool's buffer size (a single row bigger than a chunk) gets a
        one-off buffer of its own, still counted against the pool's slots.
        """
        self._slots.acquire()
        if nbytes > self.nbytes:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self._pin)
        return buf[:nbytes]

    def release(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        if base.numel() == self.nbytes:
            self._free.put(base)
        self._slots.release()
