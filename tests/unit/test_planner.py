"""The global plan: validation of the ranks' boxes, one writer per box, replicas spread evenly."""

from __future__ import annotations

import time

import pytest
import torch

import deltackpt.save.planner as planner_module
from deltackpt import Checkpointer, StateError
from deltackpt.save.planner import ItemInfo, LocalPlan, make_global_plan
from deltackpt.sharding import Box, check_tiling

TREE = {"dict": []}


def plan_of(rank: int, *items: ItemInfo) -> LocalPlan:
    return LocalPlan(rank, tuple(items), TREE, (1, 1))


def item(key: str, shape, offset, local, dtype="float32") -> ItemInfo:
    return ItemInfo(key, dtype, tuple(shape), Box(tuple(offset), tuple(local)), 4)


def test_row_shards_each_written_by_their_holder():
    plans = [plan_of(r, item("t", (10, 4), (5 * r, 0), (5, 4))) for r in range(2)]
    plan = make_global_plan(plans, TREE)
    parts = plan.tensors["t"].parts
    assert [(p.box.offset, p.writer, p.path) for p in parts] == [((0, 0), 0, "p0"), ((5, 0), 1, "p1")]


def test_replicas_are_written_once_and_spread():
    plans = [plan_of(r, *(item(f"w{i}", (100,), (0,), (100,)) for i in range(8))) for r in range(4)]
    plan = make_global_plan(plans, TREE)
    writers = [p.writer for t in plan.tensors.values() for p in t.parts]
    assert len(writers) == 8 and sorted(writers) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(t.parts[0].path == "" for t in plan.tensors.values())


def test_a_rank_with_no_rows_writes_nothing():
    plans = [plan_of(0, item("t", (2, 4), (0, 0), (1, 4))), plan_of(1, item("t", (2, 4), (1, 0), (1, 4))),
             plan_of(2, item("t", (2, 4), (2, 0), (0, 4)))]
    parts = make_global_plan(plans, TREE).tensors["t"].parts
    assert sorted(p.writer for p in parts) == [0, 1]


@pytest.mark.parametrize(
    "boxes, message",
    [
        ([((0, 0), (6, 4)), ((5, 0), (5, 4))], "cover 44 of 40"),
        ([((0, 0), (5, 4))], "cover 20 of 40"),
        # The same volume as the tensor, but two boxes overlap (and a row is missing).
        ([((0, 0), (5, 4)), ((4, 0), (5, 4))], "overlap"),
        ([((0, 0), (10, 2)), ((0, 1), (10, 2))], "overlap"),
        ([((8, 0), (5, 4))], "outside"),
    ],
)
def test_bad_tilings(boxes, message):
    with pytest.raises(StateError, match=message):
        check_tiling("t", (10, 4), [Box(o, s) for o, s in boxes])


def test_ranks_disagree_on_dtype():
    plans = [plan_of(0, item("t", (4,), (0,), (2,))), plan_of(1, item("t", (4,), (2,), (2,), "bfloat16"))]
    with pytest.raises(StateError, match="ranks disagree: float32 \\[4\\] vs bfloat16 \\[4\\] on rank 1"):
        make_global_plan(plans, TREE)


def test_hundred_thousand_ranges_plan_and_validate():
    # 1000 tables, each row-sharded over 100 ranks: 10^5 boxes.
    plans = [plan_of(r, *(item(f"t{i}", (100_000, 16), (1000 * r, 0), (1000, 16)) for i in range(1000)))
             for r in range(100)]
    t0 = time.perf_counter()
    plan = make_global_plan(plans, TREE)
    elapsed = time.perf_counter() - t0
    assert sum(len(t.parts) for t in plan.tensors.values()) == 100_000
    assert all(p.writer == p.box.offset[0] // 1000 for t in plan.tensors.values() for p in t.parts)
    print(f"planned and validated 10^5 boxes in {elapsed:.2f} s")


def test_the_global_plan_is_cached_while_the_layout_holds(store_path, monkeypatch):
    calls = []
    real = planner_module.make_global_plan
    monkeypatch.setattr(planner_module, "make_global_plan",
                        lambda *a: calls.append(1) or real(*a))
    w = torch.zeros(10, 4)
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, {"w": w})
        w[1] = 1
        ckpt.save(1, {"w": w})
        assert len(calls) == 1
        ckpt.save(2, {"w": w, "b": torch.zeros(3)})
        assert len(calls) == 2
