"""Background saves on two ranks: what the ranks change after the call never reaches the step,
and a rank failing or dying in the background write fails the save on every rank at the next
call, with nothing committed and earlier steps intact."""

from __future__ import annotations

import datetime

import torch

from deltackpt import Checkpointer, Shard
from dist_harness import check_ok, run_ranks
from faults import FaultStorage, HeldWrites

ROWS = 40


def state(rank: int, world: int, step: int) -> dict:
    table = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) + step * (torch.arange(ROWS) % 7 == 0)[:, None]
    block = ROWS // world
    local = table[rank * block : (rank + 1) * block].clone()
    return {"table": Shard(local, global_shape=(ROWS, 4), global_offset=(rank * block, 0)),
            "dense": torch.full((10,), float(step)), "step": step}


def mutate_job(rank: int, world: int, root: str) -> dict:
    ckpt = Checkpointer(root, chunk_bytes=64, memory_budget=1024)
    live = state(rank, world, 0)
    blocked = []
    for step in (1, 2, 3):
        want = state(rank, world, step)
        live["table"].local.copy_(want["table"].local)
        live["dense"].copy_(want["dense"])
        live["step"] = step
        handle = ckpt.save(step, live, blocking=False)
        blocked.append(handle.blocked_seconds)
        live["table"].local.fill_(-1.0)  # the ranks train on at once
        live["dense"].fill_(-1.0)
    kinds = [ckpt.wait().kind]
    restored = []
    for step in (1, 2, 3):
        got = state(rank, world, 0)
        ckpt.restore(got, step)
        want = state(rank, world, step)
        restored.append(torch.equal(got["table"].local, want["table"].local)
                        and torch.equal(got["dense"], want["dense"]) and got["step"] == step)
    ckpt.close()
    return {"restored": restored, "kinds": kinds, "blocked": blocked}


def test_changes_after_the_call_do_not_reach_the_step_on_two_ranks(tmp_path):
    for r in check_ok(run_ranks(mutate_job, 2, str(tmp_path), str(tmp_path / "store"))):
        assert r["restored"] == [True, True, True] and r["kinds"] == ["delta"]
        assert all(b > 0 for b in r["blocked"])


def over_budget_job(rank: int, world: int, root: str) -> dict:
    # Each rank's 32 rows are 8 chunks through 4 staging buffers: the call writes 4 of them to
    # make room and returns with the other 4 staged, their writes held until the table changed.
    storage = HeldWrites(root, key="table", passing=4)
    table = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    local = table[rank * 32 : (rank + 1) * 32].clone()
    ckpt = Checkpointer(storage, chunk_bytes=256, memory_budget=1024, io_threads=4, threads=4)
    handle = ckpt.save(1, {"table": Shard(local, global_shape=(64, 16), global_offset=(rank * 32, 0))},
                       blocking=False)
    out = {"passed": storage.passed, "done": handle.done()}
    local.fill_(-1.0)
    storage.open()
    out["kind"] = handle.result().kind
    out["written"] = storage.passed + storage.held
    ckpt.close()
    with Checkpointer(root, create=False) as again:
        out["loaded"] = torch.equal(again.load(1)["table"], table)
    return out


def test_a_base_over_the_budget_stages_in_pieces_on_two_ranks(tmp_path):
    for r in check_ok(run_ranks(over_budget_job, 2, str(tmp_path), str(tmp_path / "store"))):
        assert r == {"passed": 4, "done": False, "kind": "base", "written": 8, "loaded": True}, r


def fault_job(rank: int, world: int, root: str, action: str) -> dict:
    storage = FaultStorage(root, phase="none", rank=1, action=action)
    ckpt = Checkpointer(storage, timeout=datetime.timedelta(seconds=6), chunk_bytes=64,
                        memory_budget=1024)
    ckpt.save(1, state(rank, world, 1))
    storage.fault = ("fsync", 1, action, 1, 30.0)  # in the background write of step 2
    live = state(rank, world, 2)
    ckpt.save(2, live, blocking=False)
    live["table"].local.fill_(-1.0)
    outcome: dict = {}
    try:
        ckpt.wait()
        outcome["raised"] = None
    except Exception as e:  # noqa: BLE001 - the test inspects it
        outcome["raised"] = type(e).__name__
    outcome["steps"] = ckpt.steps()
    storage.fault = ("none", -1, "raise", 1, 0)
    if action == "raise":
        outcome["retry"] = ckpt.save(3, state(rank, world, 3)).kind
        got = state(rank, world, 0)
        ckpt.restore(got, 3)
        outcome["restored"] = torch.equal(got["table"].local, state(rank, world, 3)["table"].local)
    ckpt.close()
    return outcome


def test_a_rank_failing_in_the_background_fails_the_save_on_every_rank(tmp_path):
    results = check_ok(run_ranks(fault_job, 2, str(tmp_path), str(tmp_path / "store"), "raise"))
    for r in results:
        assert r["raised"] == "CheckpointAborted" and r["steps"] == [1], r
        assert r["retry"] == "delta" and r["restored"], r


def test_a_rank_killed_in_the_background_fails_the_save_on_the_others(tmp_path):
    results = run_ranks(fault_job, 2, str(tmp_path), str(tmp_path / "store"), "sigkill", deadline=30)
    assert results[1] is None  # killed
    r0 = results[0]
    assert r0 is not None and r0[0] == "ok", r0
    assert r0[1]["raised"] == "CheckpointAborted" and r0[1]["steps"] == [1]
    with Checkpointer(tmp_path / "store", create=False) as ckpt:
        assert ckpt.steps() == [1] and ckpt.verify().ok
