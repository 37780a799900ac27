"""The delta stream: what changed at each committed step, for consumers such as serving replicas.

A consumer holding the state of step P follows the store with ``deltas(since=P)``: per committed
step after P, in order, it gets each tensor's changed rows (row ids and their values; a 0-d or
1-d tensor's changed dense chunks as element ids and values) and the step's plain values, and
:meth:`StepDelta.apply` makes its tensors those of the step. A step whose delta does not apply
to the step before it comes whole (``kind == "full"``): a base, and a delta against an older
step (a differential policy's, or one of another lineage). When the steps after the consumer's
were garbage-collected, the stream raises :class:`StreamGapError`: the consumer must start again
from a base (``load(step)``) and follow from there.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from . import statetree
from .errors import ManifestError, MissingChunkError, StepNotFoundError, StreamGapError
from .format import dtypes
from .format.layout import as_step
from .format.manifest import Manifest, PartRecord, TensorRecord
from .io.reader import ChainReader
from .io.staging import StagingPool
from .store import Store


@dataclass(frozen=True)
class TensorDelta:
    """What changed in one part of one tensor.

    Attributes:
        key: the tensor's flat key.
        ids: the changed rows (dimension 0; elements of a 0-d or 1-d tensor), sorted; None when
            ``values`` is the whole tensor.
        values: the values of those rows, or the whole tensor.
        columns: where ``values`` starts along dimensions 1 and up (nonzero for a tensor saved
            split by columns).
    """

    key: str
    ids: torch.Tensor | None
    values: torch.Tensor
    columns: tuple[int, ...] = ()

    def apply(self, tensors: dict[str, torch.Tensor]) -> None:
        """Writes the change into ``tensors[key]`` (in place), or sets the whole value."""
        if self.ids is None:
            tensors[self.key] = self.values.clone()
            return
        target, values = tensors[self.key], self.values
        if target.dim() <= 1:
            target = target.view(-1)
        if target.dtype == values.dtype:  # torch writes no rows by index into some dtypes
            target, values = dtypes.as_bits(target), dtypes.as_bits(values)
        index: tuple[torch.Tensor | slice, ...] = (
            self.ids, *[slice(o, o + n) for o, n in zip(self.columns, self.values.shape[1:])])
        target[index] = values


@dataclass(frozen=True)
class StepDelta:
    """One committed step of the stream.

    Attributes:
        step: the step.
        kind: ``"delta"`` (apply to the previous step's state) or ``"full"`` (every tensor whole).
        parent: the step the changes apply to (None for ``"full"``).
        tree: the step's skeleton: its plain values and the nesting (see
            :mod:`deltackpt.statetree`).
        changes: the changed parts of the tensors (each tensor whole for ``"full"``).
    """

    step: int
    kind: str
    parent: int | None
    tree: dict[str, Any]
    changes: tuple[TensorDelta, ...]

    def apply(self, tensors: dict[str, torch.Tensor]) -> None:
        """Makes ``tensors`` (flat, by key) those of this step, in place."""
        if self.kind == "full":
            tensors.clear()
        for change in self.changes:
            change.apply(tensors)

    def state(self, tensors: dict[str, torch.Tensor]) -> Any:
        """The nested state of this step from ``tensors`` once :meth:`apply` ran."""
        return statetree.build(self.tree, tensors)


class _StepReader(ChainReader):
    """Reads the changes that one delta record holds, part by part."""

    def changes(self, m: Manifest) -> tuple[TensorDelta, ...]:
        out = []
        for key, rec in m.tensors.items():
            for part in rec.parts:
                if part.changed:
                    out.append(self._part(m, key, rec, part))
        return tuple(out)

    def _part(self, m: Manifest, key: str, rec: TensorRecord, part: PartRecord) -> TensorDelta:
        ids, values = rec.encoding.changes(self, m, key, rec, part)
        return TensorDelta(key, ids, values, tuple(part.offset[1:]))


def deltas(store: Store, pool: StagingPool, executor: Executor, since: int | None) -> Iterator[StepDelta]:
    """The stream of every committed step after ``since`` (None: from the first step), in order;
    steps committed while it runs are included.

    Example:
        >>> import tempfile, torch
        >>> from deltackpt import Checkpointer
        >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     t = torch.zeros(10, 2)
        ...     _ = ckpt.save(1, {"t": t}); t[3] = 1; _ = ckpt.save(2, {"t": t})
        ...     [(d.step, d.kind, d.changes[0].ids.tolist()) for d in ckpt.deltas(since=1)]
        [(2, 'delta', [3])]

    Raises:
        StreamGapError: the steps after the consumer's were garbage-collected.
        BrokenChainError, IntegrityError: the store is damaged.
        SettingError: ``since`` is no step (see :func:`~deltackpt.format.layout.as_step`).
    """
    prev = None if since is None else as_step(since)
    prev_attempt = _attempt(store, prev)
    while True:
        later = [s for s in store.steps() if prev is None or s > prev]
        if not later:
            return
        step = later[0]
        try:
            m = store.manifest(step)
        except StepNotFoundError:
            continue  # collected meanwhile: list again
        if m.kind == "delta" and prev is not None and m.parent is not None and m.parent > prev:
            raise StreamGapError(
                f"cannot follow from step {prev}: step {step} applies to step {m.parent}, which was "
                f"garbage-collected; start again from a base: load({step}), then deltas(since={step})")
        try:
            if (m.kind == "delta" and prev is not None and m.parent == prev
                    and _builds_on(store, prev, prev_attempt, m.parent_attempt)):
                changes = _StepReader(store.storage, [m], pool, executor).changes(m)
                yield StepDelta(step, "delta", prev, m.tree, changes)
            else:
                yield StepDelta(step, "full", None, m.tree, _whole(store, step, pool, executor))
        except MissingChunkError:
            if step in store.steps():
                raise
            raise StreamGapError(f"step {step} was garbage-collected while it was read; start again "
                                 f"from a base: load(), then deltas(since=that step)") from None
        prev, prev_attempt = step, m.attempt


def _whole(store: Store, step: int, pool: StagingPool, executor: Executor) -> tuple[TensorDelta, ...]:
    chain = store.chain(step)
    reader = ChainReader(store.storage, chain, pool, executor, chain[-1].tensors.keys())
    out = []
    for key, rec in chain[-1].tensors.items():
        t = torch.empty(rec.shape, dtype=dtypes.from_name(rec.dtype))
        reader.read(key, t)
        out.append(TensorDelta(key, None, t))
    return tuple(out)


def _builds_on(store: Store, step: int, attempt: str | None, parent_attempt: str | None) -> bool:
    """Whether a delta whose parent is ``parent_attempt`` applies to the record of ``step`` saved
    as ``attempt`` (None: any): that record, or the base compaction made of it (a writer that
    restored ``step`` replayed that base, and names it as the parent)."""
    if attempt is None or parent_attempt == attempt:
        return True
    try:
        base = store.compacted(step)
    except ManifestError:
        return False  # the step comes whole, and reading its chain names the damage
    return base is not None and base.compacts == attempt and base.attempt == parent_attempt


def _attempt(store: Store, step: int | None) -> str | None:
    if step is None:
        return None
    try:
        return store.manifest(step).attempt
    except StepNotFoundError:
        return None
