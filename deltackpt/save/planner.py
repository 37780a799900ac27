"""Save planning: every rank's local plan, and the coordinator's global plan.

A local plan lists, per tensor key, the box a rank holds (ranges, never row lists), as columns:
one array per field, a row per tensor, so that thousands of ranks' plans travel and are read as
a few buffers each, not as an object per tensor. The global plan gives every distinct box of
every tensor exactly one writer: a box one rank holds is written by it; replicas (the same box on
several ranks) are written once, by the holder with the fewest bytes to write so far, largest
boxes first, which spreads the writes evenly. Validation checks that every tensor's boxes agree
on dtype and global shape and tile it exactly. The coordinator works on every rank's columns at
once (sorting, grouping, grid checks on arrays); it makes no object per part: a rank makes the
objects of the parts it writes, from its own plan and its :class:`Assignment`.

The plan is deterministic in its input, so a cached plan stays valid while no rank's local plan
changes. Only the coordinator holds it: the ranks send it their local plans (each only when it
changed) and receive only the parts they write (each only when the plan changed): no rank but it
receives anything that grows with the world.
"""

from __future__ import annotations

import functools
import hashlib
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from .. import statetree
from ..collector import paused
from ..errors import StateError, StepExistsError
from ..format import dtypes
from ..format.part_layout import PartLayout, grids_of, layout_of
from ..sharding import Box, check_tiling

DTYPES = tuple(sorted(dtypes.NAMES))  # a local plan's dtype codes index this
_ITEMSIZE = np.array([dtypes.from_name(d).itemsize for d in DTYPES], np.int64)


def _same(a: Any, b: Any) -> bool:
    """Equal dataclasses of the same type, their arrays compared element by element."""
    return type(a) is type(b) and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in ((getattr(a, f.name), getattr(b, f.name)) for f in fields(a)))


@dataclass(frozen=True, eq=False)
class LocalPlan:
    """What one rank holds: its tensors' boxes, as columns (a row per tensor, in key order), and its skeleton.

    Attributes:
        rank: the rank.
        keys: the tensors' flat keys, sorted, joined by NUL (which no key holds).
        dtype: each tensor's dtype, as its index in :data:`DTYPES` (uint8).
        ndim: each tensor's dimensions (int64).
        global_shape, offset, shape: each tensor's global shape and its box (int64, a column
            per dimension up to the plan's most; the columns past a tensor's ``ndim`` are 1, 0, 1).
        tree: the skeleton, pickled.
        settings: the chunk sizes; every rank must use the same.
    """

    rank: int
    keys: str
    dtype: np.ndarray
    ndim: np.ndarray
    global_shape: np.ndarray
    offset: np.ndarray
    shape: np.ndarray
    tree: bytes
    settings: tuple[int, ...]

    @classmethod
    def of(cls, rank: int, rows: Sequence[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]],
           tree: bytes, settings: tuple[int, ...]) -> LocalPlan:
        """The plan of the tensors ``rows`` on ``rank``: each tensor's key, dtype name, global
        shape, offset and local shape, sorted by key."""
        width = max((len(r[2]) for r in rows), default=0)
        ones, zeros = [(1,) * k for k in range(width + 1)], [(0,) * k for k in range(width + 1)]

        def column(values: list[tuple[int, ...]], pad: list[tuple[int, ...]]) -> np.ndarray:
            return np.array([v + pad[width - len(v)] for v in values], np.int64).reshape(len(rows), width)

        code = {d: i for i, d in enumerate(DTYPES)}
        return cls(rank, "\0".join(r[0] for r in rows), np.array([code[r[1]] for r in rows], np.uint8),
                   np.array([len(r[2]) for r in rows], np.int64), column([r[2] for r in rows], ones),
                   column([r[3] for r in rows], zeros), column([r[4] for r in rows], ones),
                   tree, settings)

    def names(self) -> list[str]:
        """The keys, in order."""
        return self.keys.split("\0") if self.keys else []

    def box(self, i: int) -> Box:
        """Tensor ``i``'s box."""
        n = int(self.ndim[i])
        return Box(tuple(self.offset[i, :n].tolist()), tuple(self.shape[i, :n].tolist()))

    def digest(self) -> str:
        h = hashlib.sha256(repr(self.settings).encode())
        for part in (self.keys.encode(), self.dtype, self.ndim, self.global_shape, self.offset, self.shape,
                     self.tree):
            data = bytes(part) if isinstance(part, bytes) else np.ascontiguousarray(part).tobytes()
            h.update(len(data).to_bytes(8, "little") + data)
        return h.hexdigest()

    def __eq__(self, other: object) -> bool:
        return _same(self, other)


