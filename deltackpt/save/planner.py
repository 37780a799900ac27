"""Save planning: every rank's local plan, and the coordinator's global plan.

A local plan lists, per tensor key, the box a rank holds (ranges, never row lists). The global
plan gives every distinct box of every tensor exactly one writer: a box one rank holds is written
by it; replicas (the same box on several ranks) are written once, by the holder with the fewest
bytes to write so far, largest boxes first, which spreads the writes evenly. Validation checks that every tensor's boxes agree
on dtype and global shape and tile it exactly; it sorts, so it is O(n log n) in the boxes.

The plan is deterministic in its input, so a cached plan stays valid while no rank's local plan
changes. Only the coordinator holds it: the ranks send it their local plans (each only when it
changed) and receive only the parts they write (each only when the plan changed), so no rank but
the coordinator receives anything that grows with the world.
"""

from __future__ import annotations

import functools
import hashlib
import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import statetree
from ..collector import paused
from ..errors import StateError, StepExistsError
from ..format.part_layout import Axis, PartLayout, grid_of, runs_of
from ..sharding import Box, check_tiling


@dataclass(frozen=True)
class ItemInfo:
    """One tensor as one rank holds it."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    itemsize: int


@dataclass(frozen=True)
class LocalPlan:
    """What one rank holds: its tensors' boxes and its state's skeleton."""

    rank: int
    items: tuple[ItemInfo, ...]
    tree: dict
    settings: tuple[int, ...]  # chunk sizes; every rank must use the same

    def digest(self) -> str:
        return hashlib.sha256(pickle.dumps((self.items, self.tree, self.settings))).hexdigest()


@dataclass(frozen=True)
class PartPlan:
    """One box of a tensor and the rank that writes it. ``path`` names its folder ("" when the
    part is the whole tensor)."""

    box: Box
    writer: int
    path: str


@dataclass(frozen=True)
class TensorPlan:
    """A tensor's parts, sorted by offset, and their layout if they follow one (see
    :mod:`deltackpt.format.part_layout`)."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    parts: tuple[PartPlan, ...]
    layout: PartLayout | None = None


@dataclass(frozen=True)
class GlobalPlan:
    """Every tensor's parts with their writers, and the merged skeleton."""

    tensors: dict[str, TensorPlan]
    tree: dict

    def parts(self) -> Iterator[tuple[str, PartPlan]]:
        """Every part, with its tensor's key."""
        return ((t.key, p) for t in self.tensors.values() for p in t.parts)

    def by_writer(self, world_size: int) -> list[tuple[tuple[tuple[str, PartPlan], ...], tuple[int, ...]]]:
        """The parts each rank writes, with their tensors' keys, and each part's tensor's place
        in :attr:`tensors` (its index in the root record), by rank (one pass)."""
        out: list[tuple[list[tuple[str, PartPlan]], list[int]]] = [([], []) for _ in range(world_size)]
        for i, t in enumerate(self.tensors.values()):
            for p in t.parts:
                parts, index = out[p.writer]
                parts.append((t.key, p))
                index.append(i)
        return [(tuple(parts), tuple(index)) for parts, index in out]

    @functools.cached_property
    def writers(self) -> dict[str, tuple[int, list[int], PartLayout | None]]:
        """Each tensor's part count, the sorted ranks that write its parts and their layout, if
        they follow one (what the root record lists of its parts), made once per plan."""
        return {t.key: (len(t.parts), t.layout.ranks() if t.layout is not None else sorted({p.writer for p in t.parts}),
                        t.layout) for t in self.tensors.values()}


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


@dataclass(frozen=True)
class Assignment:
    """The parts one rank writes under the global plan ``tag``: all that a rank but the
    coordinator learns of the plan."""

    tag: str
    parts: tuple[tuple[str, PartPlan], ...]
    index: tuple[int, ...]  # each part's tensor's place in the plan (in the root record)


