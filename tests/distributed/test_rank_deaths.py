"""A rank killed (SIGKILL) at each persist point of a two-rank save, and of its commit: the
surviving rank raises one typed error within the timeout, the step is whole or absent, every
committed step restores bit-exactly, ``verify`` passes, and a fresh job saves the step again."""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist

from deltackpt import Checkpointer, LocalStorage, Shard
from deltackpt.storage import FaultInjection
from dist_harness import check_ok, run_ranks

ROWS = 40
TIMEOUT = 6  # seconds of the checkpoint collectives: a dead peer is noticed within this


def state(rank: int, world: int, step: int) -> dict:
    table = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4)
    table += step * (torch.arange(ROWS) % 5 == step % 5)[:, None]
    block = ROWS // world
    return {"table": Shard(table[rank * block : (rank + 1) * block].clone(), global_shape=(ROWS, 4),
                           global_offset=(rank * block, 0)),
            "dense": torch.full((10,), float(step)), "step": step}


class KillAt(FaultInjection):
    """A local store that records every persist point of rank ``rank`` in ``log`` and kills the
    process at the ``k``-th one (never if 0), once ``armed``."""

    def __init__(self, root: str, rank: int, k: int, log: str):
        super().__init__(LocalStorage(root), self.at_point)
        self.rank, self.k, self.log = rank, k, log
        self.seen: list[str] = []
        self.armed = False
        self._lock = threading.Lock()  # points come from the I/O threads too

    def at_point(self, phase: str, key: str) -> None:
        if not self.armed or dist.get_rank() != self.rank:
            return
        with self._lock:
            self.seen.append(phase)
            with open(self.log, "w") as f:
                json.dump(self.seen, f)
            if len(self.seen) == self.k:
                os.kill(os.getpid(), signal.SIGKILL)


def job(rank: int, world: int, root: str, victim: int, k: int, log: str) -> dict:
    storage = KillAt(root, victim, k, log)
    ckpt = Checkpointer(storage, timeout=datetime.timedelta(seconds=TIMEOUT), chunk_bytes=64,
                        memory_budget=1024, take_over=True)
    ckpt.save(1, state(rank, world, 1))
    storage.armed = True
    try:
        info = ckpt.save(2, state(rank, world, 2))
        outcome = {"raised": None, "kind": info.kind}
    except Exception as e:  # noqa: BLE001 - the test inspects it
        outcome = {"raised": type(e).__name__, "msg": str(e)}
    return outcome


def resave(rank: int, world: int, root: str) -> str:
    """A fresh job after the death: restores the latest step and saves step 2 if it is absent."""
    ckpt = Checkpointer(root, timeout=datetime.timedelta(seconds=TIMEOUT), chunk_bytes=64,
                        memory_budget=1024, take_over=True)
    latest = ckpt.latest_step()
    got = state(rank, world, 0)
    ckpt.restore(got, latest)
    want = state(rank, world, latest)
    assert torch.equal(got["table"].local, want["table"].local) and got["step"] == latest
    kind = ckpt.save(2, state(rank, world, 2)).kind if latest == 1 else "present"
    ckpt.close()
    return kind


def points(tmp_path, victim: int) -> list[str]:
    """The persist points rank ``victim`` passes in step 2's save, from a run without a fault."""
    log = str(tmp_path / f"points{victim}.json")
    check_ok(run_ranks(job, 2, str(tmp_path), str(tmp_path / "clean"), victim, 0, log))
    with open(log) as f:
        return json.load(f)


def check_after_death(tmp_path, root: str, results: list, victim: int) -> None:
    assert results[victim] is None  # killed
    survivor = results[1 - victim]
    assert survivor is not None and survivor[0] == "ok", survivor
    with Checkpointer(root, create=False) as ckpt:
        steps = ckpt.steps()
        assert steps in ([1], [1, 2]), steps
        if steps == [1, 2]:
            assert survivor[1]["raised"] in (None, "CheckpointAborted"), survivor
        else:
            assert survivor[1]["raised"] == "CheckpointAborted", survivor
        for s in steps:
            loaded = ckpt.load(s)
            assert torch.equal(loaded["table"], torch.cat(
                [state(r, 2, s)["table"].local for r in range(2)])) and loaded["step"] == s
        report = ckpt.verify()
        assert report.ok, report.problems
    kinds = check_ok(run_ranks(resave, 2, str(tmp_path), root))
    assert kinds[0] == kinds[1] and kinds[0] in ("delta", "base", "present")
    with Checkpointer(root, create=False) as ckpt:
        assert ckpt.steps() == [1, 2] and ckpt.verify().ok


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1], ids=["coordinator", "rank1"])
def test_a_rank_killed_at_each_persist_point_of_a_save(tmp_path, victim):
    phases = points(tmp_path, victim)
    assert {"write_chunk", "fsync"} <= set(phases)
    if victim == 0:
        assert {"write_manifest_tmp", "rename_manifest", "fsync_dir"} <= set(phases)
    for k in range(1, len(phases) + 1):
        root = str(tmp_path / f"store-{k}")
        results = run_ranks(job, 2, str(tmp_path), root, victim, k, str(tmp_path / f"log-{k}.json"),
                            deadline=60)
        check_after_death(tmp_path, root, results, victim)


@pytest.mark.slow
def test_the_coordinator_dying_between_the_writes_and_the_commit(tmp_path):
    phases = points(tmp_path, 0)
    k = phases.index("write_manifest_tmp") + 1  # every rank has written; the record is next
    root = str(tmp_path / "store")
    results = run_ranks(job, 2, str(tmp_path), root, 0, k, str(tmp_path / "log.json"), deadline=60)
    check_after_death(tmp_path, root, results, 0)
    with Checkpointer(root, create=False) as ckpt:  # the attempt folder left behind is collected
        report = ckpt.gc(grace_seconds=0, dry_run=True)
        assert len(report.deleted) == 1 and report.deleted[0].startswith("steps/2-"), report
