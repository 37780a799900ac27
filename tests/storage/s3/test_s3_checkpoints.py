"""Checkpoints in a bucket: save, restore, compact, GC and verify through ``s3://`` URLs, on
SeaweedFS and moto, from Python and from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from s3_server import BUCKET

from deltackpt import Checkpointer
from deltackpt.ops.gc import Retention
from deltackpt.cli import main
from deltackpt.storage import open_storage


def reference(step: int) -> dict:
    """The state at ``step``: a table with a few rows changed per step, dense parts, a value."""
    gen = torch.Generator().manual_seed(0)
    state = {"emb": torch.randn(3000, 16, generator=gen),
             "acc": torch.zeros(3000, dtype=torch.float64),
             "bf": torch.randn(50, 8, generator=gen).to(torch.bfloat16),
             "dense": torch.randn(2000, generator=gen),
             "count": torch.zeros((), dtype=torch.int64)}
    for s in range(1, step + 1):
        ids = torch.randint(0, 3000, (30,), generator=gen)
        state["emb"][ids] += 0.25
        state["acc"][ids] += 1.0
        state["bf"][s % 50] += 1
        state["count"] += 1
        if s % 3 == 0:
            state["dense"][:100] *= 2
    return {"tensors": state, "step": step}


def assert_exact(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    assert sorted(got["tensors"]) == sorted(want["tensors"])
    for k, t in want["tensors"].items():
        g = got["tensors"][k]
        assert g.dtype == t.dtype and g.shape == t.shape, k
        assert torch.equal(g.view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8)), k


def test_save_restore_compact_gc_verify(s3_url, s3_options):
    with Checkpointer(s3_url, storage_options=s3_options, base_every=3) as ckpt:
        kinds = [ckpt.save(s, reference(s)).kind for s in range(1, 8)]
    assert kinds == ["base", "delta", "delta", "base", "delta", "delta", "base"]
    with Checkpointer(s3_url, storage_options=s3_options, create=False) as ckpt:
        assert ckpt.steps() == list(range(1, 8))
        for s in (1, 3, 6, 7):
            assert_exact(ckpt.load(s), reference(s))
        target = reference(0)
        assert ckpt.restore(target, 5) == 5
        assert_exact(target, reference(5))
        report = ckpt.verify()
        assert report.ok and report.steps == list(range(1, 8))
        info = ckpt.compact(6)
        assert info.done and info.chain_length == 3
        gc = ckpt.gc(Retention(keep_last=1), grace_seconds=0)
        assert gc.dropped_steps == [1, 2, 3, 4, 5, 6]
        assert ckpt.steps() == [7]
        assert_exact(ckpt.load(7), reference(7))
        assert ckpt.verify().ok
    # Nothing but the retained step's data is left.
    storage = open_storage(s3_url, s3_options)
    attempts = [a for a in storage.list("steps") if a != "zarr.json"]
    assert len(attempts) == 1 and attempts[0].startswith("7-")


def test_a_verify_finds_a_damaged_or_missing_object(s3_url, s3_options):
    with Checkpointer(s3_url, storage_options=s3_options) as ckpt:
        ckpt.save(1, reference(1))
        ckpt.save(2, reference(2))
        m = ckpt.store.manifest(2)
    storage = open_storage(s3_url, s3_options)
    pack = f"steps/{m.attempt}/pack.0/c.0"
    data = bytearray(storage.read(pack))
    data[len(data) // 2] ^= 0xFF
    storage.delete(pack)
    storage.write(pack, [memoryview(bytes(data))])
    with Checkpointer(s3_url, storage_options=s3_options, create=False) as ckpt:
        report = ckpt.verify()
        assert not report.ok and {p.step for p in report.problems} == {2}
        assert_exact(ckpt.load(1), reference(1))
    storage.delete(pack)
    with Checkpointer(s3_url, storage_options=s3_options, create=False) as ckpt:
        assert any("missing" in p.kind or "missing" in p.detail for p in ckpt.verify().problems)


def test_the_command_line_reaches_the_bucket_by_option_and_by_environment(s3_server, s3_url, s3_options,
                                                                          tmp_path, capsys):
    with Checkpointer(s3_url, storage_options=s3_options) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, reference(s))
    flags = [a for k, v in s3_options.items() for a in ("--storage-option", f"{k}={v}")]
    assert main(["ls", s3_url, "--json", *flags]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert main(["verify", s3_url, *flags]) == 0
    assert main(["show", s3_url, "2", "--json", *flags]) == 0
    capsys.readouterr()
    out = tmp_path / "step2.pt"
    assert main(["restore", s3_url, "--step", "2", "--out", str(out), *flags]) == 0
    assert_exact(torch.load(out, weights_only=True), reference(2))
    assert main(["compact", s3_url, "--upto", "3", "--keep-last", "1", "--grace", "0", *flags]) == 0
    assert main(["gc", s3_url, "--keep-last", "1", "--grace", "0", "--json", *flags]) == 0
    capsys.readouterr()
    assert main(["ls", s3_url, "--storage-option", "region"]) == 1
    assert "KEY=VALUE" in capsys.readouterr().err
    # The standard AWS variables, in a fresh process.
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_options["endpoint_url"], "AWS_REGION": s3_options["region"],
           "AWS_ACCESS_KEY_ID": s3_options["access_key_id"],
           "AWS_SECRET_ACCESS_KEY": s3_options["secret_access_key"]}
    done = subprocess.run([sys.executable, "-m", "deltackpt", "ls", s3_url, "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in json.loads(done.stdout)] == [3]
    if s3_server.kind == "moto":
        return  # moto accepts any signature
    bad = {**env, "AWS_SECRET_ACCESS_KEY": "wrong"}
    done = subprocess.run([sys.executable, "-m", "deltackpt", "ls", s3_url], env=bad,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_export_import_and_tail_reach_the_bucket_by_option(s3_url, s3_options, tmp_path, capsys):
    with Checkpointer(s3_url, storage_options=s3_options) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, reference(s))
    flags = [a for k, v in s3_options.items() for a in ("--storage-option", f"{k}={v}")]
    out = tmp_path / "step2.pt"
    assert main(["export", s3_url, "--step", "2", "--to", "torch", str(out), *flags]) == 0
    assert_exact(torch.load(out, weights_only=True), reference(2))
    copy = f"{s3_url}-imported"
    assert main(["import", str(out), copy, "--step", "20", *flags]) == 0
    with Checkpointer(copy, storage_options=s3_options, create=False) as ckpt:
        assert ckpt.steps() == [20]
        assert_exact(ckpt.load(20), reference(2))
    capsys.readouterr()
    assert main(["tail", s3_url, "--from", "1", *flags]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["step"] for line in lines] == [2, 3]
    for command in (["export", s3_url, "--to", "torch", str(tmp_path / "x.pt")],
                    ["import", str(out), copy, "--step", "21"], ["tail", s3_url]):
        assert main([*command, "--storage-option", "region"]) == 1, command
        assert "KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("step_bytes", [40 << 20])
def test_a_large_base_goes_up_in_parts_and_restores_exactly(s3_url, s3_options, step_bytes):
    gen = torch.Generator().manual_seed(1)
    state = {"big": torch.randn(step_bytes // 4 // 256, 256, generator=gen)}
    options = {**s3_options, "multipart_bytes": str(5 << 20), "part_bytes": str(5 << 20)}
    with Checkpointer(s3_url, storage_options=options) as ckpt:
        ckpt.save(1, state)
        state["big"][::97] += 1
        assert ckpt.save(2, state).kind == "delta"
    with Checkpointer(s3_url, storage_options=s3_options, create=False) as ckpt:
        assert torch.equal(ckpt.load(2)["big"], state["big"])


def test_gc_aborts_the_uploads_a_dead_save_left(s3_server, s3_url, s3_options):
    with Checkpointer(s3_url, storage_options=s3_options) as ckpt:
        ckpt.save(1, reference(1))
        prefix = s3_url.removeprefix(f"s3://{BUCKET}/")
        client = s3_server.client()
        key = f"{prefix}/steps/2-0123456789ab/pack.0/c.0"
        upload = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
        client.upload_part(Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1000)
        if s3_server.kind == "seaweedfs":  # moto dates every upload in 2010
            assert ckpt.gc(grace_seconds=3600).aborted_uploads == 0
        assert ckpt.gc(grace_seconds=0).aborted_uploads == 1
        assert ckpt.steps() == [1]
    left = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    assert left == []
