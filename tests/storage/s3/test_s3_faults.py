"""Faults between the checkpointer and the S3 server (a proxy on 127.0.0.1), and a writer killed
mid-save or beside compaction and GC: no partial step is ever visible, every committed step
restores bit-exactly, and nothing a record names is gone."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from maintenance_procs import run_and_kill
from s3_proxy import Fault, S3Proxy
from s3_saver import reference
from s3_server import BUCKET

from deltackpt import Checkpointer, DeltackptError
from deltackpt.ops import lease
from deltackpt.ops.gc import Retention
from deltackpt.storage import open_storage


def assert_all_committed_restore(url: str, options: dict) -> list[int]:
    with Checkpointer(url, storage_options=options, create=False) as ckpt:
        steps = ckpt.steps()
        for s in steps:
            got, want = ckpt.load(s), reference(s)
            assert got["step"] == s
            assert torch.equal(got["emb"], want["emb"]) and torch.equal(got["dense"], want["dense"]), s
        report = ckpt.verify()
        assert report.ok, report.problems
    return steps


@pytest.fixture
def proxy(s3_server):
    p = S3Proxy(s3_server.endpoint_url)
    yield p
    p.stop()


def test_saves_ride_out_throttling_errors_and_dropped_connections(s3_server, proxy):
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    options = {**s3_server.options(), "endpoint_url": proxy.endpoint_url}
    faults = [Fault("status", method="PUT", path="/steps/", status=503, skip=2, times=3),
              Fault("status", method="PUT", path="/steps/", status=500, skip=5, times=2),
              Fault("drop", method="PUT", path="/pack", times=2),
              Fault("drop", method="PUT", path="/c\\.", skip=3, times=2),
              Fault("drop_answer", method="PUT", path="/commits/", times=1),
              Fault("status", method="GET", status=503, skip=4, times=3),
              Fault("drop", method="GET", skip=9, times=2)]
    for f in faults:
        proxy.add(f)
    with Checkpointer(url, storage_options=options, base_every=3) as ckpt:
        for s in range(1, 6):
            ckpt.save(s, reference(s))
    assert assert_all_committed_restore(url, options) == [1, 2, 3, 4, 5]
    assert all(f.hits == f.skip + f.times for f in faults), [(f, f.hits) for f in faults]


def test_a_save_that_cannot_finish_fails_typed_and_leaves_no_step(s3_server, proxy):
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    options = {**s3_server.options(), "endpoint_url": proxy.endpoint_url, "retry_timeout": "2"}
    with Checkpointer(url, storage_options=options) as ckpt:
        ckpt.save(1, reference(1))
        for fault in (Fault("status", method="PUT", path="/pack", status=503, times=10**6),
                      Fault("drop", method="PUT", path="/commits/", times=10**6)):
            proxy.add(fault)
            start = time.monotonic()
            with pytest.raises(DeltackptError):
                ckpt.save(2, reference(2))
            assert time.monotonic() - start < 60
            proxy.clear()
            assert ckpt.steps() == [1]
        ckpt.save(2, reference(2))
        ckpt.save(3, reference(3))
    assert assert_all_committed_restore(url, options) == [1, 2, 3]
    with Checkpointer(url, storage_options=options, create=False) as ckpt:
        report = ckpt.gc(grace_seconds=0)
        assert len(report.deleted) >= 1  # the failed attempts' objects
    assert assert_all_committed_restore(url, options) == [1, 2, 3]


SAVER = """
import json, sys
sys.path.insert(0, {tests!r})
from s3_saver import save_forever
save_forever({url!r}, json.loads({options!r}))
"""


def kill_mid_save(s3_server, rounds: int, seed: int) -> None:
    """Kills a writer at random moments of its saves, ``rounds`` times; checks the store after
    each kill and that a new writer (taking over the lease) carries on."""
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    options = s3_server.options()
    rng = random.Random(seed)
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = SAVER.format(tests=tests, url=url, options=json.dumps(options))
    committed: list[int] = []
    for _ in range(rounds):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # the first save of this writer committed
            assert line.startswith("saved"), line
            time.sleep(rng.uniform(0.0, 1.5))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        steps = assert_all_committed_restore(url, options)
        assert steps[: len(committed)] == committed and steps == list(range(1, len(steps) + 1))
        committed = steps
    with Checkpointer(url, storage_options=options, create=False) as ckpt:
        ckpt.gc(grace_seconds=0)
    assert assert_all_committed_restore(url, options) == committed
    storage = open_storage(url, options)
    with Checkpointer(url, storage_options=options, create=False) as ckpt:
        named = {ckpt.store.manifest(s).attempt for s in committed}
    # GC keeps the folder the (dead) holder's lease names as its save in flight.
    holder = lease.read(storage)[1]
    kept = {holder.attempt} if holder is not None and holder.attempt is not None else set()
    assert named <= set(storage.list("steps")) - {"zarr.json"} <= named | kept


def test_a_writer_killed_mid_save_leaves_only_whole_steps(s3_server):
    kill_mid_save(s3_server, rounds=2, seed=0)


@pytest.mark.slow
def test_a_writer_killed_mid_save_leaves_only_whole_steps_many_times(s3_server):
    kill_mid_save(s3_server, rounds=10, seed=1)


@pytest.mark.slow
def test_maintenance_beside_a_writer_all_killed_at_random(s3_server, tmp_path):
    """A writer, a compactor, a GC and a reader, killed at random (see ``maintenance_procs``)."""
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    run_and_kill(url, s3_server.options(), tmp_path / "logs", seconds=120, seed=2)
