"""What newer steps of a chain already wrote into a destination box, so a replay writes each row
and element once.

A chain is replayed newest delta first: a delta's row (or a dense delta's element) is used only
where no newer delta wrote it, so the writes of different deltas never overlap and can run in
any order, and no row is copied more than once however long the chain.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ..sharding import Box


class RowCover:
    """Rows of a destination box written by newer steps, per cell of columns.

    Parts of a tensor may split it along its other dimensions too (column-wise sharding, and a
    chain saved under different layouts), so the box's columns are cut at every part's edges
    into cells; within a cell, a part holds a row whole or not at all.

    Args:
        box: the destination box (at least one dimension).
        parts: the boxes of every part that will claim rows.
    """

    def __init__(self, box: Box, parts: Iterable[Box]):
        parts = list(parts)
        cuts = []
        for d in range(1, len(box.shape)):
            lo, hi = box.offset[d], box.offset[d] + box.shape[d]
            edges = {lo, hi} | {x for p in parts for x in (p.offset[d], p.offset[d] + p.shape[d]) if lo < x < hi}
            ordered = sorted(edges)
            cuts.append(list(zip(ordered, ordered[1:])))
        self._box = box
        self._cells = [Box((box.offset[0], *(a for a, _ in c)), (box.shape[0], *(b - a for a, b in c)))
                       for c in itertools.product(*cuts)]
        self._written = [torch.zeros(box.shape[0], dtype=torch.bool) for _ in self._cells]

    def claim(self, inter: Box, local: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
        """Claims rows ``local`` (indices into the box's rows) of a part whose intersection with
        the box is ``inter``, for a step older than every step that claimed before.

        Returns:
            For each cell inside ``inter``: the cell, and a mask over ``local`` of the rows no
            newer step wrote there (the rows this part must write in that cell).
        """
        out = []
        for cell, written in zip(self._cells, self._written):
            inside = all(i <= c < i + n for c, i, n in zip(cell.offset[1:], inter.offset[1:], inter.shape[1:]))
            if inside:
                out.append((cell, ~written[local]))
                written[local] = True
        return out


class SpanCover:
    """Element spans ``[start, stop)`` of a flat destination written by newer steps."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, int]] = []  # sorted, disjoint, not touching

    def claim(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Claims ``[start, stop)`` for a step older than every step that claimed before.

        Returns:
            The pieces of ``[start, stop)`` that no newer step wrote, in order.
        """
        free, at = [], start
        for a, b in self._spans:
            if b <= at or a >= stop:
                continue
            if a > at:
                free.append((at, a))
            at = max(at, b)
        if at < stop:
            free.append((at, stop))
        merged = [(a, b) for a, b in self._spans if b < start or a > stop]
        lo = min([start] + [a for a, b in self._spans if not (b < start or a > stop)])
        hi = max([stop] + [b for a, b in self._spans if not (b < start or a > stop)])
        self._spans = sorted(merged + [(lo, hi)])
        return free


class RowSpans:
    """Element spans of a 1-d destination claimed through its :class:`RowCover`: a 1-d tensor's
    rows are its elements, so its row deltas (row-aligned state) and dense deltas (chunks) of
    one chain claim from one cover.

    Args:
        rows: the destination's row cover.
        start: the destination's first element.
    """

    def __init__(self, rows: RowCover, start: int):
        self._rows = rows
        self._start = start

    def claim(self, start: int, stop: int) -> list[tuple[int, int]]:
        """As :meth:`SpanCover.claim`."""
        box = Box((start,), (stop - start,))
        ((_, keep),) = self._rows.claim(box, torch.arange(start - self._start, stop - self._start))
        edges = np.flatnonzero(np.diff(np.concatenate(([False], keep.numpy(), [False])).astype(np.int8)))
        return [(start + int(a), start + int(b)) for a, b in zip(edges[::2], edges[1::2])]


@dataclass(frozen=True)
class Covers:
    """What newer deltas wrote, for one replay into one box: rows (None for a 0-d box) and
    element spans; a delta's encoding claims from the one it needs (see
    :attr:`deltackpt.format.encodings.Encoding.claims`)."""

    rows: RowCover | None
    spans: SpanCover | RowSpans

    @classmethod
    def of(cls, box: Box, parts: Iterable[Box]) -> Covers:
        """The covers of a replay into ``box`` by deltas whose parts are ``parts``."""
        if not box.shape:
            return cls(None, SpanCover())
        rows = RowCover(box, parts)
        return cls(rows, RowSpans(rows, box.offset[0]) if len(box.shape) == 1 else SpanCover())