@dataclass(frozen=True)
class PartPlan:
    """One box of a tensor and the rank that writes it. ``path`` names its folder ("" when the
    part is the whole tensor)."""

    box: Box
    writer: int
    path: str


@dataclass(frozen=True)
class TensorPlan:
    """A tensor: its ``count`` parts are rows ``first`` to ``first + count`` of the plan's part
    columns (sorted by offset), written by the sorted ``ranks``, by ``layout`` if they follow
    one (see :mod:`deltackpt.format.part_layout`)."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    first: int
    count: int
    ranks: list[int]
    layout: PartLayout | None = None


@dataclass(frozen=True, eq=False)
class GlobalPlan:
    """Every tensor with its parts' writers, and the merged skeleton.

    Attributes:
        tensors: every tensor, by key, in key order (its place is its index in the root record).
        tree: the merged skeleton.
        offset, shape: each part's box, a row per part by tensor then offset (int64, columns as
            a local plan's).
        writer: the rank that writes each part.
        item: each part's tensor's row in its writer's local plan.
    """

    tensors: dict[str, TensorPlan]
    tree: dict
    offset: np.ndarray
    shape: np.ndarray
    writer: np.ndarray
    item: np.ndarray

    def parts_of(self, key: str) -> tuple[PartPlan, ...]:
        """Tensor ``key``'s parts, made as objects."""
        t = self.tensors[key]
        n = len(t.global_shape)
        return tuple(PartPlan(Box(tuple(self.offset[i, :n].tolist()), tuple(self.shape[i, :n].tolist())),
                              int(self.writer[i]), "" if t.count == 1 else f"p{i - t.first}")
                     for i in range(t.first, t.first + t.count))

    @functools.cached_property
    def writers(self) -> dict[str, tuple[int, list[int], PartLayout | None]]:
        """Each tensor's part count, the sorted ranks that write its parts and their layout, if
        they follow one (what the root record lists of its parts), made once per plan."""
        return {t.key: (t.count, t.ranks, t.layout) for t in self.tensors.values()}

    @functools.cached_property
    def state_bytes(self) -> int:  # what a policy weighs a delta against, counted once per plan
        return sum(math.prod(t.global_shape) * dtypes.from_name(t.dtype).itemsize for t in self.tensors.values())

    def __eq__(self, other: object) -> bool:
        return _same(self, other)


@dataclass(frozen=True)
class PlanRequest:
    """What a rank sends the coordinator at each save: a few bytes while nothing changed.

    Attributes:
        step: the step it saves.
        digest: its local plan's digest.
        plan: its local plan, only when it changed since the rank last sent one.
        holds: the tag of the global plan whose parts the rank holds (None: none yet).
    """

    step: int
    digest: str
    plan: LocalPlan | None
    holds: str | None


@dataclass(frozen=True, eq=False)
class Assignment:
    """The parts one rank writes under the global plan ``tag``: all that a rank but the
    coordinator learns of the plan. A rank writes at most one part of a tensor: the box it
    holds.

    Attributes:
        tag: the global plan's tag.
        items: each part's tensor's row in the rank's local plan, ascending (int64).
        index: each part's tensor's place in the plan (in the root record).
        part: each part's number in its tensor (its path ``p<number>``; -1: the whole tensor).
    """

    tag: str
    items: np.ndarray
    index: np.ndarray
    part: np.ndarray

    def parts(self, plan: LocalPlan) -> tuple[tuple[tuple[str, PartPlan], ...], tuple[int, ...]]:
        """The parts, with their tensors' keys, and their tensors' places, of the rank whose
        local plan (the one the global plan was made of) is ``plan``."""
        names = plan.names()
        return (tuple((names[i], PartPlan(plan.box(i), plan.rank, "" if n < 0 else f"p{n}"))
                      for i, n in zip(self.items.tolist(), self.part.tolist())),
                tuple(self.index.tolist()))

    def __eq__(self, other: object) -> bool:
        return _same(self, other)


def _columns(plans: Sequence[LocalPlan], rows: int) -> tuple[np.ndarray, ...]:
    """Every plan's columns, one after the other, at the same width."""
    width = max((p.offset.shape[1] for p in plans), default=0)
    out = []
    for name, pad in (("global_shape", 1), ("offset", 0), ("shape", 1)):
        column, at = np.full((rows, width), pad, np.int64), 0
        for p in plans:
            part = getattr(p, name)
            column[at:at + len(part), :part.shape[1]] = part
            at += len(part)
        out.append(column)
    return tuple(out)


