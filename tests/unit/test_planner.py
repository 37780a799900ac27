"""The global plan: validation of the ranks' boxes, one writer per box, replicas spread evenly;
made on every rank's columns at once, it gives the plan the per-box reference below gives."""

from __future__ import annotations

import math
import pickle
import random
import time

import pytest
import torch

import deltackpt.save.planner as planner_module
from deltackpt import Checkpointer, StateError, StepExistsError
from deltackpt.format.part_layout import describe
from deltackpt.save.planner import GlobalPlanner, LocalPlan, PlanRequest, make_global_plan
from deltackpt.sharding import Box, check_tiling

TREE = {"dict": []}
Item = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # key, dtype, shape, offset, local


def plan_of(rank: int, *items: Item, tree: dict = TREE) -> LocalPlan:
    return LocalPlan.of(rank, sorted(items), pickle.dumps(tree), (1, 1))


def item(key: str, shape, offset, local, dtype="float32") -> Item:
    return key, dtype, tuple(shape), tuple(offset), tuple(local)


def reference(plans: list[list[Item]]) -> dict[str, tuple[str, tuple[int, ...], list[tuple[Box, int, str]], dict | None]]:
    """The global plan box by box, as a Python object per box: each tensor's dtype, shape,
    parts (box, writer, path, by offset) and layout."""
    holders: dict[str, dict[tuple, list]] = {}
    meta: dict[str, Item] = {}
    for rank, items in enumerate(plans):
        for it in items:
            key, dtype, shape, offset, local = it
            first = meta.setdefault(key, it)
            if first[1:3] != (dtype, shape):
                raise StateError(f"{key}: ranks disagree")
            holders.setdefault(key, {}).setdefault((offset, local), [Box(offset, local)]).append(rank)
    load = [0] * len(plans)
    kept, shared = {}, []
    for key in sorted(holders):
        _, dtype, shape, *_ = meta[key]
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        slots, boxes = [], []
        for box, *ranks in holders[key].values():
            boxes.append(box)
            n = box.numel * size
            if not n and math.prod(shape):
                continue
            slot = [box, ranks[0], ranks]
            if len(ranks) == 1:
                load[ranks[0]] += n
            else:
                shared.append((n, key, box.offset, slot))
            slots.append(slot)
        slots.sort(key=lambda s: s[0].offset)
        check_tiling(key, shape, boxes)
        kept[key] = slots
    shared.sort(key=lambda j: (-j[0], j[1], j[2]))
    for n, _, _, slot in shared:
        slot[1] = min(slot[2], key=lambda r: (load[r], r))
        load[slot[1]] += n
    out = {}
    for key, slots in kept.items():
        parts = [(b, w, "" if len(slots) == 1 else f"p{i}") for i, (b, w, _) in enumerate(slots)]
        layout = describe(meta[key][2], [b for b, _, _ in parts], [w for _, w, _ in parts]) if len(parts) > 1 else None
        out[key] = (meta[key][1], meta[key][2], parts, None if layout is None else layout.to_doc())
    return out


def columnar(plans: list[list[Item]]) -> dict[str, tuple[str, tuple[int, ...], list[tuple[Box, int, str]], dict | None]]:
    plan = make_global_plan([plan_of(r, *items) for r, items in enumerate(plans)])
    assert list(plan.tensors) == sorted(plan.tensors)
    out = {}
    for key, t in plan.tensors.items():
        parts = [(p.box, p.writer, p.path) for p in plan.parts_of(key)]
        assert t.ranks == sorted({w for _, w, _ in parts}) and t.count == len(parts)
        out[key] = (t.dtype, t.global_shape, parts, None if t.layout is None else t.layout.to_doc())
    return out


