"""Where a tensor's parts lie and which rank's part table lists each, by rule: a tensor's
``layout`` in the root record, so that a reader of some boxes opens only the tables holding the
parts that meet them.

A layout is a grid and its writers. The grid gives, per dimension, either the block of an even
split (cuts at every multiple of the block, the last block shorter, as ``torch.chunk`` and
row- or column-wise sharding split) or its cuts inside the dimension, listed; its cells, in
row-major order (the order of their offsets), are the parts ``p0``, ``p1``, ... (a single cell
is the part ``""``). The writers are runs ``[rank, count]``: the next ``count`` parts are listed
by the tables of ranks ``rank``, ``rank + 1``, ... A tensor whose parts form no such grid, that
has no elements, or whose grid or writers would take more than :data:`MAX_LISTED` numbers, has
no layout: a reader reads every table of its ``ranks``.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ManifestError
from ..sharding import Box

MAX_LISTED = 32  # cuts listed along one dimension, and runs of writers, in one tensor's layout


@dataclass(frozen=True)
class Axis:
    """One dimension of a grid: its size and its block, or its cuts inside it."""

    size: int
    block: int | None
    cuts: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return -(-self.size // self.block) if self.block is not None else len(self.cuts) + 1

    def bounds(self, i: int) -> tuple[int, int]:
        """Cell ``i``'s ``[lo, hi)``."""
        if self.block is not None:
            return i * self.block, min(self.size, (i + 1) * self.block)
        edges = (0, *self.cuts, self.size)
        return edges[i], edges[i + 1]

    def meeting(self, lo: int, hi: int) -> range:
        """The cells that share an element with ``[lo, hi)``."""
        lo, hi = max(lo, 0), min(hi, self.size)
        if lo >= hi:
            return range(0)
        if self.block is not None:
            return range(lo // self.block, -(-hi // self.block))
        return range(bisect.bisect_right(self.cuts, lo), bisect.bisect_left(self.cuts, hi) + 1)

    def to_doc(self) -> int | list[int]:
        return self.block if self.block is not None else list(self.cuts)


@dataclass(frozen=True)
class PartLayout:
    """A tensor's parts by rule (see the module's docstring)."""

    axes: tuple[Axis, ...]
    runs: tuple[tuple[int, int], ...]  # (first rank, parts)

    @property
    def count(self) -> int:
        return math.prod(a.count for a in self.axes)

    def path(self, i: int) -> str:
        return f"p{i}" if self.count > 1 else ""

    def box(self, i: int) -> Box:
        """Part ``i``'s box."""
        lo, hi = [], []
        for axis, k in zip(self.axes, np.unravel_index(i, [a.count for a in self.axes]) if self.axes else ()):
            a, b = axis.bounds(int(k))
            lo.append(a)
            hi.append(b)
        return Box(tuple(lo), tuple(b - a for a, b in zip(lo, hi)))

    def writer(self, i: int) -> int:
        """The rank whose table lists part ``i``."""
        for rank, n in self.runs:
            if i < n:
                return rank + i
            i -= n
        raise IndexError(i)

    def ranks(self) -> list[int]:
        """The ranks whose tables list its parts, sorted."""
        out: list[int] = []
        for first, last in _merged(self.runs):
            out.extend(range(first, last + 1))
        return out

    def written_by(self, rank: int) -> list[int]:
        """The parts rank ``rank``'s table lists."""
        out, at = [], 0
        for first, n in self.runs:
            if first <= rank < first + n:
                out.append(at + rank - first)
            at += n
        return out

    def meeting(self, box: Box) -> Iterator[int]:
        """The parts that share an element with ``box``, ascending."""
        ranges = [a.meeting(o, o + s) for a, o, s in zip(self.axes, box.offset, box.shape)]
        counts = [a.count for a in self.axes]
        for cell in itertools.product(*ranges):
            yield int(np.ravel_multi_index(cell, counts)) if cell else 0

    def problem(self, boxes: Sequence[Box], writers: Sequence[int]) -> str | None:
        """Why parts of ``boxes`` (in path order, as many as the layout's), listed by the
        tables of ``writers``, are not this layout's; None if they are."""
        lo, hi = _cells(self.axes)
        offsets, ends = _corners(boxes, len(self.axes))
        at = np.flatnonzero(np.any(offsets != lo, axis=1) | np.any(ends != hi, axis=1))
        if len(at):
            i = int(at[0])
            want = self.box(i)
            return (f"part {self.path(i)!r} at {list(boxes[i].offset)} of {list(boxes[i].shape)}, its layout "
                    f"says at {list(want.offset)} of {list(want.shape)}")
        ranks = np.concatenate([np.arange(r, r + n) for r, n in self.runs])
        at = np.flatnonzero(np.asarray(writers, np.int64) != ranks)
        if len(at):
            i = int(at[0])
            return f"part {self.path(i)!r} is in the table of rank {writers[i]}, its layout says {int(ranks[i])}"
        return None

    def to_doc(self) -> dict[str, Any]:
        return {"grid": [a.to_doc() for a in self.axes], "writers": [list(r) for r in self.runs]}


def describe(shape: Sequence[int], boxes: Sequence[Box], writers: Sequence[int]) -> PartLayout | None:
    """The layout of parts of ``boxes`` (in path order) listed by the tables of ``writers``, or
    None when they follow none (see the module's docstring)."""
    ndim = len(shape)
    if not boxes or any(len(b.offset) != ndim or len(b.shape) != ndim for b in boxes):
        return None
    offsets, ends = _corners(boxes, ndim)
    axes = grids_of(np.array([shape], np.int64).reshape(1, ndim), np.array([ndim]), np.array([0]),
                    np.array([len(boxes)]), offsets, ends)[0]
    return layout_of(axes, writers)


def layout_of(axes: tuple[Axis, ...] | None, writers: Sequence[int]) -> PartLayout | None:
    """The layout of the cells of grid ``axes`` listed by the tables of ``writers``, or None
    when there is no grid, or it or the writers take more than :data:`MAX_LISTED` numbers."""
    if axes is None or any(len(a.cuts) > MAX_LISTED for a in axes):
        return None
    runs = runs_of(writers)
    return None if runs is None else PartLayout(axes, runs)


def grids_of(shapes: np.ndarray, ndims: np.ndarray, first: np.ndarray, count: np.ndarray,
             offsets: np.ndarray, ends: np.ndarray) -> list[tuple[Axis, ...] | None]:
    """For each of several tensors, the grid whose cells, in row-major order, are its parts, or
    None when they form none (then they may or may not tile the tensor; when they do, they tile
    it exactly). A grid may list any number of cuts here (see :func:`layout_of`).

    Tensor ``t`` has shape ``shapes[t, :ndims[t]]`` (its other columns 1) and the parts of rows
    ``first[t]`` to ``first[t] + count[t]`` of ``offsets`` and ``ends`` (their low and high
    corners, the other columns 0 and 1), sorted by offset. Even splits are checked on every
    part at once; only the tensors that are not split evenly are looked at one by one.
    """
    n = len(first)
    out: list[tuple[Axis, ...] | None] = [None] * n
    if not n:
        return out
    width = shapes.shape[1]
    ask = (np.prod(shapes, axis=1) > 0) & (count > 0)
    # An even split, read from the first part: blocks of its ends (the whole size where it ends at 0).
    top = ends[np.minimum(first, max(len(ends) - 1, 0))] if len(ends) else np.ones_like(shapes)
    block = np.where((top > 0) & (top <= shapes), top, np.maximum(shapes, 1))
    cells = -(-shapes // block)
    even = ask & (np.prod(cells, axis=1) == count)
    taken = np.where(even, count, 0)
    rows = np.repeat(np.arange(n), taken)
    if len(rows):
        rest = np.arange(len(rows)) - np.repeat(np.cumsum(taken) - taken, taken)  # each part's place
        at = first[rows] + rest
        low, high = (offsets, ends) if len(at) == len(offsets) else (offsets[at], ends[at])  # in order
        cut, each = np.repeat(cells, taken, axis=0), np.repeat(block, taken, axis=0)
        lo = np.empty((len(rows), width), np.int64)
        for d in range(width - 1, -1, -1):
            rest, k = np.divmod(rest, cut[:, d])
            lo[:, d] = k * each[:, d]
        wrong = np.any(lo != low, axis=1)
        wrong |= np.any(np.minimum(lo + each, np.repeat(shapes, taken, axis=0)) != high, axis=1)
        even[np.unique(rows[wrong])] = False
    for t in np.flatnonzero(even).tolist():
        d = int(ndims[t])
        out[t] = tuple(Axis(s, b) for s, b in zip(shapes[t, :d].tolist(), block[t, :d].tolist()))
    for t in np.flatnonzero(ask & ~even).tolist():
        f, c, d = int(first[t]), int(count[t]), int(ndims[t])
        out[t] = _listed(tuple(shapes[t, :d].tolist()), offsets[f:f + c, :d], ends[f:f + c, :d])
    return out


def _listed(shape: tuple[int, ...], offsets: np.ndarray, ends: np.ndarray) -> tuple[Axis, ...] | None:
    """The grid of each dimension's cuts, listed, whose cells are the parts of corners
    ``offsets`` and ``ends`` (in path order), or None."""
    listed = []
    for d, size in enumerate(shape):
        starts = np.unique(offsets[:, d])
        if starts[0] != 0 or starts[-1] >= size:
            return None
        listed.append(Axis(size, None, tuple(starts[1:].tolist())))
    axes = tuple(listed)
    if math.prod(a.count for a in axes) != len(offsets) or not _are_cells(axes, offsets, ends):
        return None
    return axes


def runs_of(writers: Sequence[int]) -> tuple[tuple[int, int], ...] | None:
    """``writers`` as runs ``(rank, count)`` of consecutive ranks, or None when they take more
    than :data:`MAX_LISTED`."""
    ranks = np.asarray(writers, np.int64)
    breaks = np.flatnonzero(np.diff(ranks) != 1) + 1
    if len(breaks) >= MAX_LISTED or not len(ranks):
        return None
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(ranks)]))
    return tuple((int(ranks[a]), int(b - a)) for a, b in zip(starts, stops))


