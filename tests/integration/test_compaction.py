"""Compaction and GC: bit-exact restores around them, forced interleavings with a training job,
crashes at every persist point, a damaged chain, several ranks."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time

import pytest
import torch

import faults
from deltackpt import Checkpointer, IntegrityError, LocalStorage, MissingChunkError, StoreError
from deltackpt.ops import lease
from deltackpt.ops.gc import Retention, collect, holder_chain
from deltackpt.storage import FaultInjection
from dist_harness import by_file, call, check_ok, run_ranks
from helpers import assert_same_state
from hostile import cli, one_line_error, read_record


def history(path, steps: range, **kwargs) -> None:
    """Saves ``faults.state_at(s)`` for each step (a delta chain after one base)."""
    with Checkpointer(path, base_every=1000, chunk_bytes=1024, memory_budget=8192,
                      take_over=True, **kwargs) as ckpt:
        latest = ckpt.latest_step()
        if latest is not None:
            ckpt.restore(faults.state_at(latest), latest)
        for s in steps:
            ckpt.save(s, faults.state_at(s))


def check_all(path, steps) -> None:
    with Checkpointer(path, create=False) as ckpt:
        assert ckpt.steps() == list(steps)
        for s in steps:
            assert_same_state(ckpt.load(s), faults.state_at(s))
        assert ckpt.verify().ok


def test_compaction_shortens_the_chain_and_is_idempotent(tmp_path):
    path = tmp_path / "store"
    history(path, range(1, 9))
    with Checkpointer(path, create=False) as ckpt:
        assert len(ckpt.store.chain(8)) == 8
        info = ckpt.compact(6)
        assert info.done and info.chain_length == 6
        assert [m.step for m in ckpt.store.chain(8)] == [6, 7, 8]
        assert ckpt.store.chain(6)[0].compacts == ckpt.store.manifest(6).attempt
        assert not ckpt.compact(6).done  # idempotent
    check_all(path, range(1, 9))
    # Saves after a restore keep extending the same chain.
    history(path, range(9, 11))
    with Checkpointer(path, create=False) as ckpt:
        assert [m.step for m in ckpt.store.chain(10)] == [6, 7, 8, 9, 10]
    check_all(path, range(1, 11))


def test_a_job_resumed_from_a_compacted_step_builds_on_its_new_base(tmp_path):
    """``compact()`` folds the latest step; a job that restores that step replays the new base
    alone, and its deltas name that base as their parent. Their chains stop there: for restores,
    for GC (the retained chains and the lease holder's) and for a later compaction."""
    path = tmp_path / "store"
    history(path, range(1, 6))
    with Checkpointer(path, create=False) as ckpt:
        assert ckpt.compact().step == 5
    history(path, range(6, 8))
    with Checkpointer(path, create=False) as ckpt:
        chain = ckpt.store.chain(7)
        assert [m.step for m in chain] == [5, 6, 7] and chain[0].compacts is not None
        six = ckpt.store.manifest(6)
        assert six.parent_attempt == chain[0].attempt
        holder = lease.Lease("h", 1, 0.0, 0.0, 30.0, head=(6, six.attempt))
        assert [m.attempt for m in holder_chain(ckpt.store, holder)] == [chain[0].attempt, six.attempt]
    check_all(path, range(1, 8))
    with Checkpointer(path, create=False) as ckpt:
        report = ckpt.gc(Retention(keep_last=2), grace_seconds=0)
        assert report.dropped_steps == [1, 2, 3, 4, 5]
        assert ckpt.compact().step == 7
    history(path, range(8, 9))
    with Checkpointer(path, create=False) as ckpt:
        assert [m.step for m in ckpt.store.chain(8)] == [7, 8]
    check_all(path, [6, 7, 8])


def maintenance_after_resolving(monkeypatch, ckpt: Checkpointer, path, upto: int) -> list:
    """Makes ``ckpt``'s next chain resolution be followed, before its reads, by another process's
    maintenance two hours after the saves: compact ``upto``, GC keeping only the newest step
    under the default grace period. Returns the GC reports (one, once it ran)."""
    resolve, reports = ckpt.store.chain, []

    def then_maintenance(step: int):
        found = resolve(step)
        if not reports:
            with Checkpointer(path, create=False) as other:
                assert other.compact(upto).done
                reports.append(collect(other.store, Retention(keep_last=1), now=time.time() + 7200))
        return found

    monkeypatch.setattr(ckpt.store, "chain", then_maintenance)
    return reports


def test_a_load_whose_chain_is_compacted_and_collected_meanwhile_reads_the_new_base(tmp_path, monkeypatch):
    path = tmp_path / "store"
    history(path, range(1, 7))
    with Checkpointer(path, create=False) as ckpt:
        reports = maintenance_after_resolving(monkeypatch, ckpt, path, 6)
        assert_same_state(ckpt.load(6), faults.state_at(6))
        assert reports[0].dropped_steps == [1, 2, 3, 4, 5]
        assert len(reports[0].deleted) == 5  # the folders of the chain resolved first
        assert [m.compacts is not None for m in ckpt.store.chain(6)] == [True]


def test_a_restore_whose_chain_is_compacted_and_collected_meanwhile_reads_the_new_base(tmp_path, monkeypatch):
    """The job goes on from the new base: its next delta names it as its parent."""
    path = tmp_path / "store"
    history(path, range(1, 7))
    with Checkpointer(path, create=False, base_every=1000, chunk_bytes=1024, memory_budget=8192) as ckpt:
        reports = maintenance_after_resolving(monkeypatch, ckpt, path, 6)
        state = faults.state_at(1)
        assert ckpt.restore(state, 6) == 6
        assert len(reports[0].deleted) == 5
        assert_same_state(state, faults.state_at(6))
        assert ckpt.save(7, faults.state_at(7)).kind == "delta"
        monkeypatch.undo()
        assert ckpt.store.manifest(7).parent_attempt == ckpt.store.chain(6)[0].attempt
    check_all(path, [6, 7])


def test_a_damaged_chain_is_read_once_and_its_error_raised(tmp_path, monkeypatch):
    """A chunk gone with no compaction: the chain resolves the same again, nothing is retried."""
    path = tmp_path / "store"
    history(path, range(1, 4))
    with Checkpointer(path, create=False) as ckpt:
        first = ckpt.store.manifest(1).attempt
        shutil.rmtree(path / "steps" / first / "table")
        resolve, resolved = ckpt.store.chain, []
        monkeypatch.setattr(ckpt.store, "chain", lambda step: resolved.append(step) or resolve(step))
        with pytest.raises(MissingChunkError):
            ckpt.load(3)
        assert resolved == [3, 3]  # resolved again, found the same, and raised


def test_compaction_of_a_damaged_chain_fails_and_commits_nothing(tmp_path):
    """The chain's last small tensor is damaged: its read fails once the new base's pack holds
    the tensors before it, and the pack's write must end with the failure, not wait for more."""
    path = tmp_path / "store"

    def state(s):
        table = torch.arange(4096.0).view(512, 8)
        table[s] += 1
        return {"table": table, "a": torch.full((10,), float(s)), "z": torch.full((12,), float(s))}

    with Checkpointer(path, base_every=1000, chunk_bytes=1024, memory_budget=8192) as ckpt:
        for s in range(3):
            ckpt.save(s, state(s))
    doc = read_record(path, 2)
    [part] = doc["tensors"]["z"]["parts"]
    pack = path / "steps" / doc["attempt"] / part["pack"] / "c.0"
    data = bytearray(pack.read_bytes())
    data[part["chunks"]["c.0"][2]] ^= 1
    pack.write_bytes(bytes(data))
    assert "/z/c.0 " in one_line_error(cli("compact", str(path), "--upto", "2"))
    with Checkpointer(path, create=False) as ckpt:
        with pytest.raises(IntegrityError, match="/z/c.0 "):
            ckpt.compact(2)
        assert ckpt.store.compacted(2) is None
        assert_same_state(ckpt.load(1), state(1))


class HookStorage(FaultInjection):
    """A local store that runs ``hook`` once, at the first persist point of ``phase``."""

    def __init__(self, root, phase, hook):
        super().__init__(LocalStorage(root), self.at_point)
        self.phase, self.hook = phase, hook

    def at_point(self, phase, key):
        if phase == self.phase and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()


def test_compaction_while_training_saves(tmp_path):
    path = str(tmp_path / "store")
    history(path, range(1, 6))
    trainer = Checkpointer(path, base_every=1000, chunk_bytes=1024, memory_budget=8192)
    trainer.restore(faults.state_at(5), 5)

    def train_two_steps():  # after compaction read the chain, before it commits
        for s in (6, 7):
            assert trainer.save(s, faults.state_at(s)).kind == "delta"

    with Checkpointer(HookStorage(path, "compact_commit", train_two_steps), create=False) as job:
        assert job.compact(5).done
        report = job.gc(Retention(keep_last=3), grace_seconds=0)
    assert report.dropped_steps == [1, 2, 3, 4]
    trainer.save(8, faults.state_at(8))
    trainer.close()
    check_all(path, [5, 6, 7, 8])
    with Checkpointer(path, create=False) as ckpt:
        assert [m.step for m in ckpt.store.chain(8)] == [5, 6, 7, 8]


def test_a_compaction_whose_folder_a_gc_took_commits_nothing(tmp_path):
    path = str(tmp_path / "store")
    history(path, range(1, 7))

    def gc_elsewhere():  # a GC that finds the folder of a compaction stalled past its grace
        with Checkpointer(path, create=False) as other:
            assert other.gc(Retention(), grace_seconds=0).deleted

    with Checkpointer(HookStorage(path, "compact_commit", gc_elsewhere), create=False) as job:
        with pytest.raises(StoreError, match="compaction of step 5: .* went while it ran.*nothing"):
            job.compact(5)
        assert job.store.compacted(5) is None
    check_all(path, range(1, 7))
    with Checkpointer(path, create=False) as ckpt:  # and a compaction run again completes
        assert ckpt.compact(5).done
    check_all(path, range(1, 7))


def compact_job(path: str, crash_at: int) -> None:
    storage = faults.CrashingStorage(path, crash_at)
    with Checkpointer(storage, create=False) as ckpt:
        ckpt.compact(6)
        ckpt.gc(Retention(keep_last=2), grace_seconds=0)


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_crash_in_compaction_and_gc(tmp_path, every):
    path = str(tmp_path / "store")
    history(path, range(1, 9))
    probe = str(tmp_path / "probe")
    shutil.copytree(path, probe)
    storage = faults.CrashingStorage(probe)
    with Checkpointer(storage, create=False) as ckpt:
        ckpt.compact(6)
        ckpt.gc(Retention(keep_last=2), grace_seconds=0)
    phases = storage.phases
    assert {"compact_commit", "write_chunk", "gc_delete"} <= set(phases)
    points = range(1, len(phases) + 1) if every else sorted(
        {i + 1 for i, p in enumerate(phases) if p != phases[i - 1]} | {len(phases)})
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numba", "deltackpt", "faults"])
    for k in points:
        # Every crash point starts from the same store.
        run = str(tmp_path / f"run{k}")
        shutil.copytree(path, run)
        p = ctx.Process(target=call, args=(by_file(compact_job), run, k))
        p.start()
        p.join(120)
        assert p.exitcode == 137, (k, p.exitcode)
        with Checkpointer(run, create=False) as ckpt:
            steps = ckpt.steps()
            assert steps[-2:] == [7, 8]  # the retained steps always restore
            for s in steps:
                assert_same_state(ckpt.load(s), faults.state_at(s))
        compact_job(run, 0)  # rerunning finishes the job
        check_all(run, [7, 8])
        with Checkpointer(run, create=False) as ckpt:
            assert [m.step for m in ckpt.store.chain(8)] == [6, 7, 8]
            assert sorted(os.listdir(os.path.join(run, "steps"))) == sorted(
                ["zarr.json", ckpt.store.compacted(6).attempt, ckpt.store.manifest(7).attempt,
                 ckpt.store.manifest(8).attempt])
        shutil.rmtree(run)


def ranks_compact(rank: int, world: int, path: str) -> list[int]:
    with Checkpointer(path, create=False, chunk_bytes=64, memory_budget=1024) as ckpt:
        info = ckpt.compact()
        m = ckpt.store.compacted(info.step)
        return sorted({len(p.chunks) for p in m.tensors["table"].parts})


def ranks_resume(rank: int, world: int, path: str) -> list[str]:
    with Checkpointer(path, create=False, chunk_bytes=64, memory_budget=1024) as ckpt:
        assert ckpt.restore(faults.state_at(4)) == 4
        return [ckpt.save(s, faults.state_at(s)).kind for s in (5, 6)]


def test_compaction_spread_over_ranks(tmp_path):
    """Compacted on 2 ranks; then resumed from the new base on 3, with deltas."""
    path = str(tmp_path / "store")
    history(path, range(1, 5))
    results = check_ok(run_ranks(ranks_compact, 2, str(tmp_path), path))
    assert results[0] == results[1]
    check_all(path, range(1, 5))
    with Checkpointer(path, create=False) as ckpt:
        assert [m.step for m in ckpt.store.chain(4)] == [4]
    assert check_ok(run_ranks(ranks_resume, 3, str(tmp_path), path)) == [["delta", "delta"]] * 3
    check_all(path, range(1, 7))
    with Checkpointer(path, create=False) as ckpt:
        assert [m.step for m in ckpt.store.chain(6)] == [4, 5, 6]
        assert ckpt.store.manifest(6).world_size == 3