def make_global_plan(local_plans: Sequence[LocalPlan]) -> GlobalPlan:
    """Validates the local plans and assigns one writer to every distinct box.

    A box one rank holds is written by it; then replicas, largest first, each by the holder with
    the fewest bytes to write so far.

    Raises:
        StateError: ranks disagree on a tensor's dtype or global shape, or its boxes overlap or
            leave a gap.
    """
    plans = list(local_plans)
    counts = np.array([len(p.dtype) for p in plans], np.int64)
    rank = np.repeat(np.array([p.rank for p in plans], np.int64), counts)
    item = np.arange(len(rank)) - np.repeat(np.cumsum(counts) - counts, counts)  # row in its plan
    # Each distinct list of keys is read once: ranks of one layout hold the same tensors.
    names: dict[str, list[str]] = {}
    for p in plans:
        if p.keys not in names:
            names[p.keys] = p.names()
    keys = sorted(set().union(*names.values()))
    index = dict(zip(keys, range(len(keys))))
    ids = {k: np.fromiter(map(index.__getitem__, v), np.int64, len(v)) for k, v in names.items()}
    tid = np.concatenate([ids[p.keys] for p in plans]) if plans else np.zeros(0, np.int64)
    code = np.concatenate([p.dtype for p in plans]) if plans else np.zeros(0, np.uint8)
    ndim = np.concatenate([p.ndim for p in plans]) if plans else np.zeros(0, np.int64)
    gshape, offset, shape = _columns(plans, len(rank))
    first = np.full(len(keys), len(tid), np.int64)  # each tensor's first row, in rank order
    np.minimum.at(first, tid, np.arange(len(tid)))
    wrong = np.flatnonzero((code != code[first][tid]) | (ndim != ndim[first][tid])
                           | np.any(gshape != gshape[first][tid], axis=1))
    if len(wrong):
        j, at = wrong[0], first[tid[wrong[0]]]
        raise StateError(f"{keys[tid[j]]}: ranks disagree: {DTYPES[code[at]]} {gshape[at, :ndim[at]].tolist()} vs "
                         f"{DTYPES[code[j]]} {gshape[j, :ndim[j]].tolist()} on rank {rank[j]}")
    outside = np.flatnonzero(np.any((offset < 0) | (shape < 0) | (offset + shape > gshape), axis=1))
    if len(outside):
        j = outside[np.argmin(tid[outside])]
        raise StateError(f"{keys[tid[j]]}: box at {offset[j, :ndim[j]].tolist()} of {shape[j, :ndim[j]].tolist()} "
                         f"is outside {gshape[j, :ndim[j]].tolist()}")
    # Rows by tensor, box (offset, then shape) and rank: a distinct box's holders are a run.
    width = offset.shape[1]
    by = np.lexsort((rank, *shape.T[::-1], *offset.T[::-1], tid))
    rank, item, tid, offset, shape = rank[by], item[by], tid[by], offset[by], shape[by]
    new = np.ones(len(by), bool)
    new[1:] = (tid[1:] != tid[:-1]) | np.any(offset[1:] != offset[:-1], axis=1) | np.any(shape[1:] != shape[:-1],
                                                                                         axis=1)
    start = np.flatnonzero(new)  # each distinct box's first row
    held = np.diff(np.append(start, len(by)))
    box_tid, box_offset, box_shape = tid[start], offset[start], shape[start]
    nbytes = np.prod(box_shape, axis=1) * _ITEMSIZE[code[first]][box_tid]
    tensor_shape = gshape[first]
    empty = np.prod(tensor_shape, axis=1) == 0
    # A rank holding none of a tensor (a 0-row shard) writes nothing, unless the tensor is empty.
    kept = (nbytes > 0) | empty[box_tid]
    count = np.bincount(box_tid[kept], minlength=len(keys))
    # A box one rank holds is written by it; then replicas, largest first, by the least loaded.
    load = np.zeros(int(rank.max(initial=-1)) + 1, np.int64)
    single = kept & (held == 1)
    np.add.at(load, rank[start[single]], nbytes[single])
    chosen = start.copy()
    shared = np.flatnonzero(kept & (held > 1))
    for b in shared[np.lexsort((*box_offset[shared].T[::-1], box_tid[shared], -nbytes[shared]))]:
        s = start[b]
        w = s + int(np.argmin(load[rank[s:s + held[b]]]))  # ranks ascending: ties go to the lowest
        load[rank[w]] += nbytes[b]
        chosen[b] = w
    rows = chosen[kept]
    part_tid = box_tid[kept]
    part_first = np.cumsum(count) - count
    grid_of = count > 1
    offset, shape = offset[rows], shape[rows]
    grids = grids_of(tensor_shape[grid_of], ndim[first][grid_of], part_first[grid_of], count[grid_of],
                     offset, offset + shape) if grid_of.any() else []
    axes: list[Any] = [None] * len(keys)
    for at, g in zip(np.flatnonzero(grid_of).tolist(), grids):
        axes[at] = g
    # A tensor that is one whole box, or whose boxes are a grid's cells, is tiled exactly (its
    # empty boxes lie inside it, as checked above); the others are checked box by box.
    whole = (count == 1) & (np.bincount(box_tid, minlength=len(keys)) == 1)
    if len(rows):
        whole &= np.all(shape[np.minimum(part_first, len(rows) - 1)] == tensor_shape, axis=1)
    part_writer = rank[rows]
    writer_list = part_writer.tolist()
    # As lists: a state of thousands of tiny tensors pays for each numpy scalar in this loop.
    dims, sizes, kinds = ndim[first].tolist(), tensor_shape.tolist(), [DTYPES[c] for c in code[first].tolist()]
    tensors: dict[str, TensorPlan] = {}
    for t, (key, n, c, f, tiled) in enumerate(zip(keys, dims, count.tolist(), part_first.tolist(), whole.tolist())):
        gs = tuple(sizes[t][:n])
        if axes[t] is None and not tiled:
            check_tiling(key, gs, [Box(tuple(box_offset[b, :n].tolist()), tuple(box_shape[b, :n].tolist()))
                                   for b in np.flatnonzero(box_tid == t)])
        layout = layout_of(axes[t], part_writer[f:f + c]) if c > 1 else None
        ranks = layout.ranks() if layout is not None else sorted(set(writer_list[f:f + c]))
        tensors[key] = TensorPlan(key, kinds[t], gs, f, c, ranks, layout)
    merged = statetree.merge([pickle.loads(tree) for tree in dict.fromkeys(p.tree for p in plans)])
    return GlobalPlan(tensors, merged, offset, shape, part_writer, item[rows])


