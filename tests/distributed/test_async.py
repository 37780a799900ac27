"""Background saves on two ranks: what the ranks change after the call never reaches the step,
and a rank failing or dying in the background write fails the save on every rank at the next
call, with nothing committed and earlier steps intact."""

from __future__ import annotations

import copy
import datetime
import errno
import logging
import time

import pytest
import torch
from torch import nn

from deltackpt import Checkpointer, Shard
from dist_harness import check_ok, run_ranks
from faults import FaultStorage, HeldWrites
from helpers import assert_same_state, checkpointer_threads

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


def tracked_job(rank: int, world: int, root: str) -> dict:
    # Both ranks hold the same model and train it alike (replicas: the plan writes each once),
    # its table tracked by marks, its optimizer's state saved beside it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(10 * ROWS, 4, mode="sum", sparse=True), nn.Linear(4, 1))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    live = {"model": model, "optim": opt}

    def train(ids: list[int]) -> None:
        opt.zero_grad()
        model(torch.tensor([ids])).sum().backward()
        opt.step()

    def snapshot() -> dict:
        return {k: copy.deepcopy(v.state_dict()) for k, v in live.items()}

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deltackpt").addHandler(handler)
    ckpt = Checkpointer(root, base_every=3, chunk_bytes=64, memory_budget=1024)
    ckpt.track(model, prefix="model", optimizer=opt)
    saved = {}
    for step in range(1, 6):
        train([step, 3 * step, 20 + step])
        ckpt.save(step, live, blocking=False)
        saved[step] = snapshot()
        train(list(range(0, 10 * ROWS, 37)))  # the ranks train on at once
    ckpt.wait()
    kinds = [ckpt.store.manifest(s).kind for s in range(1, 6)]
    restored = {}
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-1.0)
        ckpt.restore(live, step)
        restored[step] = snapshot()
    ckpt.close()
    return {"saved": saved, "restored": restored, "kinds": kinds, "warnings": warnings}


def test_tracked_rows_and_optimizer_state_changed_after_the_call_do_not_reach_the_step_on_two_ranks(tmp_path):
    for r in check_ok(run_ranks(tracked_job, 2, str(tmp_path), str(tmp_path / "store"))):
        assert_same_state(r["restored"], r["saved"])
        assert r["kinds"] == ["base", "delta", "delta", "base", "delta"], r["kinds"]
        # The rank that holds a replica the other writes was told to check its prefix before.
        assert r["warnings"] == [], r["warnings"]


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


def fault_job(rank: int, world: int, root: str, action: str, failing: int = 1) -> dict:
    storage = FaultStorage(root, phase="none", rank=failing, action=action)
    ckpt = Checkpointer(storage, timeout=datetime.timedelta(seconds=6), chunk_bytes=64,
                        memory_budget=1024)
    ckpt.save(1, state(rank, world, 1))
    # In the background write of step 2, on rank ``failing``: its first fsync fails (an I/O
    # error), its data write finds the disk full, or the rank dies.
    storage.fault = (("write_chunk", failing, "raise", 1, 0) if action == "full"
                     else ("fsync", failing, action, 1, 30.0))
    if action == "full":
        storage.on_point = full_disk(storage)
    live = state(rank, world, 2)
    ckpt.save(2, live, blocking=False)
    live["table"].local.fill_(-1.0)
    outcome: dict = {}
    try:
        if action == "sigkill":
            ckpt.wait()
        else:  # the next save raises the failure before saving anything
            ckpt.save(3, state(rank, world, 3))
        outcome["raised"] = None
    except Exception as e:  # noqa: BLE001 - the test inspects it
        outcome["raised"] = type(e).__name__
        outcome["message"] = str(e)
    outcome["steps"] = ckpt.steps()
    storage.fault = ("none", -1, "raise", 1, 0)
    if action != "sigkill":
        # Step 2's changes were never committed: the next save carries them.
        info = ckpt.save(3, state(rank, world, 2))
        outcome["retry"] = info.kind, info.rows_changed > 0
        got = state(rank, world, 0)
        ckpt.restore(got, 3)
        outcome["restored"] = torch.equal(got["table"].local, state(rank, world, 2)["table"].local)
    ckpt.close()
    outcome["threads"] = sorted(t.name for t in checkpointer_threads())
    return outcome


def full_disk(storage: FaultStorage):
    """The hook of ``storage`` with its ``raise`` at a data write turned into a full disk."""
    hook = storage.on_point

    def at_point(phase: str, key: str) -> None:
        try:
            hook(phase, key)
        except OSError as e:
            raise OSError(errno.ENOSPC, "injected full disk") from e

    return at_point


@pytest.mark.parametrize("failing", [0, 1], ids=["coordinator", "other"])
@pytest.mark.parametrize("action", ["raise", "full"])
def test_a_rank_failing_in_the_background_fails_the_save_on_every_rank(tmp_path, action, failing):
    results = check_ok(run_ranks(fault_job, 2, str(tmp_path), str(tmp_path / "store"), action, failing))
    for r in results:
        assert r["raised"] == "CheckpointAborted" and r["steps"] == [1], r
        assert f"[Errno {errno.ENOSPC if action == 'full' else errno.EIO}]" in r["message"], r
        assert r["retry"] == ("delta", True) and r["restored"] and r["threads"] == [], r
    assert results[0]["message"] == results[1]["message"]  # the same failure, told alike


def test_a_rank_killed_in_the_background_fails_the_save_on_the_others(tmp_path):
    results = run_ranks(fault_job, 2, str(tmp_path), str(tmp_path / "store"), "sigkill", deadline=30)
    assert results[1] is None  # killed
    r0 = results[0]
    assert r0 is not None and r0[0] == "ok", r0
    assert r0[1]["raised"] == "CheckpointAborted" and r0[1]["steps"] == [1] and r0[1]["threads"] == []
    with Checkpointer(tmp_path / "store", create=False) as ckpt:
        assert ckpt.steps() == [1] and ckpt.verify().ok


def hung_job(rank: int, world: int, root: str) -> dict:
    storage = FaultStorage(root, phase="none", rank=1, action="sleep")
    ckpt = Checkpointer(storage, timeout=datetime.timedelta(seconds=4), chunk_bytes=64, memory_budget=1024)
    ckpt.save(1, state(rank, world, 1))
    storage.fault = ("fsync", 1, "sleep", 1, 60.0)  # rank 1's background write hangs
    ckpt.save(2, state(rank, world, 2), blocking=False)
    t0 = time.monotonic()
    try:
        ckpt.close()
        raised = None
    except Exception as e:  # noqa: BLE001 - the test inspects it
        raised = type(e).__name__
    return {"raised": raised, "seconds": time.monotonic() - t0, "steps": ckpt.store.steps(),
            "threads": sorted(t.name for t in checkpointer_threads())}


def test_close_beside_a_rank_hung_in_the_background_returns_within_the_timeout(tmp_path):
    results = run_ranks(hung_job, 2, str(tmp_path), str(tmp_path / "store"), deadline=25)
    assert results[1] is None  # still hanging in its write when the test gave up on it
    r0 = results[0]
    assert r0 is not None and r0[0] == "ok", r0
    assert r0[1]["raised"] == "CheckpointAborted" and r0[1]["steps"] == [1] and r0[1]["threads"] == [], r0
    assert r0[1]["seconds"] < 4 + 10, r0
    with Checkpointer(tmp_path / "store", create=False) as ckpt:
        assert ckpt.steps() == [1] and ckpt.verify().ok
