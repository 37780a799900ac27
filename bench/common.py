"""Helpers shared by the benches: warm reserve memory, page-cache eviction, other processes' CPU time.

Imported as ``from common import ...``: a bench run as ``python bench/X.py`` has ``bench/`` on
``sys.path`` (so do the ranks bench_distributed.py spawns).

Memory on this VM (see the project baselines, "cold guest memory"): idle guest memory goes back to
the host within seconds and touching it again is slow, so the benches hold touched memory between
timed operations (:class:`Reserve`) and free the part an operation will allocate right before it.
"""

from __future__ import annotations

import os

import numpy as np

MiB = 1 << 20


class Reserve:
    """Touched memory held between operations; the part an operation needs is freed right before it.

    Held in pieces of ``piece`` bytes so that only what the next operation will allocate is freed:
    freed memory that stays unused goes back to the host within seconds and is slow to touch again.
    """

    def __init__(self, nbytes: int = 0, piece: int = 64 * MiB):
        self.PIECE = piece
        self.pieces = 0
        self._held: list[np.ndarray] = []
        self.resize(nbytes)

    def resize(self, nbytes: int) -> None:
        """Holds ``nbytes`` (rounded up to whole pieces) from now on; touches what is missing."""
        self.pieces = -(-nbytes // self.PIECE)
        del self._held[self.pieces:]
        self.hold()

    def hold(self) -> None:
        """Touches pieces again until the reserve is whole."""
        while len(self._held) < self.pieces:
            a = np.empty(self.PIECE, dtype=np.uint8)
            a.fill(1)
            self._held.append(a)

    def free(self, nbytes: int) -> None:
        """Frees enough pieces for ``nbytes`` (rounded up), or all that are held."""
        for _ in range(min(len(self._held), -(-nbytes // self.PIECE))):
            self._held.pop()


def files(path: str) -> list[str]:
    """``path`` if it is a file, else every file below it (none if it does not exist)."""
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def evict(*paths: str, sync: bool = True) -> None:
    """Drops the files at or below ``paths`` (the bench's own) from the page cache.

    Each file is fsynced first unless ``sync`` is false (for files known to be clean): dirty pages
    are not dropped.
    """
    for path in paths:
        for p in files(path):
            fd = os.open(p, os.O_RDONLY)
            try:
                if sync:
                    os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def tree_bytes(path: str) -> int:
    """Bytes of the file ``path`` or of every file below it (the sum of sizes); 0 if absent."""
    return sum(os.path.getsize(p) for p in files(path))


def cpu_seconds(children: bool = False) -> tuple[float, float] | None:
    """(user-space CPU seconds of the whole machine, of this process) so far; None off Linux.

    With ``children``, this process's share includes its waited-for children. User time only: the
    kernel work a bench itself causes (block I/O, journal commits, free page reporting after it
    frees memory) runs in kernel threads and would count as "others".
    """
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    t = os.times()
    return (v[0] + v[1]) / os.sysconf("SC_CLK_TCK"), t.user + (t.children_user if children else 0.0)


def others_cpu(start: tuple[float, float] | None, end: tuple[float, float] | None) -> float | None:
    """User-space CPU seconds other processes used between two :func:`cpu_seconds` readings."""
    if start is None or end is None:
        return None
    return max(0.0, (end[0] - start[0]) - (end[1] - start[1]))
