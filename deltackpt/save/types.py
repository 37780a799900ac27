"""The frozen values a save passes from phase to phase.

``plan_local`` makes a :class:`LocalState`; the global plan gives each rank its
:class:`WriteItem` s; ``scan`` finds what changed in them; ``decide`` makes the :class:`SavePlan`;
``stage`` and ``write`` turn it into a :class:`WriteResult` per rank, which writes its part table
and sends the coordinator what the root record needs (:class:`Written`); ``commit`` makes the root.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..format.manifest import ChunkMap
from ..quantization import Choice
from ..sharding import Shard
from ..statetree import FlatState
from .planner import LocalPlan, PartPlan


class Kind(enum.StrEnum):
    """What a step stores: every tensor whole, or what changed since its parent."""

    BASE = "base"
    DELTA = "delta"

    def __repr__(self) -> str:
        return repr(self.value)  # shows as the string it equals, in reports and examples


@dataclass(frozen=True)
class LocalState:
    """One rank's flattened state for one save.

    Attributes:
        step: the step being saved.
        shards: every tensor by flat key, contiguous.
        plan: what the rank holds, for the coordinator.
        digest: the plan's digest (the coordinator caches the global plan while none changes).
        flat: the flattened state, which the next save's flatten may reuse.
    """

    step: int
    shards: Mapping[str, Shard]
    plan: LocalPlan
    digest: str
    flat: FlatState


@dataclass(frozen=True)
class WriteItem:
    """A part this rank writes, with the live tensor that holds it (read only by ``scan`` and
    ``stage``)."""

    key: str
    part: PartPlan
    tensor: torch.Tensor


@dataclass(frozen=True)
class SavePlan:
    """What the save writes, decided by the coordinator and the same on every rank. It is all
    that the coordinator's decision sends: each rank knows its own parts and what they hold (a
    base's every row, a delta's changed rows or chunks, as its scan found, see
    :func:`~deltackpt.save.decide.counts`); the whole plan stays on the coordinator.

    Attributes:
        step: the step.
        kind: base or delta.
        reason: why the policy chose ``kind``.
        attempt: the folder the step's files go into (``steps/ATTEMPT``).
        quantize: for a delta, the quantization rule of each tensor a ``quantize=`` pattern
            names, and why.
    """

    step: int
    kind: Kind
    reason: str
    attempt: str
    quantize: Mapping[str, Choice] = field(default_factory=dict)


@dataclass(frozen=True)
class WriteResult:
    """What one rank wrote: the chunks of each part it wrote, its pack's files, and the largest
    error bound of the quantized rows it wrote per tensor."""

    files: Mapping[tuple[str, str], ChunkMap]
    packs: Mapping[str, ChunkMap]
    bounds: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Written:
    """What a rank sends the coordinator once its files and its part table are durable: all
    that the root record needs of it (the parts it wrote stay in its table).

    Attributes:
        table: its part table's size and xxh3-64 hex digest (None: it writes no part).
        packs: its pack's files, as in :attr:`WriteResult.packs`.
        bytes_written: bytes of its files (a packed chunk's are its pack's).
        rows_changed: rows it wrote of row-sparse tensors.
        bounds: the largest error bound of the quantized rows it wrote, per tensor.
        hashes: its row hash file's size and xxh3-64 hex digest (None: it writes none, see
            :func:`~deltackpt.save.stage.row_hash_file`).
    """

    table: tuple[int, str] | None
    packs: Mapping[str, ChunkMap]
    bytes_written: int
    rows_changed: int
    bounds: Mapping[str, float] = field(default_factory=dict)
    hashes: tuple[int, str] | None = None


@dataclass(frozen=True)
class Committed:
    """What every rank learns of the commit record the coordinator wrote (the record itself
    stays on the coordinator).

    Attributes:
        bytes_written: bytes of every file of the step.
        state_bytes: bytes of every tensor of the state.
        rows_changed: rows the step holds of row-sparse tensors.
    """

    bytes_written: int
    state_bytes: int
    rows_changed: int


@dataclass(frozen=True)
class SaveInfo:
    """What one save did (over all ranks).

    Attributes:
        step: the step saved.
        kind: ``"base"`` or ``"delta"``.
        bytes_written: bytes of every file written.
        state_bytes: bytes of every tensor of the state (what a full checkpoint writes).
        rows_changed: rows written for row-sparse tensors (all rows, for a base).
        seconds: wall time of the save on this rank, from the call to the commit.
        reason: why the policy chose this kind.
        blocked_seconds: how long the call blocked the caller (``seconds`` for a blocking save).
    """

    step: int
    kind: Kind
    bytes_written: int
    state_bytes: int
    rows_changed: int
    seconds: float
    reason: str
    blocked_seconds: float = 0.0
