"""A tensor's parts described by rule: even splits take a few numbers whatever the world, other
grids list their cuts, and a box's parts follow from the rule alone."""

from __future__ import annotations

import itertools
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from deltackpt.format.part_layout import MAX_LISTED, describe, parse_layout
from deltackpt.sharding import Box, check_tiling


def split(shape: tuple[int, ...], dim: int, parts: int) -> list[Box]:
    """``torch.chunk``'s blocks of ``shape`` along ``dim`` (empty ones left out, as the plan
    leaves them)."""
    block = -(-shape[dim] // parts)
    out = []
    for i in range(parts):
        lo, hi = min(shape[dim], i * block), min(shape[dim], (i + 1) * block)
        if hi > lo:
            out.append(Box(tuple(lo if d == dim else 0 for d in range(len(shape))),
                           tuple(hi - lo if d == dim else n for d, n in enumerate(shape))))
    return out


def test_even_splits_take_a_few_bytes_at_any_world():
    rows = describe((64 * 4096 + 37, 64), split((64 * 4096 + 37, 64), 0, 4096), range(4034))
    assert rows is not None and rows.to_doc() == {"grid": [65, 64], "writers": [[0, 4034]]}
    few = describe((2053, 64), split((2053, 64), 0, 4096), range(2053))  # fewer rows than ranks
    assert few is not None and few.to_doc() == {"grid": [1, 64], "writers": [[0, 2053]]}
    # Columns over 8 ranks from rank 4092 on, wrapping round to rank 0.
    cols = describe((1000, 64), split((1000, 64), 1, 8), [4092, 4093, 4094, 4095, 0, 1, 2, 3])
    assert cols is not None and cols.to_doc() == {"grid": [1000, 8], "writers": [[4092, 4], [0, 4]]}
    table = describe((1000, 64), [Box((0, 0), (1000, 64))], [17])
    assert table is not None and table.to_doc() == {"grid": [1000, 64], "writers": [[17, 1]]}
    scalar = describe((), [Box((), ())], [0])
    assert scalar is not None and scalar.to_doc() == {"grid": [], "writers": [[0, 1]]}
    assert len(json.dumps(rows.to_doc())) < 60


def test_parts_that_follow_no_grid_have_no_layout():
    assert describe((10, 4), [Box((0, 0), (5, 4)), Box((4, 0), (6, 4))], [0, 1]) is None  # overlap
    assert describe((10, 4), [Box((5, 0), (5, 4)), Box((0, 0), (5, 4))], [0, 1]) is None  # not by offset
    # An L of three boxes is no grid.
    assert describe((4, 4), [Box((0, 0), (2, 4)), Box((2, 0), (2, 2)), Box((2, 2), (2, 2))], [0, 1, 2]) is None
    assert describe((5, 0), [Box((0, 0), (3, 0)), Box((3, 0), (2, 0))], [0, 1]) is None  # no elements
    n = MAX_LISTED + 2
    uneven = [Box((i * (i + 1) // 2, 0), (i + 1, 2)) for i in range(n)]
    assert describe((n * (n + 1) // 2, 2), uneven, range(n)) is None  # too many cuts to list
    shuffled = [(7 * i) % (2 * MAX_LISTED + 1) for i in range(2 * MAX_LISTED + 1)]
    assert describe((2 * MAX_LISTED + 1, 2), split((2 * MAX_LISTED + 1, 2), 0, 2 * MAX_LISTED + 1), shuffled) is None


@st.composite
def grids(draw):
    """A grid of 1-3 dimensions, each split evenly or at listed cuts, and its writers."""
    shape, axes = [], []
    for _ in range(draw(st.integers(1, 3))):
        size = draw(st.integers(1, 12))
        if draw(st.booleans()):
            block = draw(st.integers(1, size))
            edges = [*range(0, size, block), size]
        else:
            cuts = draw(st.sets(st.integers(1, size - 1), max_size=5)) if size > 1 else set()
            edges = [0, *sorted(cuts), size]
        shape.append(size)
        axes.append(list(zip(edges, edges[1:])))
    cells = [Box(tuple(lo for lo, _ in c), tuple(hi - lo for lo, hi in c)) for c in itertools.product(*axes)]
    first = draw(st.integers(0, 100))
    return tuple(shape), cells, [first + i for i in range(len(cells))]


@settings(deadline=None)
@given(grids(), st.data())
def test_the_parts_meeting_a_box_are_those_whose_boxes_meet_it(grid, data):
    shape, boxes, writers = grid
    check_tiling("t", shape, boxes)
    layout = describe(shape, boxes, writers)
    assert layout is not None and layout.count == len(boxes)
    assert parse_layout(json.loads(json.dumps(layout.to_doc())), shape, len(boxes),
                        [[writers[0], writers[-1]]], "t") == layout
    assert [layout.box(i) for i in range(len(boxes))] == boxes
    assert [layout.writer(i) for i in range(len(boxes))] == writers
    lo = [data.draw(st.integers(0, n - 1)) for n in shape]
    box = Box(tuple(lo), tuple(data.draw(st.integers(0, n - a)) for a, n in zip(lo, shape)))
    met = [i for i, b in enumerate(boxes) if (inter := b.intersect(box)) is not None and inter.numel]
    assert list(layout.meeting(box)) == met
    assert math.prod(box.shape) == 0 or met
