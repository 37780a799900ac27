"""Helpers shared by the benches: warm reserve memory, page-cache eviction, other processes' CPU time.

Imported as ``from common import ...``: a bench run as ``python bench/X.py`` has ``bench/`` on
``sys.path`` (so do the ranks bench_distributed.py spawns).

Memory on this VM (see the project baselines, "cold guest memory"): idle guest memory goes back to
the host within seconds and touching it again is slow, so the benches hold touched memory between
timed operations (:class:`Reserve`) and free the part an operation will allocate right before it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from deltackpt.io.staging import aligned_buffer

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


@functools.cache
def _direct_buffer() -> memoryview:
    """32 MiB of random bytes in memory like a staging buffer's (aligned as O_DIRECT needs, in
    huge pages where the kernel has them: see ``deltackpt.io.staging.aligned_buffer``), made once."""
    buf = aligned_buffer(32 * MiB)
    buf.numpy()[:] = np.frombuffer(os.urandom(32 * MiB), np.uint8)
    return memoryview(buf.numpy())


def direct_bandwidth(folder: str, nbytes: int) -> float:
    """GB/s of a fresh file written with O_DIRECT in 32 MiB writes from one aligned buffer, fsync:
    the disk's bandwidth, and the least any writer of ``nbytes`` asks of the machine."""
    buf = _direct_buffer()
    path = os.path.join(folder, "direct.bin")
    left = -(-nbytes // 4096) * 4096  # whole blocks, as O_DIRECT needs
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        while left:
            left -= os.write(fd, buf[: min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    written = os.path.getsize(path)
    os.unlink(path)
    return written / seconds / 1e9


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


def figure(name: str, runs: list[float] | float, unit: str = "s", *, peer: str | None = None,
           peer_runs: list[float] | float | None = None, ratio: float | None = None) -> dict[str, Any]:
    """One row of a bench's figures: its median over ``runs`` and, beside a peer, the ratio of medians.

    Args:
        name: what was measured, as the bench's own table names it.
        runs: every round's value (or one value when the bench reports a single figure).
        unit: the unit of ``runs`` ("s", "B", "GB/s", "MiB", "x", ...).
        peer: the reference measured in the same run (``torch.save``, DCP, the disk, ...).
        peer_runs: the peer's values in the same rounds; ``ratio`` is then median / peer median.
        ratio: a ratio the bench computed itself, when it is not median / peer median.
    """
    values = [float(v) for v in (runs if isinstance(runs, list) else [runs])]
    row: dict[str, Any] = {"name": name, "unit": unit, "median": statistics.median(values), "runs": values}
    if peer is not None:
        row["peer"] = peer
    if peer_runs is not None:
        theirs = [float(v) for v in (peer_runs if isinstance(peer_runs, list) else [peer_runs])]
        row["peer_median"] = statistics.median(theirs)
        if ratio is None and row["peer_median"]:
            ratio = row["median"] / row["peer_median"]
    if ratio is not None:
        row["ratio"] = float(ratio)
    return row


def write_figures(path: str | None, bench: str, args: argparse.Namespace | dict[str, Any],
                  rows: list[dict[str, Any]], **series: Any) -> None:
    """Writes a bench's figures to ``path`` as JSON (nothing when ``path`` is None).

    Args:
        path: the file of the bench's ``--json`` option.
        bench: the bench's name (its script's stem).
        args: the options it ran with.
        rows: its figures, each made by :func:`figure`.
        **series: data behind plots (lists of numbers keyed by name), written as they are.
    """
    if path is None:
        return
    params = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    params.pop("json", None)
    doc = {"bench": bench, "params": params, "rows": rows, "series": series}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")


def json_option(parser: argparse.ArgumentParser) -> None:
    """Adds ``--json PATH`` (write the figures there as JSON as well as printing them)."""
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the figures as JSON to PATH (read by python -m bench)")


class RowwiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row (a 1-d sum per table), as FBGEMM's row-wise Adagrad."""

    def __init__(self, params, lr: float = 0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.coalesce()
                    ids, vals = g.indices()[0], g.values()
                    acc = self.state[p].setdefault("sum", torch.zeros(p.shape[0]))
                    acc.index_add_(0, ids, vals.pow(2).mean(1))
                    p.index_add_(0, ids, -group["lr"] * vals / (acc[ids].sqrt() + 1e-10)[:, None])