def _are_cells(axes: Sequence[Axis], offsets: np.ndarray, ends: np.ndarray) -> bool:
    lo, hi = _cells(axes)
    return np.array_equal(offsets, lo) and np.array_equal(ends, hi)


def _corners(boxes: Sequence[Box], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """The boxes' low and high corners, one row per box."""
    offsets = np.array([b.offset for b in boxes], np.int64).reshape(len(boxes), ndim)
    return offsets, offsets + np.array([b.shape for b in boxes], np.int64).reshape(len(boxes), ndim)


def _cells(axes: Sequence[Axis]) -> tuple[np.ndarray, np.ndarray]:
    """Every cell's low and high corners, one row per cell in row-major order."""
    if not axes:
        return np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64)
    edges = []
    for a in axes:
        if a.block is not None:
            lo = np.arange(a.count, dtype=np.int64) * a.block
            edges.append((lo, np.minimum(lo + a.block, a.size)))
        else:
            cuts = np.array([0, *a.cuts, a.size], np.int64)
            edges.append((cuts[:-1], cuts[1:]))
    index = [k.reshape(-1) for k in np.meshgrid(*[np.arange(a.count) for a in axes], indexing="ij")]
    return (np.stack([e[0][k] for e, k in zip(edges, index)], axis=1),
            np.stack([e[1][k] for e, k in zip(edges, index)], axis=1))


