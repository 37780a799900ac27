"""Sharded tensors: a rank's box of a global tensor.

A :class:`Shard` is a local tensor plus where it sits in the global tensor. DTensors with
``Shard``/``Replicate`` placements become Shards; a plain tensor is a Shard covering the whole
tensor (on several ranks, plain tensors are replicas and are written once).
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch

from .errors import SettingError, StateError


@dataclass(frozen=True)
class Box:
    """An axis-aligned block of a global tensor: ``offset`` and ``shape`` per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The common block, or None if empty (a 0-d box meets a 0-d box)."""
        if self == other:  # a part read whole, as every part of a state of small tensors is
            return None if 0 in self.shape else self
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape)
        )
        if any(h <= lo_ for lo_, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi)))

    def slices(self, within: Box) -> tuple[slice, ...]:
        """Index of this box inside the local tensor of ``within``."""
        return tuple(slice(o - w, o - w + n) for o, n, w in zip(self.offset, self.shape, within.offset))


class Shard:
    """One rank's part of a global tensor.

    Args:
        local: the rank's tensor.
        global_shape: shape of the whole tensor.
        global_offset: where ``local`` starts in it, per dimension.

    Raises:
        StateError: the local tensor does not fit in the global shape at that offset.

    Example:
        >>> s = Shard(torch.zeros(5, 4), global_shape=(10, 4), global_offset=(5, 0))
        >>> s.box
        Box(offset=(5, 0), shape=(5, 4))
    """

    def __init__(self, local: torch.Tensor, *, global_shape: tuple[int, ...] | torch.Size,
                 global_offset: tuple[int, ...]):
        global_shape = tuple(int(d) for d in global_shape)
        global_offset = tuple(int(d) for d in global_offset)
        if not isinstance(local, torch.Tensor):
            raise StateError(f"Shard.local must be a tensor, got {type(local).__name__}")
        if not len(global_shape) == len(global_offset) == local.dim():
            raise StateError(
                f"Shard of a {local.dim()}-d tensor needs {local.dim()} dimensions, got "
                f"global_shape {global_shape} and global_offset {global_offset}"
            )
        if any(o < 0 or o + n > g for o, n, g in zip(global_offset, local.shape, global_shape)):
            raise StateError(
                f"Shard of shape {tuple(local.shape)} at offset {global_offset} does not fit in "
                f"global shape {global_shape}"
            )
        self.local = local
        self.global_shape = global_shape
        self.global_offset = global_offset

    @classmethod
    def whole(cls, local: torch.Tensor) -> Shard:
        """The shard that is all of its tensor: nothing to check (a state of 20,000 tiny tensors
        made two checked shards of each)."""
        s = cls.__new__(cls)
        s.local = local
        s.global_shape = tuple(local.shape)
        s.global_offset = (0,) * local.dim()
        return s

    @property
    def box(self) -> Box:
        return Box(self.global_offset, tuple(self.local.shape))

    def __repr__(self) -> str:
        return (f"Shard(local={tuple(self.local.shape)} {self.local.dtype}, "
                f"global_shape={self.global_shape}, global_offset={self.global_offset})")


def is_dtensor(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def from_dtensor(dt: Any, path: str) -> Shard:
    """The Shard of this rank's part of a DTensor (``Shard`` and ``Replicate`` placements)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in dt.placements:
        if not isinstance(p, (DShard, Replicate)):
            raise StateError(f"{path}: DTensor placement {p} is not supported (use Shard or Replicate)")
    local = dt.to_local()
    _, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return Shard(local, global_shape=tuple(dt.shape), global_offset=tuple(offset))


def is_sharded_tensor(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "ShardedTensor" and cls.__module__.startswith("torch.distributed")


def from_sharded_tensor(st: Any, path: str) -> Shard:
    """The Shard of a ShardedTensor that holds one local shard on this rank."""
    local = st.local_shards()
    if len(local) != 1:
        raise StateError(f"{path}: a ShardedTensor with {len(local)} local shards on this rank; "
                         "pass one Shard per rank (TorchRec's DMP and fused optimizer are handled whole)")
    return Shard(local[0].tensor, global_shape=tuple(st.size()),
                 global_offset=tuple(int(o) for o in local[0].metadata.shard_offsets))


def as_shard(obj: Any, path: str) -> Shard:
    """A tensor, Shard, DTensor or ShardedTensor as a Shard."""
    if isinstance(obj, Shard):
        return obj
    if is_dtensor(obj):
        return from_dtensor(obj, path)
    if is_sharded_tensor(obj):
        return from_sharded_tensor(obj, path)
    return Shard(obj, global_shape=tuple(obj.shape), global_offset=(0,) * obj.dim())


def row_block(shape: tuple[int, ...], rank: int, world_size: int) -> Box:
    """Rank ``rank``'s rows of a row-wise sharding over ``world_size`` ranks (``torch.chunk``'s
    blocks of ``ceil(rows / world_size)``; the last ranks may get fewer rows, or none)."""
    try:
        rank, world_size = operator.index(rank), operator.index(world_size)
    except TypeError:
        raise SettingError(f"rank and world_size must be ints, got {rank!r} and {world_size!r}") from None
    if world_size < 1:
        raise SettingError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise SettingError(f"rank must be in [0, {world_size}), got {rank}")
    block = -(-shape[0] // world_size)
    lo = min(shape[0], rank * block)
    hi = min(shape[0], lo + block)
    return Box((lo, *(0,) * (len(shape) - 1)), (hi - lo, *shape[1:]))


def check_tiling(key: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """Raises StateError unless ``boxes`` cover ``shape`` exactly, without overlap.

    Sweeps along dimension 0 with the boxes sorted by offset, comparing each box only with the
    ones whose rows it shares, so row-, column- and table-wise layouts check in O(n log n).
    """
    if len(boxes) == 1 and boxes[0].shape == tuple(shape) and not any(boxes[0].offset):
        return  # one box that is the whole tensor (every tensor of one process)
    for b in boxes:
        if len(b.offset) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(b.offset, b.shape, shape)
        ):
            raise StateError(f"{key}: box at {list(b.offset)} of {list(b.shape)} is outside {list(shape)}")
    nonempty = sorted((b for b in boxes if b.numel), key=lambda b: b.offset)
    if sum(b.numel for b in nonempty) != math.prod(shape):
        raise StateError(f"{key}: the ranks' parts cover {sum(b.numel for b in nonempty)} of "
                         f"{math.prod(shape)} elements")
    active: list[tuple[int, int, Box]] = []
    for i, b in enumerate(nonempty):
        if not b.offset:
            continue
        while active and active[0][0] <= b.offset[0]:
            heapq.heappop(active)
        for _, _, other in active:
            if b.intersect(other) is not None:
                raise StateError(f"{key}: parts at {list(other.offset)} and {list(b.offset)} overlap")
        heapq.heappush(active, (b.offset[0] + b.shape[0], i, b))
