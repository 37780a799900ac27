"""The global plan: validation of the ranks' boxes, one writer per box, replicas spread evenly."""

from __future__ import annotations

import time

import pytest
import torch

import deltackpt.save.planner as planner_module
from deltackpt import Checkpointer, StateError, StepExistsError
from deltackpt.save.planner import GlobalPlanner, ItemInfo, LocalPlan, PlanRequest, make_global_plan
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


def _requests(step: int, plans: list[LocalPlan], holds: list[str | None], sent: list[str | None]
              ) -> list[PlanRequest]:
    """What each rank sends: its plan only when its digest differs from the one it sent last."""
    return [PlanRequest(step, p.digest(), None if p.digest() == s else p, h)
            for p, h, s in zip(plans, holds, sent, strict=True)]


def test_each_rank_receives_its_own_parts_and_only_when_it_lacks_them():
    def layout(rows: int) -> list[LocalPlan]:
        block = rows // 3
        return [plan_of(r, item("t", (rows, 4), (block * r, 0), (block, 4)),
                        item(f"own{r}", (2,), (0,), (2,))) for r in range(3)]

    planner = GlobalPlanner(3)
    plans = layout(30)
    answers = planner.assign(_requests(1, plans, [None] * 3, [None] * 3), lambda step: None)
    assert all(a is not None for a in answers)
    assert [sorted(k for k, _ in a.parts) for a in answers] == [["own0", "t"], ["own1", "t"], ["own2", "t"]]
    assert {(k, p) for a in answers for k, p in a.parts} == set(planner.plan.parts())
    assert all(p.writer == r for r, a in enumerate(answers) for _, p in a.parts)
    tag = answers[0].tag
    # The layout holds: digests only, and no rank receives anything, but one that lost its parts.
    digests = [p.digest() for p in plans]
    again = planner.assign(_requests(2, plans, [tag, None, tag], digests), lambda step: None)
    assert again[0] is None and again[2] is None and again[1] == answers[1]
    # One rank's layout changes: every rank receives its parts of the new plan.
    moved = layout(60)
    fresh = planner.assign(_requests(3, moved, [tag] * 3, digests), lambda step: None)
    assert all(a is not None and a.tag != tag for a in fresh)
    assert [p.box.shape for a in fresh for k, p in a.parts if k == "t"] == [(20, 4)] * 3


def test_assign_refuses_steps_that_differ_and_a_rank_without_a_plan():
    plans = [plan_of(r, item("t", (4,), (2 * r,), (2,))) for r in range(2)]
    planner = GlobalPlanner(2)
    requests = _requests(1, plans, [None] * 2, [None] * 2)
    with pytest.raises(StepExistsError, match=r"ranks save different steps: \[1, 2\]"):
        planner.assign([requests[0], PlanRequest(2, requests[1].digest, requests[1].plan, None)],
                       lambda step: None)
    with pytest.raises(StateError, match=r"no local plan from ranks \[1\]"):
        GlobalPlanner(2).assign([requests[0], PlanRequest(1, requests[1].digest, None, None)],
                                lambda step: None)