def make_global_plan(local_plans: list[LocalPlan], tree: dict) -> GlobalPlan:
    """Validates the local plans and assigns one writer to every distinct box.

    A box one rank holds is written by it; then replicas, largest first, each by the holder with
    the fewest bytes to write so far.

    Raises:
        StateError: ranks disagree on a tensor's dtype or global shape, or its boxes overlap or
            leave a gap.
    """
    # Per tensor, per distinct box (as its offset and shape): [box, holder, holder, ...].
    holders: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], list[Any]]] = {}
    meta: dict[str, ItemInfo] = {}
    for plan in local_plans:
        rank = plan.rank
        for item in plan.items:
            first = meta.get(item.key)
            boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], list[Any]]
            if first is None:
                meta[item.key], boxes = item, {}
                holders[item.key] = boxes
            elif first.dtype != item.dtype or first.global_shape != item.global_shape:
                raise StateError(
                    f"{item.key}: ranks disagree: {first.dtype} {list(first.global_shape)} vs "
                    f"{item.dtype} {list(item.global_shape)} on rank {rank}"
                )
            else:
                boxes = holders[item.key]
            box = item.box
            held = boxes.get(at := (box.offset, box.shape))
            if held is None:
                boxes[at] = [box, rank]
            else:
                held.append(rank)
    load = {plan.rank: 0 for plan in local_plans}
    kept: dict[str, list[list[Any]]] = {}  # per tensor: [box, writer, holders], by offset
    grids: dict[str, tuple[Axis, ...] | None] = {}
    shared: list[tuple[int, str, tuple[int, ...], list[Any]]] = []
    for key in sorted(holders):
        info = meta[key]
        empty = not math.prod(info.global_shape)
        slots, nothing = [], []
        for box, *ranks in holders[key].values():
            n = math.prod(box.shape) * info.itemsize
            if not n and not empty:
                nothing.append(box)  # a rank holding none of a tensor (a 0-row shard) writes nothing
                continue
            slot = [box, ranks[0], ranks]
            if len(ranks) == 1:
                load[ranks[0]] += n
            else:
                shared.append((n, key, box.offset, slot))
            slots.append(slot)
        slots.sort(key=lambda s: s[0].offset)
        # Boxes that are the cells of a grid tile the tensor, as the whole tensor would: only the
        # empty ones are left to check (that they lie inside it). A tensor of one part needs no
        # layout: its one writer's table is all a reader reads of it.
        grids[key] = grid_of(info.global_shape, [s[0] for s in slots]) if len(slots) > 1 else None
        check_tiling(key, info.global_shape,
                     [Box((0,) * len(info.global_shape), info.global_shape), *nothing] if grids[key] is not None
                     else [held[0] for held in holders[key].values()])
        kept[key] = slots
    shared.sort(key=lambda j: (-j[0], j[1], j[2]))
    for nbytes, _, _, slot in shared:
        w = min(slot[2], key=lambda r: (load[r], r))
        load[w] += nbytes
        slot[1] = w
    tensors = {}
    for key, slots in kept.items():
        whole = len(slots) == 1
        parts = tuple(PartPlan(b, w, "" if whole else f"p{i}") for i, (b, w, _) in enumerate(slots))
        grid, runs = grids[key], runs_of([w for _, w, _ in slots])
        tensors[key] = TensorPlan(key, meta[key].dtype, meta[key].global_shape, parts,
                                  None if grid is None or runs is None else PartLayout(grid, runs))
    return GlobalPlan(tensors, tree)


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
        self._by_writer: list[tuple[tuple[tuple[str, PartPlan], ...], tuple[int, ...]]] = []

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
            plan = make_global_plan(plans, statetree.merge([p.tree for p in plans]))
            tag = hashlib.sha256("/".join(digests).encode()).hexdigest()[:16]
            self._plan, self._by_writer = (digests, tag, plan), plan.by_writer(self._world_size)
        tag = self._plan[1]
        return [None if r.holds == tag else Assignment(tag, *self._by_writer[rank])
                for rank, r in enumerate(sent)]
