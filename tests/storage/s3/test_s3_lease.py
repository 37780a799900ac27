"""The writer lease on a bucket, between real processes, on SeaweedFS and moto: the lease is taken
by a create-only ``PUT`` and renewed, published and taken over by ``If-Match`` swaps on its ETag.

A live holder fences a second writer process with a typed error; a dead holder's lease is taken
after its ttl; racers taking over a hung job's lease have exactly one winner; GC beside a holder
in the middle of a save deletes nothing that save writes or builds on."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

import lease_procs
from deltackpt import Checkpointer, WriterConflictError
from deltackpt.ops import lease
from deltackpt.storage import open_storage
from faults import state_at
from helpers import assert_same_state
from lease_procs import Pause, go, result, wait_paused

RACERS = 4


def start(target, *args, **kwargs):
    p = lease_procs.context().Process(target=target, args=args, kwargs=kwargs)
    p.start()
    return p


def wait_saved(out: str, proc) -> None:
    deadline = time.monotonic() + 120
    while not Path(out + ".saved").exists():
        assert proc.exitcode is None, f"the writer ended ({proc.exitcode}): {result(out)}"
        assert time.monotonic() < deadline, "the writer did not save"
        time.sleep(0.05)


def seed(url: str, options: dict, upto: int, **kwargs) -> None:
    with Checkpointer(url, storage_options=options, **lease_procs.SMALL, **kwargs) as ckpt:
        for step in range(1, upto + 1):
            ckpt.save(step, state_at(step))


def check_steps(url: str, options: dict, steps: list[int]) -> None:
    """The store holds exactly ``steps``, each restoring bit for bit, and no folder of data
    that no record names."""
    with Checkpointer(url, storage_options=options, create=False) as ckpt:
        assert ckpt.steps() == steps
        for step in steps:
            assert_same_state(ckpt.load(step), state_at(step), f"step {step}")
        assert ckpt.verify().ok
        named = {ckpt.store.manifest(s).attempt for s in steps}
        assert set(ckpt.store.storage.list("steps")) - {"zarr.json"} == named
    assert lease.read(open_storage(url, options)) == (None, None)  # released at close


def test_a_live_holder_fences_a_second_writer_process(s3_url, s3_options, tmp_path):
    out, second_out = str(tmp_path / "holder.json"), str(tmp_path / "second.json")
    # A ttl that a renewal under load meets: the second writer watches the lease for one ttl.
    holder = start(lease_procs.save_steps, s3_url, [1], out, ttl=6.0, then_sleep=60.0,
                   storage_options=s3_options)
    try:
        wait_saved(out, holder)
        storage = open_storage(s3_url, s3_options)
        first = lease.read(storage)[1]
        assert first is not None and first.holder.startswith(f"{socket.gethostname()}:{holder.pid}:")
        t0 = time.monotonic()
        second = start(lease_procs.save_steps, s3_url, [2], second_out, ttl=1.5,
                       storage_options=s3_options)
        second.join(120)
        got = result(second_out)
        assert got["error"] == "WriterConflictError", got
        assert f"another writer holds {s3_url}: {first.holder}" in got["message"], got
        assert time.monotonic() - t0 < 30  # one renewal seen, not a wait for the ttl to pass
        renewed = lease.read(storage)[1]
        assert (renewed.holder, renewed.epoch) == (first.holder, first.epoch)
        assert renewed.renewed > first.renewed  # by If-Match swaps on the lease's ETag
    finally:
        holder.kill()
        holder.join()
    with Checkpointer(s3_url, storage_options=s3_options, **lease_procs.SMALL) as ckpt:
        # Its holder died on this host: taken at once, with the next epoch.
        ckpt.restore(state_at(1))
        assert ckpt.save(2, state_at(2)).kind == "delta"
        assert lease.read(ckpt.store.storage)[1].epoch == first.epoch + 1
    check_steps(s3_url, s3_options, [1, 2])


def test_the_lease_of_a_job_killed_elsewhere_is_taken_after_its_ttl(s3_url, s3_options, tmp_path):
    out = str(tmp_path / "dead.json")
    dead = start(lease_procs.save_steps, s3_url, [1, 2], out, ttl=2.0, then_sleep=60.0,
                 host="elsewhere", storage_options=s3_options)
    wait_saved(out, dead)
    dead.kill()
    dead.join()
    left = lease.read(open_storage(s3_url, s3_options))[1]
    assert left is not None and left.holder.startswith("elsewhere:")
    with Checkpointer(s3_url, storage_options=s3_options, **lease_procs.SMALL) as ckpt:
        ckpt.restore(state_at(2))
        assert ckpt.save(3, state_at(3)).kind == "delta"
        taken = lease.read(ckpt.store.storage)[1]
        assert taken.epoch == left.epoch + 1 and taken.holder != left.holder
    # Not before it expired: watched for a ttl with no renewal, or found it expired by the clock.
    assert taken.since >= left.renewed + left.ttl
    check_steps(s3_url, s3_options, [1, 2, 3])


def test_take_over_race_has_one_winner_and_fences_the_hung_job(s3_url, s3_options, tmp_path):
    hung = Checkpointer(s3_url, storage_options=s3_options, **lease_procs.SMALL)
    hung.save(1, state_at(1))  # holds the lease, renewed by its thread
    lease_procs.take_over_race(s3_url, RACERS, tmp_path, 2, s3_options)
    with pytest.raises(WriterConflictError, match="taken over"):
        hung.save(3, state_at(3))
    hung.close()
    check_steps(s3_url, s3_options, [1, 2])


def test_gc_beside_a_holder_keeps_its_head_and_its_save_in_flight(s3_url, s3_options, tmp_path):
    ctl, out, gc_out = str(tmp_path), str(tmp_path / "w.json"), str(tmp_path / "gc.json")
    seed(s3_url, s3_options, 6, base_every=3)  # bases at 1 and 4
    writer = start(lease_procs.save_steps, s3_url, [7], out, restore=2,
                   pause=Pause(ctl, "w", "write_chunk", "steps/"), storage_options=s3_options)
    wait_paused(ctl, "w", writer)  # holds the lease; its delta on step 2 is being written
    gc = start(lease_procs.gc_job, s3_url, 2, gc_out, storage_options=s3_options)
    gc.join(120)
    report = result(gc_out)["ok"]
    assert report["dropped_steps"] == [3]
    assert not [p for p in report["deleted"] if p.startswith("steps/7-")]
    go(ctl, "w")
    writer.join(120)
    assert result(out)["ok"]["7"][0] == "delta"
    check_steps(s3_url, s3_options, [1, 2, 4, 5, 6, 7])
