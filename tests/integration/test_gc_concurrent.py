"""GC beside a live writer, as real processes: a job that restored an older step and saves
deltas on it never commits a delta whose parent GC removed, and its save in flight keeps its
folder whatever the grace period."""

from __future__ import annotations

import os

from deltackpt import Checkpointer
from faults import state_at
from helpers import assert_same_state
import lease_procs
from lease_procs import Pause, go, result, wait_paused


def seed(path) -> None:
    """Steps 1-6: bases at 1 and 4, so GC keeping the newest two drops 1, 2 and 3."""
    with Checkpointer(path, base_every=3, **lease_procs.SMALL) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, state_at(step))


def check(path, steps: list[int]) -> None:
    with Checkpointer(path, create=False) as ckpt:
        assert ckpt.steps() == steps
        for step in steps:
            assert_same_state(ckpt.load(step), state_at(step), f"step {step}")
        assert ckpt.verify().ok
        referenced = {ckpt.store.manifest(s).attempt for s in steps}
        assert set(os.listdir(os.path.join(path, "steps"))) - {"zarr.json"} == referenced


def start(target, *args, **kwargs):
    p = lease_procs.context().Process(target=target, args=args, kwargs=kwargs)
    p.start()
    return p


def test_parent_removed_before_the_save_makes_it_a_base(tmp_path):
    path, ctl, out = str(tmp_path / "s"), str(tmp_path), str(tmp_path / "w.json")
    seed(path)
    writer = start(lease_procs.save_steps, path, [7], out, restore=2,
                   pause=Pause(ctl, "w", "plan_local"))
    wait_paused(ctl, "w", writer)  # restored step 2, not saving yet
    gc = start(lease_procs.gc_job, path, 2, str(tmp_path / "gc.json"))
    gc.join(120)
    assert result(str(tmp_path / "gc.json"))["ok"]["dropped_steps"] == [1, 2, 3]
    go(ctl, "w")
    writer.join(120)
    kind, reason = result(out)["ok"]["7"]
    assert kind == "base" and "step 2" in reason
    check(path, [4, 5, 6, 7])


def test_gc_keeps_the_head_and_the_folder_of_a_save_in_flight(tmp_path):
    path, ctl, out = str(tmp_path / "s"), str(tmp_path), str(tmp_path / "w.json")
    seed(path)
    writer = start(lease_procs.save_steps, path, [7], out, restore=2,
                   pause=Pause(ctl, "w", "write_chunk", "steps/"))
    wait_paused(ctl, "w", writer)  # its save of step 7 on step 2 is writing
    gc = start(lease_procs.gc_job, path, 2, str(tmp_path / "gc.json"))
    gc.join(120)
    report = result(str(tmp_path / "gc.json"))["ok"]
    assert report["dropped_steps"] == [3]
    assert not [p for p in report["deleted"] if p.startswith("steps/7-")]
    go(ctl, "w")
    writer.join(120)
    assert result(out)["ok"]["7"][0] == "delta"
    check(path, [1, 2, 4, 5, 6, 7])
    with Checkpointer(path) as ckpt:  # and later collections find nothing broken
        assert ckpt.gc(grace_seconds=0).dropped_steps == []


def test_gc_puts_back_the_head_it_deleted_under_a_writer(tmp_path):
    path, ctl, out = str(tmp_path / "s"), str(tmp_path), str(tmp_path / "w.json")
    seed(path)
    gc_out = str(tmp_path / "gc.json")
    gc = start(lease_procs.gc_job, path, 2, gc_out, pause=Pause(ctl, "gc", "gc_delete", "commits/"))
    wait_paused(ctl, "gc", gc)  # it chose to drop 1, 2 and 3 and deletes next
    writer = start(lease_procs.save_steps, path, [7], out, restore=2,
                   pause=Pause(ctl, "w", "write_chunk", "steps/"))
    wait_paused(ctl, "w", writer)  # published its head (step 2) and found it there
    go(ctl, "gc")
    gc.join(120)
    assert result(gc_out)["ok"]["dropped_steps"] == [3]
    go(ctl, "w")
    writer.join(120)
    assert result(out)["ok"]["7"][0] == "delta"
    check(path, [1, 2, 4, 5, 6, 7])
