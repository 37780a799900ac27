"""The first phase of a save, on every rank: flatten the state and describe what the rank holds."""

from __future__ import annotations

import operator
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

from .. import statetree
from ..errors import StepExistsError
from ..format import dtypes
from ..format.limits import MAX_STEP
from ..sharding import Shard
from .planner import LocalPlan, PartPlan
from .types import LocalState, WriteItem


def plan_local(step: int, state: Mapping[str, Any], rank: int, sizes: tuple[int, int],
               last: LocalState | None = None) -> LocalState:
    """Flattens ``state`` and lists its tensors' boxes; keeps ``last``'s plan (this rank's
    previous one) when the state's layout and skeleton are the same as then, so a save of an
    unchanged layout does no per-tensor planning.

    Raises:
        StepExistsError: ``step`` is not in ``[0, MAX_STEP]`` (records name steps by 20 digits,
            and readers hold them as int64).
        StateError: ``state`` holds something that cannot be saved.
    """
    if not 0 <= step <= MAX_STEP:
        raise StepExistsError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    flat = statetree.flatten(state, reuse=None if last is None else last.flat)
    # A tensor whose bytes are not its values in order is copied now (its conjugate or negative
    # bit applied), so its copy is never taken from ``last``.
    shards = dict(flat.tensors)
    for k in flat.strided:
        s = shards[k]
        local = s.local.resolve_conj().resolve_neg().contiguous()
        shards[k] = Shard(local, global_shape=s.global_shape, global_offset=s.global_offset)
    # Every tensor the same as last time, and a skeleton of the same bytes (pickle tells 1 from
    # 1.0 and 0.0 from -0.0, which == does not; flatten keeps a node that flattens the same):
    # the same plan.
    same = (last is not None and last.plan.rank == rank and last.plan.settings == sizes
            and flat.reused == len(flat.tensors) == len(last.flat.tensors))
    if same and flat.tree is last.flat.tree:  # type: ignore[union-attr]  # same: last is set
        return LocalState(step, shards, last.plan, last.digest, flat)  # type: ignore[union-attr]
    tree = pickle.dumps(flat.tree)
    if same and tree == last.plan.tree:  # type: ignore[union-attr]
        return LocalState(step, shards, last.plan, last.digest, flat)  # type: ignore[union-attr]
    plan = LocalPlan.of(rank, [(k, dtypes.name(s.local.dtype), s.global_shape, s.global_offset, tuple(s.local.shape))
                               for k, s in sorted(shards.items())], tree, sizes)
    return LocalState(step, shards, plan, plan.digest(), flat)


def write_items(parts: Sequence[tuple[str, PartPlan]], local: LocalState,
                last: tuple[Sequence[tuple[str, PartPlan]], tuple[WriteItem, ...]] | None = None
                ) -> tuple[WriteItem, ...]:
    """The ``parts`` a rank writes (see :meth:`~deltackpt.save.planner.Assignment.parts`), with
    its tensors that hold them; ``last``'s items (the rank's last parts and items) again if they
    are of the same parts and shards (a save of an unchanged layout makes no item)."""
    shards = local.shards
    if last is not None and last[0] is parts and all(map(operator.is_, map(_TENSOR, last[1]), map(
            _LOCAL, map(shards.__getitem__, map(_KEY, parts))))):
        return last[1]
    return tuple(WriteItem(key, part, shards[key].local) for key, part in parts)


_TENSOR, _LOCAL, _KEY = operator.attrgetter("tensor"), operator.attrgetter("local"), operator.itemgetter(0)
