"""Writing a file's bytes, whole aligned blocks past the page cache (``O_DIRECT``).

Large writes bypass the page cache (``O_DIRECT``): the whole 4 KiB blocks of a part written at a
block-aligned offset go straight to the disk, from the part's own memory where it starts on a
block boundary (the staging pool's buffers do), else copied through an aligned 8 MiB buffer each
writing thread keeps (a tensor's memory starts 64 B past a page, so a base written from its
tensors went wholly through the page cache before); the rest goes through the page cache. On
this project's VM a new file's page cache costs a page fault per page in memory the host has
reclaimed, so buffered writes of fresh files run at 0.3-2.4 GB/s and direct ones at 1.4-4.3 GB/s
(``shared/baselines.md``, and 5.2 MB: 3.7 ms direct vs 16 ms buffered measured beside each
other), and the copy costs less than that difference (memcpy runs at 13 GB/s here). A file
system that refuses ``O_DIRECT`` gets buffered writes.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from collections.abc import Iterable

import numpy as np

log = logging.getLogger(__name__)

BLOCK = 4096  # the alignment O_DIRECT needs, of memory, file offset and length
DIRECT_MIN = 1 << 20  # smaller writes go through the page cache, where their fsync is cheap
BOUNCE = 8 << 20  # per-thread aligned buffer that unaligned memory is copied through for O_DIRECT


class DirectWriter:
    """Writes files of one directory tree, direct where the file system allows it.

    Args:
        root: the tree (named in the log when its file system refuses ``O_DIRECT``).
    """

    def __init__(self, root: str):
        self.root = root
        self._local = threading.local()
        self._direct = getattr(os, "O_DIRECT", 0)  # 0 once the file system refuses it

    def write(self, fd: int, parts: Iterable[memoryview]) -> int:
        """Writes ``parts`` one after the other into the open file ``fd``, from its start;
        returns the bytes that went direct."""
        at = direct = 0
        for part in parts:
            data = part.cast("B")
            if self._direct and at % BLOCK == 0 and len(data) >= DIRECT_MIN:
                n = self._write_direct(fd, data[: len(data) // BLOCK * BLOCK])
                at, data, direct = at + n, data[n:], direct + n
            write_all(fd, data)
            at += len(data)
        return direct

    def _write_direct(self, fd: int, data: memoryview) -> int:
        """Writes whole blocks past the page cache, from their own memory if it is aligned, else
        through this thread's aligned bounce buffer; returns the bytes written, 0 when the file
        system refuses (then direct writes stay off)."""
        pieces = [data] if _address(data) % BLOCK == 0 else None
        bounce = None
        if pieces is None:
            bounce = self._bounce()
            pieces = [data[i : i + len(bounce)] for i in range(0, len(data), len(bounce))]
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            first = pieces[0] if bounce is None else _copy(bounce, pieces[0])
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | self._direct)
            done = os.write(fd, first)  # a refusal shows here or in the line above
        except OSError as e:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            if e.errno != errno.EINVAL:
                raise
            log.debug("%s: no O_DIRECT on this file system (%s); writing through the page cache",
                      self.root, e)
            self._direct = 0
            return 0
        try:
            write_all(fd, first[done:])
            for piece in pieces[1:]:
                write_all(fd, piece if bounce is None else _copy(bounce, piece))
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return len(data)

    def _bounce(self) -> memoryview:
        """This thread's aligned buffer for direct writes of unaligned memory, kept for reuse
        (fresh memory is slow on this project's VMs)."""
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            raw = np.empty(BOUNCE + BLOCK, np.uint8)
            start = -raw.ctypes.data % BLOCK
            buf = self._local.bounce = raw[start : start + BOUNCE].data
        return buf


def write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _copy(into: memoryview, data: memoryview) -> memoryview:
    """``data`` copied to the start of ``into``; the copy. numpy copies without holding the
    GIL (a memoryview's slice assignment holds it: the training thread stalled behind it)."""
    np.copyto(np.frombuffer(into, np.uint8)[: len(data)], np.frombuffer(data, np.uint8))
    return into[: len(data)]


def _address(data: memoryview) -> int:
    return np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0