def _assignments(tag: str, plan: GlobalPlan, world_size: int) -> list[Assignment]:
    """Each rank's parts under ``plan``, by rank."""
    counts = np.array([t.count for t in plan.tensors.values()], np.int64)
    index = np.repeat(np.arange(len(counts)), counts)
    number = np.arange(len(index)) - np.repeat(np.cumsum(counts) - counts, counts)
    number[counts[index] == 1] = -1
    by = np.argsort(plan.writer, kind="stable")
    edges = np.searchsorted(plan.writer[by], np.arange(world_size + 1))
    return [Assignment(tag, plan.item[at], index[at], number[at])
            for at in (by[a:b] for a, b in zip(edges[:-1], edges[1:]))]


class GlobalPlanner:
    """The coordinator's global plan of successive saves: ranks send their local plan only when
    it changed, the plan is made again only then, and a rank receives its parts only when it does
    not hold them yet.

    Args:
        world_size: how many ranks save.
    """

    def __init__(self, world_size: int):
        self._world_size = world_size
        self._local_plans: dict[int, LocalPlan] = {}  # the ranks' last local plans
        self._plan: tuple[tuple[str, ...], str, GlobalPlan] | None = None  # digests, tag, plan
        self._assigned: list[Assignment] = []

    @property
    def plan(self) -> GlobalPlan:
        """The plan in force (after :meth:`assign`)."""
        if self._plan is None:
            raise StateError("no global plan yet")
        return self._plan[2]

    @paused()
    def assign(self, sent: list[PlanRequest], admit: Callable[[int], None]) -> list[Assignment | None]:
        """The plan in force for what every rank sent, made again only when some rank's local
        plan changed; for each rank, its parts, or None when it holds them already. ``admit(step)``
        checks the step first.

        Raises:
            StepExistsError: the ranks save different steps.
            StateError: the ranks use different chunk sizes, or their parts do not tile.
        """
        for rank, request in enumerate(sent):
            if request.plan is not None:
                self._local_plans[rank] = request.plan
        steps = {r.step for r in sent}
        if len(steps) != 1:
            raise StepExistsError(f"ranks save different steps: {sorted(steps)}")
        admit(steps.pop())
        digests = tuple(r.digest for r in sent)
        if self._plan is None or self._plan[0] != digests:
            missing = [r for r in range(self._world_size) if r not in self._local_plans]
            if missing:
                raise StateError(f"no local plan from ranks {missing}")
            plans = [self._local_plans[r] for r in range(self._world_size)]
            if len({p.settings for p in plans}) != 1:
                raise StateError(f"ranks use different chunk sizes: {sorted({p.settings for p in plans})}")
            plan = make_global_plan(plans)
            tag = hashlib.sha256("/".join(digests).encode()).hexdigest()[:16]
            self._plan, self._assigned = (digests, tag, plan), _assignments(tag, plan, self._world_size)
        return [None if r.holds == self._plan[1] else self._assigned[rank] for rank, r in enumerate(sent)]
