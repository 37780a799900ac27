"""The scan phase of a save, on every rank: what changed in the parts the rank writes."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ..kernels import rowwise
from ..quantization import QuantizePlan, Rowwise
from ..tracking.changes import ChangeTracker, TensorChange, is_row_sparse
from .types import WriteItem


class PartScan(NamedTuple):
    """What changed in one part, as the rank that writes it found (a tuple: a scan makes one
    a part, thousands for a state of small tensors, and a tuple is made in a third of the time
    of a frozen dataclass).

    Attributes:
        key: the tensor.
        path: the part.
        complete: False when there is nothing to compare with: the part must be written whole.
        changed: rows (row-sparse tensors) or chunks (dense ones) changed.
        delta_bytes: what a delta of them writes, about.
        aligned: a 1-d tensor whose changes are its elements, as rows (see
            :meth:`~deltackpt.tracking.changes.ChangeTracker.aligned`).
    """

    key: str
    path: str
    complete: bool
    changed: int
    delta_bytes: int
    aligned: bool = False


@dataclass(frozen=True)
class ScanSummary:
    """What the coordinator needs of one rank's scans (see :func:`~deltackpt.save.decide.decide`):
    a few bytes however many parts the rank writes.

    Attributes:
        complete: every part had something to compare with (else a base is due).
        delta_bytes: what a delta of the parts writes, about.
        aligned: the tensors whose parts the rank scanned as aligned (see :class:`PartScan`).
    """

    complete: bool
    delta_bytes: int
    aligned: frozenset[str]

    @classmethod
    def of(cls, scans: Sequence[PartScan]) -> ScanSummary:
        return cls(all(map(_COMPLETE, scans)), sum(map(_DELTA_BYTES, scans)),
                   frozenset(s.key for s in itertools.compress(scans, map(_ALIGNED, scans))))


_COMPLETE, _DELTA_BYTES, _ALIGNED = (operator.attrgetter(a) for a in ("complete", "delta_bytes", "aligned"))
_KEY = operator.attrgetter("key")


def summarize(key: str, path: str, t: torch.Tensor, change: TensorChange,
              chunk_elems: Callable[[torch.Tensor], int], rule: Rowwise | None = None) -> PartScan:
    """The scan of one part; ``chunk_elems`` gives a dense tensor's elements per chunk (asked
    only of a changed one: most parts of a delta of many tensors are unchanged)."""
    if change.changed is None:
        return PartScan(key, path, False, 0, 0, change.aligned)
    n = change.changed.numel()
    if not n:
        return PartScan(key, path, True, 0, 0, change.aligned)
    if rule is not None:  # a quantized delta's rows, so the policy weighs what it will write
        return PartScan(key, path, True, n,
                        n * (rowwise.row_bytes(t[0].numel(), rule.bits, rule.scale_dtype) + 8))
    if is_row_sparse(t) or change.aligned:
        return PartScan(key, path, True, n, n * (math.prod(t.shape[1:]) * t.element_size() + 8), change.aligned)
    return PartScan(key, path, True, n, n * chunk_elems(t) * t.element_size())


@dataclass(frozen=True)
class Scanned:
    """A rank's scan of the items it writes: their tensors by key, each one's change set, and
    each item's change set and part scan, in order."""

    items: tuple[WriteItem, ...]
    tensors: dict[str, torch.Tensor]
    changes: Mapping[str, TensorChange]
    found: list[TensorChange]
    scans: list[PartScan]


def scan(tracker: ChangeTracker, items: tuple[WriteItem, ...], quantize: QuantizePlan | None = None,
         last: Scanned | None = None, held: Container[str] | None = None) -> Scanned:
    """The change set of every item's tensor, and its summary for the coordinator (sized as
    quantized for the tensors a ``quantize`` rule names). ``last``: the rank's last scan; of the
    same ``items`` (the same tuple), an item whose change set is the same object as then (an
    unchanged tensor's, see :meth:`~deltackpt.tracking.references.Reference.unchanged`) keeps
    its part scan: thousands of unchanged tensors cost no object each. ``held``: the keys of
    every tensor the rank holds (see :meth:`~deltackpt.tracking.changes.ChangeTracker.scan`)."""
    again = last is not None and last.items is items
    tensors = last.tensors if again else {it.key: it.tensor for it in items}  # type: ignore[union-attr]
    changes = tracker.scan(tensors, held)
    found = list(map(changes.__getitem__, map(_KEY, items)))
    rules = {it.key: c.rule for it in items
             if (c := quantize.choose(it.key, restores=quantize.restores)) is not None
             } if quantize is not None and quantize.rules else {}

    def made(it: WriteItem, change: TensorChange) -> PartScan:
        return summarize(it.key, it.part.path, it.tensor, change, tracker.chunk_elems, rules.get(it.key))

    if again and not rules:
        scans = list(last.scans)  # type: ignore[union-attr]
        for i in itertools.compress(range(len(items)), map(operator.is_not, found, last.found)):  # type: ignore[union-attr]
            scans[i] = made(items[i], found[i])
    else:
        scans = [made(it, ch) for it, ch in zip(items, found)]
    return Scanned(items, tensors, changes, found, scans)


def settled(last: Scanned, unchanged: Mapping[str, TensorChange], chunk_elems: Callable[[torch.Tensor], int]
            ) -> Scanned:
    """``last``, a base's scan, with the change set ``unchanged`` gives a tensor (the one the next
    scan finds it if unchanged, see :meth:`~deltackpt.tracking.changes.ChangeTracker.adopt`) and
    its part scan: the first delta after the base then makes those of its changed tensors alone."""
    found = [unchanged.get(it.key, ch) for it, ch in zip(last.items, last.found)]
    scans = [s if now is was else summarize(it.key, it.part.path, it.tensor, now, chunk_elems)
             for it, now, was, s in zip(last.items, found, last.found, last.scans)]
    return replace(last, found=found, scans=scans)