def blocks(size: int, ranks: int, uneven: bool, rng: random.Random) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each of ``ranks`` ranks along a dimension: ``torch.chunk``'s blocks (the
    last ones shorter or empty), or random cuts."""
    if not uneven:
        block = -(-size // ranks)
        return [(min(size, i * block), min(size, (i + 1) * block)) for i in range(ranks)]
    cuts = sorted(rng.randint(0, size) for _ in range(ranks - 1))
    edges = [0, *cuts, size]
    return list(zip(edges[:-1], edges[1:]))


def world(seed: int) -> list[list[Item]]:
    """A random job: row-, column-, 2-d block- and table-wise tensors, replicas, scalars, empty
    tensors, even and uneven blocks, ranks holding nothing of a tensor or nothing at all."""
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, 5, 8, 40])
    plans: list[list[Item]] = [[] for _ in range(n)]
    for i in range(rng.randint(1, 30)):
        key = f"m{rng.randint(0, 3)}/t{i}"
        dtype = rng.choice(["float32", "bfloat16", "int64", "bool"])
        scheme = rng.choice(["row", "col", "block", "table", "replica", "scalar", "empty"])
        shape = (rng.randint(1, 3 * n + 40), rng.randint(1, 9))
        if scheme == "row" or scheme == "col":
            d = 0 if scheme == "row" else 1
            group = rng.sample(range(n), rng.randint(1, n))
            for r, (lo, hi) in zip(group, blocks(shape[d], len(group), rng.random() < 0.4, rng)):
                off, loc = [0, 0], list(shape)
                off[d], loc[d] = lo, hi - lo
                plans[r].append(item(key, shape, off, loc, dtype))
        elif scheme == "block" and n >= 4:  # 2 x 2 blocks on ranks 0-3
            rows, cols = blocks(shape[0], 2, rng.random() < 0.5, rng), blocks(shape[1], 2, False, rng)
            for r, ((a, b), (c, e)) in enumerate((x, y) for x in rows for y in cols):
                plans[r].append(item(key, shape, (a, c), (b - a, e - c), dtype))
        elif scheme in ("table", "block"):
            plans[rng.randrange(n)].append(item(key, shape, (0, 0), shape, dtype))
        elif scheme == "replica":
            for r in rng.sample(range(n), rng.randint(1, n)):
                plans[r].append(item(key, shape[:1], (0,), shape[:1], dtype))
        elif scheme == "scalar":
            for r in rng.sample(range(n), rng.randint(1, n)):
                plans[r].append(item(key, (), (), (), dtype))
        else:
            for r, (lo, hi) in enumerate(blocks(5, n, False, rng)):
                plans[r].append(item(key, (5, 0), (lo, 0), (hi - lo, 0), dtype))
    return plans


@pytest.mark.parametrize("seed", range(60))
def test_columns_give_the_plan_of_the_per_box_reference(seed):
    plans = world(seed)
    assert columnar(plans) == reference(plans)


def test_columns_give_the_reference_plan_of_uneven_shards_past_the_listed_cuts():
    rng = random.Random(7)
    rows = blocks(10_000, 100, True, rng)
    plans = [[item("t", (10_000, 4), (lo, 0), (hi - lo, 4)), item("c", (3, 200), (0, 2 * r), (3, 2))]
             for r, (lo, hi) in enumerate(rows)]
    got = columnar(plans)
    assert got == reference(plans) and got["t"][3] is None and got["c"][3] is not None


def test_a_plan_of_few_tensors_on_many_ranks_and_of_many_tensors_on_one():
    wide = [[item("t", (64 * 300 + 5, 8), (lo, 0), (hi - lo, 8))] for lo, hi in blocks(64 * 300 + 5, 300, False, random.Random(0))]
    assert columnar(wide) == reference(wide)
    many = [[item(f"w{i}", (i % 5 + 1,), (0,), (i % 5 + 1,)) for i in range(2000)]]
    assert columnar(many) == reference(many)


def test_row_shards_each_written_by_their_holder():
    plans = [plan_of(r, item("t", (10, 4), (5 * r, 0), (5, 4))) for r in range(2)]
    plan = make_global_plan(plans)
    parts = plan.parts_of("t")
    assert [(p.box.offset, p.writer, p.path) for p in parts] == [((0, 0), 0, "p0"), ((5, 0), 1, "p1")]


def test_replicas_are_written_once_and_spread():
    plans = [plan_of(r, *(item(f"w{i}", (100,), (0,), (100,)) for i in range(8))) for r in range(4)]
    plan = make_global_plan(plans)
    writers = [p.writer for k in plan.tensors for p in plan.parts_of(k)]
    assert len(writers) == 8 and sorted(writers) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(plan.parts_of(k)[0].path == "" for k in plan.tensors)


def test_a_rank_with_no_rows_writes_nothing():
    plans = [plan_of(0, item("t", (2, 4), (0, 0), (1, 4))), plan_of(1, item("t", (2, 4), (1, 0), (1, 4))),
             plan_of(2, item("t", (2, 4), (2, 0), (0, 4)))]
    parts = make_global_plan(plans).parts_of("t")
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
        make_global_plan(plans)


def test_hundred_thousand_ranges_plan_and_validate():
    # 1000 tables, each row-sharded over 100 ranks: 10^5 boxes.
    plans = [plan_of(r, *(item(f"t{i}", (100_000, 16), (1000 * r, 0), (1000, 16)) for i in range(1000)))
             for r in range(100)]
    t0 = time.perf_counter()
    plan = make_global_plan(plans)
    elapsed = time.perf_counter() - t0
    assert sum(t.count for t in plan.tensors.values()) == 100_000
    assert all(p.writer == p.box.offset[0] // 1000 for k in plan.tensors for p in plan.parts_of(k))
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
    parts = [a.parts(p) for a, p in zip(answers, plans)]
    assert [sorted(k for k, _ in ps) for ps, _ in parts] == [["own0", "t"], ["own1", "t"], ["own2", "t"]]
    keys = list(planner.plan.tensors)
    assert [[keys[i] for i in index] for _, index in parts] == [[k for k, _ in ps] for ps, _ in parts]
    assert {(k, p) for ps, _ in parts for k, p in ps} == {(k, p) for k in keys for p in planner.plan.parts_of(k)}
    assert all(p.writer == r for r, (ps, _) in enumerate(parts) for _, p in ps)
    tag = answers[0].tag
    # The layout holds: digests only, and no rank receives anything, but one that lost its parts.
    digests = [p.digest() for p in plans]
    again = planner.assign(_requests(2, plans, [tag, None, tag], digests), lambda step: None)
    assert again[0] is None and again[2] is None and again[1] == answers[1]
    # One rank's layout changes: every rank receives its parts of the new plan.
    moved = layout(60)
    fresh = planner.assign(_requests(3, moved, [tag] * 3, digests), lambda step: None)
    assert all(a is not None and a.tag != tag for a in fresh)
    assert [p.box.shape for a, m in zip(fresh, moved) for k, p in a.parts(m)[0] if k == "t"] == [(20, 4)] * 3


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
