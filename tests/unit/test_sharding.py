"""Boxes: the block two boxes share, equal ones included (every part of a state of small
tensors is read whole, through the equal boxes' quick path)."""

from __future__ import annotations

import itertools

from deltackpt.sharding import Box


def common(a: Box, b: Box) -> Box | None:
    """The common block, cell by cell."""
    cells = [c for c in itertools.product(*(range(o, o + n) for o, n in zip(a.offset, a.shape)))
             if all(o <= x < o + n for x, o, n in zip(c, b.offset, b.shape))]
    if not cells:
        return None
    lo = tuple(min(c[d] for c in cells) for d in range(len(a.shape)))
    return Box(lo, tuple(max(c[d] for c in cells) - lo[d] + 1 for d in range(len(a.shape))))


def test_the_common_block_of_any_two_boxes():
    spans = [(0, 0), (0, 2), (1, 2), (2, 3), (4, 1)]
    for (o1, n1), (o2, n2), (o3, n3) in itertools.product(spans, spans, spans):
        for a, b in ((Box((o1, o2), (n1, n2)), Box((o3, o1), (n3, n1))), (Box((o1, o2), (n1, n2)),) * 2):
            assert a.intersect(b) == common(a, b), (a, b)


def test_a_0d_box_meets_itself():
    assert Box((), ()).intersect(Box((), ())) == Box((), ())
