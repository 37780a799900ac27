"""The writer lease between real processes: a take-over race has one winner and typed losers, a
writer fenced around its commit leaves nothing the new holder builds on wrongly, a killed or
never-closed job does not block the next one, and two live writers stay fenced."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lease_procs
from deltackpt import Checkpointer, StepExistsError, WriterConflictError
from deltackpt.ops import lease
from deltackpt.storage import open_storage
from faults import state_at
from helpers import assert_same_state
from hostile import exit_code, python
from lease_procs import Pause, go, result, wait_paused

RACERS = 8


def seed(path, upto: int) -> None:
    with Checkpointer(path, **lease_procs.SMALL) as ckpt:
        for step in range(1, upto + 1):
            ckpt.save(step, state_at(step))


def check_steps(path, steps: list[int]) -> None:
    """The store holds exactly ``steps``, each restoring to its state bit for bit."""
    with Checkpointer(path, create=False) as ckpt:
        assert ckpt.steps() == steps
        for step in steps:
            assert_same_state(ckpt.load(step), state_at(step), f"step {step}")
        report = ckpt.verify()
        assert report.ok, report


def take_over_race(tmp_path, run: int) -> None:
    path = str(tmp_path / f"race{run}")
    hung = Checkpointer(path, **lease_procs.SMALL)  # the job whose lease they all take over
    hung.save(1, state_at(1))
    folder = tmp_path / f"race{run}.out"
    folder.mkdir()
    lease_procs.take_over_race(path, RACERS, folder, 2)
    with pytest.raises(WriterConflictError, match="taken over"):
        hung.save(3, state_at(3))
    hung.close()
    check_steps(path, [1, 2])


def test_take_over_race_has_one_winner_and_typed_losers(tmp_path):
    for run in range(2):
        take_over_race(tmp_path, run)


@pytest.mark.slow
def test_take_over_race_20_runs(tmp_path):
    for run in range(20):
        take_over_race(tmp_path, run)


def start(target, *args, **kwargs):
    p = lease_procs.context().Process(target=target, args=args, kwargs=kwargs)
    p.start()
    return p


def test_writer_fenced_before_its_record_exists_commits_nothing(tmp_path):
    path, ctl, out = str(tmp_path / "s"), str(tmp_path), str(tmp_path / "old.json")
    seed(path, 4)
    old = start(lease_procs.save_steps, path, [5], out,
                pause=Pause(ctl, "old", "write_manifest_tmp", "commits/"))
    wait_paused(ctl, "old", old)  # its lease check passed; its record does not exist yet
    with Checkpointer(path, take_over=True, **lease_procs.SMALL) as new:
        new.restore(state_at(4))
        assert new.save(5, state_at(5)).kind == "delta"
        go(ctl, "old")
        old.join(120)
        assert result(out)["error"] == "WriterConflictError"
        assert new.save(6, state_at(6)).kind == "delta"
        assert new.store.manifest(6).parent == 5
    check_steps(path, [1, 2, 3, 4, 5, 6])


def test_record_of_a_fenced_writer_is_withdrawn_and_the_new_holder_rebases(tmp_path):
    path, ctl, out = str(tmp_path / "s"), str(tmp_path), str(tmp_path / "old.json")
    seed(path, 4)
    old = start(lease_procs.save_steps, path, [5], out,
                pause=Pause(ctl, "old", "fsync_dir", "/s/commits"))
    wait_paused(ctl, "old", old)  # its record of step 5 exists; its re-check has not run
    with Checkpointer(path, take_over=True, **lease_procs.SMALL) as new:
        assert new.restore(state_at(0)) == 5  # builds on the fenced writer's step
        new.save(6, state_at(6))  # takes the lease over
        assert new.store.manifest(6).parent == 5
        go(ctl, "old")
        old.join(120)
        # The new holder built on step 5, so the fenced writer leaves it.
        assert result(out)["error"] == "WriterConflictError"
    check_steps(path, [1, 2, 3, 4, 5, 6])


def test_withdrawn_record_is_not_built_on(tmp_path):
    path, ctl, out = str(tmp_path / "s"), str(tmp_path), str(tmp_path / "old.json")
    seed(path, 4)
    old = start(lease_procs.save_steps, path, [5], out,
                pause=Pause(ctl, "old", "fsync_dir", "/s/commits"))
    wait_paused(ctl, "old", old)
    with Checkpointer(path, take_over=True, **lease_procs.SMALL) as new:
        assert new.restore(state_at(0)) == 5
        # Takes the lease over, then finds step 5 committed: nothing published builds on it.
        with pytest.raises(StepExistsError):
            new.save(5, state_at(5))
        go(ctl, "old")
        old.join(120)
        assert result(out)["error"] == "WriterConflictError"
        assert new.steps() == [1, 2, 3, 4]  # withdrawn: the new holder had not built on it
        info = new.save(6, state_at(6))
        assert info.kind == "base" and "step 5" in info.reason, info
    check_steps(path, [1, 2, 3, 4, 6])


def test_record_withdrawn_as_the_new_holder_takes_it_as_its_head_is_put_back(tmp_path):
    path, ctl = str(tmp_path / "s"), str(tmp_path)
    old_out, new_out = str(tmp_path / "old.json"), str(tmp_path / "new.json")
    seed(path, 4)
    old = start(lease_procs.save_steps, path, [5], old_out,
                pause=[Pause(ctl, "old", "fsync_dir", "/s/commits"),
                       Pause(ctl, "old-delete", "gc_delete", "commits/")])
    wait_paused(ctl, "old", old)  # its record of step 5 exists
    # A save's first lease write names its head, but one of a committed step takes the lease
    # before it reports the step, naming none: then step 6 publishes head 5.
    new = start(lease_procs.save_steps, path, [6], new_out, take_over=True, committed=5,
                pause=[Pause(ctl, "new-publish", "swap", nth=2),
                       Pause(ctl, "new-write", "write_chunk", "steps/")])
    wait_paused(ctl, "new-publish", new)  # took the lease over, restored 5, publishes it next
    go(ctl, "old")
    wait_paused(ctl, "old-delete", old)  # fenced; the new lease named no head yet: removes 5
    go(ctl, "new-publish")
    wait_paused(ctl, "new-write", new)  # published head 5 and found it there
    go(ctl, "old-delete")
    old.join(120)
    assert result(old_out)["error"] == "WriterConflictError"
    go(ctl, "new-write")
    new.join(120)
    assert result(new_out)["ok"]["5"][0] == "exists"
    assert result(new_out)["ok"]["6"][0] == "delta"  # on step 5, put back
    check_steps(path, [1, 2, 3, 4, 5, 6])


def test_writer_killed_after_creating_its_record_leaves_a_whole_step(tmp_path):
    path, ctl, out = str(tmp_path / "s"), str(tmp_path), str(tmp_path / "old.json")
    seed(path, 4)
    old = start(lease_procs.save_steps, path, [5], out,
                pause=Pause(ctl, "old", "fsync_dir", "/s/commits", kill=True))
    old.join(120)
    assert old.exitcode == -9
    with Checkpointer(path, **lease_procs.SMALL) as new:  # dead holder on this host: no take_over
        assert new.restore(state_at(0)) == 5
        assert new.save(6, state_at(6)).kind == "delta"
    check_steps(path, [1, 2, 3, 4, 5, 6])


def test_two_live_writers_stay_fenced(tmp_path):
    path, out = str(tmp_path / "s"), str(tmp_path / "holder.json")
    # A ttl that a renewal under load meets: the second writer watches the lease for one ttl.
    holder = start(lease_procs.save_steps, path, [1], out, ttl=4.0, then_sleep=30.0)
    while not Path(out + ".saved").exists():
        assert holder.exitcode is None
        time.sleep(0.05)
    t0 = time.monotonic()
    with Checkpointer(path, lease_ttl=1.5, **lease_procs.SMALL) as second:
        held_by = f"another writer holds .*{socket.gethostname()}:{holder.pid}:"
        with pytest.raises(WriterConflictError, match=held_by):
            second.save(2, state_at(2))
        # It waited for one renewal of the live holder's lease, not for the lease to expire.
        assert time.monotonic() - t0 < 10
    holder.kill()
    holder.join()


def test_lease_of_a_dead_job_elsewhere_frees_after_its_ttl(tmp_path):
    path = str(tmp_path / "s")
    seed(path, 1)
    now = time.time()
    dead = lease.Lease("elsewhere:4242:abcd", 3, now - 5, now, 1.0)
    Path(path, "writer.lease").write_bytes(dead.to_json())
    t0 = time.monotonic()
    with Checkpointer(path, **lease_procs.SMALL) as ckpt:
        ckpt.restore(state_at(1))
        ckpt.save(2, state_at(2))
        assert lease.read(ckpt.store.storage)[1].epoch == 4
    assert time.monotonic() - t0 >= 1.0  # watched one ttl: no renewal came
    stale = lease.Lease("elsewhere:4242:abcd", 7, now - 100, now - 60, 30.0)
    Path(path, "writer.lease").write_bytes(stale.to_json())
    with Checkpointer(path, **lease_procs.SMALL) as ckpt:  # expired by the clock: at once
        ckpt.restore(state_at(2))
        ckpt.save(3, state_at(3))
    check_steps(path, [1, 2, 3])


def test_never_closed_checkpointer_does_not_block_the_next_run(tmp_path):
    path = str(tmp_path / "s")
    script = ("import sys, torch, deltackpt\n"
              "ckpt = deltackpt.Checkpointer(sys.argv[1])\n"
              "ckpt.save(1, {'t': torch.arange(6.0)})\n")  # and exits without close()
    subprocess.run([sys.executable, "-c", script, path], check=True, timeout=300)
    assert not Path(path, "writer.lease").exists()
    with Checkpointer(path) as ckpt:
        ckpt.save(2, {"t": torch.arange(6.0) + 1})
        assert ckpt.steps() == [1, 2]


def test_garbage_lease_is_replaced_only_with_take_over(tmp_path):
    path = str(tmp_path / "s")
    seed(path, 1)
    for garbage in (b"", b"\x00\xff not json", json.dumps({"holder": "x"}).encode(), b"[1, 2]"):
        Path(path, "writer.lease").write_bytes(garbage)
        with Checkpointer(path, **lease_procs.SMALL) as ckpt:
            with pytest.raises(WriterConflictError, match="writer.lease is unreadable"):
                ckpt.save(2, state_at(2))
        with Checkpointer(path, take_over=True, **lease_procs.SMALL) as ckpt:
            ckpt.restore(state_at(1))
            ckpt.save(2, state_at(2))
            assert lease.read(ckpt.store.storage)[1].epoch == 1
        with Checkpointer(path, create=False) as ckpt:
            assert ckpt.steps() == [1, 2]
        os.remove(Path(path, "commits", f"{2:020d}.json"))


@pytest.mark.parametrize("ttl", [1e300, 3601.0, 0.0, -1.0])
def test_lease_with_a_ttl_out_of_range_is_unreadable(tmp_path, ttl):
    """A live-looking lease from another host is watched for its ttl: one claiming more than
    an hour (damaged or hostile) would hold the next save for that long, and one of no time
    makes no sense. Either is unreadable: the save fails at once, and take_over replaces it."""
    path = str(tmp_path / "s")
    seed(path, 1)
    now = time.time()
    doc = {"holder": "elsewhere:4242:abcd", "epoch": 3, "since": now, "renewed": now, "ttl": ttl}
    Path(path, "writer.lease").write_text(json.dumps(doc))
    assert lease.read(open_storage(path))[1] is None
    code = ("import time, torch\n"
            "from deltackpt import Checkpointer, WriterConflictError\n"
            f"ckpt = Checkpointer({path!r})\n"
            "t0 = time.monotonic()\n"
            "try:\n"
            "    ckpt.save(2, {'t': torch.zeros(3)})\n"
            "except WriterConflictError as e:\n"
            "    print(round(time.monotonic() - t0), e)\n"
            "ckpt.close()\n")
    proc = python(code, timeout=60)  # a hang fails the test
    assert exit_code(proc) == 0, proc.stderr[-2000:]
    seconds, message = proc.stdout.split(" ", 1)
    assert int(seconds) < 5 and "writer.lease is unreadable" in message, proc.stdout
    with Checkpointer(path, take_over=True, **lease_procs.SMALL) as ckpt:
        ckpt.restore(state_at(1))
        ckpt.save(2, state_at(2))
    check_steps(path, [1, 2])