def parse_layout(doc: Any, shape: tuple[int, ...], parts: int, ranks: Sequence[tuple[int, int]],
                 where: str) -> PartLayout:
    """A tensor's ``layout`` as its root record gives it, checked against its ``shape``, its
    ``parts`` count and its ``ranks`` (as the root's sorted ``[first, last]`` runs).

    Raises:
        ManifestError: naming ``where`` and what is wrong.
    """
    def bad(what: str) -> ManifestError:
        return ManifestError(f"{where}: field 'layout' {what}")

    if not isinstance(doc, dict) or set(doc) != {"grid", "writers"}:
        raise bad(f"must be an object of 'grid' and 'writers', got {doc!r:.80}")
    grid, runs = doc["grid"], doc["writers"]
    if not isinstance(grid, list) or len(grid) != len(shape) or not math.prod(shape):
        raise bad(f"has a grid {grid!r:.80} for shape {list(shape)}")
    axes = []
    for size, d in zip(shape, grid):
        if _is_int(d) and 1 <= d <= size:
            axes.append(Axis(size, d))
        elif (isinstance(d, list) and len(d) <= MAX_LISTED and all(_is_int(c) for c in d)
              and all(a < b for a, b in zip([0, *d], [*d, size]))):
            axes.append(Axis(size, None, tuple(d)))
        else:
            raise bad(f"has a bad axis {d!r:.80} for size {size}")
    if (not isinstance(runs, list) or not 0 < len(runs) <= MAX_LISTED or any(
            not isinstance(r, list) or len(r) != 2 or not all(_is_int(v) for v in r) or r[1] < 1
            or r[0] + r[1] > 2**62 for r in runs)):
        raise bad(f"has bad writers {runs!r:.80}")
    layout = PartLayout(tuple(axes), tuple((r[0], r[1]) for r in runs))
    if layout.count != parts or sum(r[1] for r in runs) != parts:
        raise bad(f"makes {layout.count} parts listed by {sum(r[1] for r in runs)} writers, the tensor has {parts}")
    if _merged(layout.runs) != _merged((a, b - a + 1) for a, b in ranks):
        raise bad("names other ranks than 'ranks'")
    return layout


def _merged(runs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranks of ``runs`` as sorted, disjoint ``(first, last)`` intervals."""
    out: list[tuple[int, int]] = []
    for first, n in sorted(runs):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], first + n - 1))
        else:
            out.append((first, first + n - 1))
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62
