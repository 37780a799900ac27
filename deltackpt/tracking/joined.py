"""The small tensors a scan hashes in one call (:class:`~deltackpt.kernels.Segments`): how a scan
splits a state's tensors, kept from scan to scan while they are the same, and the change sets of
the small ones found from the hashes of that call (see :mod:`deltackpt.tracking.changes`)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels  # installed from kernels/, see pyproject
from .references import Reference, TensorChange, same_tensors


@dataclass(frozen=True)
class Joined:
    """The tensors one :class:`~deltackpt.kernels.Segments` call hashed: their keys in call
    order, the hashes it gave, and the call (its tensors' pieces, and where each one's hashes
    end)."""

    keys: list[str]
    hashes: torch.Tensor
    segments: kernels.Segments

    def of(self, i: int) -> torch.Tensor:
        """The hashes of ``keys[i]``."""
        ends = self.segments.ends
        return self.hashes[(ends[i - 1] if i else 0) : ends[i]]


@dataclass
class Layout:
    """How a scan split a set of tensors that all have references: the small ones hashed
    together (``small``: their keys, and ``segments``: the prepared call), the large ones
    hashed each on their own. Kept while the next scans get the same tensors (the saver's views
    of the state, which keep their dtypes and shapes), with the references the last scan found
    for the small ones, their change sets then (``found``) and which of those it found changed
    (``dirty``): a scan of thousands of unchanged tiny tensors asks none of them anything but
    where its bytes lie, and makes no object for any."""

    keys: list[str]
    tensors: list[torch.Tensor]
    aligned: frozenset[str]
    large: list[str]
    small: list[str]
    segments: kernels.Segments
    refs: list[Reference]
    found: list[TensorChange]
    dirty: set[int]

    def fits(self, tensors: dict[str, torch.Tensor], aligned: set[str]) -> bool:
        """Whether ``tensors`` are this layout's, in order, the same objects, scanned with the
        same ``aligned`` keys."""
        return same_tensors(tensors, self.keys, self.tensors) and self.aligned == aligned


def lay_out(tensors: Mapping[str, torch.Tensor], refs: Mapping[str, Reference], aligned: set[str],
            piece: Callable[[torch.Tensor, bool], int], last: Joined | None) -> Layout | None:
    """The :class:`Layout` of ``tensors``, or None if one has no reference in ``refs`` that it
    matches (a new tensor, or a new dtype or shape); ``piece`` gives a tensor's piece size when
    hashed by rows or not (0: not small). ``last``: the joined references, whose call is taken
    again for the same tensors in the same pieces (a base's, see
    :meth:`~deltackpt.tracking.changes.ChangeTracker.hash_many`)."""
    large, small, pieces = [], [], []
    for key, t in tensors.items():
        ref = refs.get(key)
        if ref is None or not ref.matches(t, t.dim() >= 2 or key in aligned):
            return None
        if t.is_cpu and t.is_contiguous():
            if ref.piece is None:  # the same for every tensor the reference matches
                ref.piece = piece(t, ref.by_rows)
            if ref.piece:
                small.append(key)
                pieces.append(ref.piece)
                continue
        large.append(key)
    held = [tensors[k] for k in small]
    same = (last is not None and last.keys == small and last.segments.pieces == pieces
            and all(map(operator.is_, last.segments.tensors, held)))
    segments = last.segments if same else kernels.Segments(held, pieces)  # type: ignore[union-attr]
    return Layout(list(tensors), list(tensors.values()), frozenset(aligned), large, small, segments,
                  [], [], set())


def scan_small(layout: Layout, hashes: torch.Tensor, refs: Mapping[str, Reference], aligned: set[str],
               last: Joined | None) -> tuple[dict[str, TensorChange], Joined]:
    """The change sets of ``layout``'s small tensors, from ``hashes`` (what its one call gives
    now) compared with their references joined (``last``: as the last commit left them, when it
    joined the same tensors the same way), and that call's hashes. An unchanged tensor's change
    set is its reference's (:meth:`Reference.unchanged`), kept in the layout with the reference:
    only those of the tensors changed now or at the last scan, or whose reference is new, are
    made again."""
    keys = layout.small
    joined = Joined(keys, hashes, layout.segments)
    now = list(map(refs.__getitem__, keys))
    if last is not None and last.keys == keys and last.segments.pieces == layout.segments.pieces:
        before = last.hashes
    else:
        before = torch.cat([ref.hashes for ref in now])
    differs = (joined.hashes != before).nonzero().flatten().numpy()
    changed = set(np.searchsorted(layout.segments.ends, differs, side="right").tolist())

    def made(i: int) -> TensorChange:
        ref, one_d = now[i], _one_d(layout, i, aligned)
        if i not in changed:
            return ref.unchanged(one_d)
        h = joined.of(i)
        return TensorChange((h != ref.hashes).nonzero().flatten(), h, aligned=one_d)

    if len(layout.refs) != len(now):  # the layout's first scan
        settle(layout, now, aligned)
    same = np.fromiter(map(operator.is_, now, layout.refs), dtype=bool, count=len(now))
    found = list(layout.found)
    for i in changed | layout.dirty | set(np.flatnonzero(~same).tolist()):
        found[i] = made(i)
    layout.refs, layout.found, layout.dirty = now, found, changed
    return dict(zip(keys, found)), joined


def settle(layout: Layout, refs: list[Reference], aligned: set[str]) -> None:
    """Keeps ``refs`` (of ``layout``'s small tensors, in order) as the references its next scan
    compares with, with each one's change set unchanged, as that scan finds an unchanged tensor's:
    a base makes them for the first delta after it (see
    :meth:`~deltackpt.tracking.changes.ChangeTracker.adopt`), which then makes its changed
    tensors' alone. Nothing is made when ``refs`` are the kept ones already."""
    if len(refs) == len(layout.refs) and all(map(operator.is_, refs, layout.refs)):
        return
    layout.found = [ref.unchanged(_one_d(layout, i, aligned)) for i, ref in enumerate(refs)]
    layout.refs, layout.dirty = refs, set()


def _one_d(layout: Layout, i: int, aligned: set[str]) -> bool:
    """Whether small tensor ``i`` of ``layout`` is 1-d and aligned (ChangeTracker._aligned_1d)."""
    return layout.small[i] in aligned and layout.segments.tensors[i].dim() == 1
