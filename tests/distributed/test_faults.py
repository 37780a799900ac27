"""A rank failing in any phase of a save aborts the save on every rank with one typed error;
nothing is committed, the group stays usable and earlier steps restore."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from deltackpt import Checkpointer, Shard
from dist_harness import check_ok, run_ranks
from faults import FaultStorage

ROWS = 40


def state(rank: int, world: int, step: int) -> dict:
    table = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) + step * (torch.arange(ROWS) % 7 == 0)[:, None]
    block = ROWS // world
    local = table[rank * block : (rank + 1) * block].clone()
    return {"table": Shard(local, global_shape=(ROWS, 4), global_offset=(rank * block, 0)),
            "dense": torch.full((10,), float(step)), "step": step}


def fault_job(rank: int, world: int, root: str, phase: str, bad_rank: int, action: str) -> dict:
    timeout = datetime.timedelta(seconds=6)
    storage = FaultStorage(root, phase="none", rank=bad_rank, action=action)
    ckpt = Checkpointer(storage, timeout=timeout, chunk_bytes=64, memory_budget=1024)
    ckpt.save(1, state(rank, world, 1))
    storage.fault = (phase, bad_rank, action, 1, 30.0)
    started = time.monotonic()
    try:
        ckpt.save(2, state(rank, world, 2))
        outcome = {"raised": None}
    except Exception as e:  # noqa: BLE001 - the test inspects it
        outcome = {"raised": type(e).__name__, "failures": getattr(e, "failures", None), "msg": str(e)}
    outcome["seconds"] = time.monotonic() - started
    outcome["steps"] = ckpt.steps()
    if action == "raise":
        # The group stays usable: a collective and the same save again both work.
        t = torch.ones(1)
        dist.all_reduce(t)
        outcome["all_reduce"] = t.item()
        storage.fault = ("none", -1, "raise", 1, 0)
        outcome["retry"] = ckpt.save(2, state(rank, world, 2)).kind
        got = state(rank, world, 0)
        ckpt.restore(got, 2)
        want = state(rank, world, 2)
        outcome["restored"] = torch.equal(got["table"].local, want["table"].local)
    ckpt.close()
    return outcome


# (phase, rank): plan_global and the commit record run on the coordinator only.
CASES = [(p, r) for p in ("plan_local", "write_chunk", "fsync") for r in (0, 1)] + [
    ("plan_global", 0), ("write_manifest_tmp", 0), ("rename_manifest", 0)]


@pytest.mark.parametrize("phase, bad_rank", CASES)
def test_exception_in_each_phase(tmp_path, phase, bad_rank):
    results = check_ok(run_ranks(fault_job, 2, str(tmp_path), str(tmp_path / "store"), phase,
                                 bad_rank, "raise"))
    for r in results:
        assert r["raised"] == "CheckpointAborted", r
        assert list(r["failures"]) == [bad_rank] and "[Errno 5]" in r["failures"][bad_rank][1]
        assert r["steps"] == [1]
        assert r["all_reduce"] == 2.0 and r["retry"] == "delta" and r["restored"]


@pytest.mark.parametrize("action", ["sigkill", "sleep"])
def test_dead_or_hung_rank(tmp_path, action):
    results = run_ranks(fault_job, 2, str(tmp_path), str(tmp_path / "store"), "write_chunk", 1,
                        action, deadline=20)
    assert results[1] is None  # killed, or still hanging when the test gave up on it
    r0 = results[0]
    assert r0 is not None and r0[0] == "ok", r0
    assert r0[1]["raised"] == "CheckpointAborted" and r0[1]["steps"] == [1]
    assert r0[1]["seconds"] < 6 + 10
    with Checkpointer(tmp_path / "store", create=False) as ckpt:
        assert ckpt.steps() == [1]
        assert ckpt.load(1)["step"] == 1
        assert ckpt.verify().ok
