"""LocalStorage makes durable exactly what was written, never the whole file system: every file
written, the folders holding them and the parents of the folders it created, nothing else."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deltackpt import Checkpointer
from deltackpt.storage import LocalStorage


@pytest.fixture
def flushed(monkeypatch):
    """The paths of everything ``os.fsync``-ed while the test runs (files and folders)."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")


def test_sync_covers_exactly_the_written_files_and_their_new_folders(tmp_path, flushed):
    storage = LocalStorage(tmp_path)
    storage.write("steps/1-a/t/c.0", [memoryview(b"old")])
    storage.sync(["steps/1-a/t/c.0"])
    flushed.clear()
    keys = ["steps/2-b/zarr.json", "steps/2-b/pack.0/c.0", "steps/2-b/pack.0/zarr.json"]
    for k in keys:
        storage.write(k, [memoryview(b"x" * 5000)])
    storage.sync(keys)
    root = str(tmp_path)
    assert sorted(flushed) == sorted([
        *(f"{root}/{k}" for k in keys),
        f"{root}/steps/2-b/pack.0", f"{root}/steps/2-b",
        f"{root}/steps",  # holds the new attempt folder's name
    ])
    flushed.clear()
    # Into folders already durable: the file and its folder only.
    storage.write("steps/2-b/pack.0/c.1", [memoryview(b"y")])
    storage.sync(["steps/2-b/pack.0/c.1"])
    assert sorted(flushed) == [f"{root}/steps/2-b/pack.0", f"{root}/steps/2-b/pack.0/c.1"]


def test_a_commit_flushes_its_record_and_folder_only(tmp_path, flushed):
    storage = LocalStorage(tmp_path)
    storage.put_if_absent("commits/a.json", b"{}")
    flushed.clear()
    assert storage.put_if_absent("commits/b.json", b"{}")
    root = str(tmp_path)
    assert len(flushed) == 2 and flushed[1] == f"{root}/commits"
    assert os.path.dirname(flushed[0]) == f"{root}/commits" and flushed[0].endswith(".tmp")


@pytest.mark.parametrize("kind", ["delta", "base"])
def test_a_save_flushes_only_its_own_files_and_folders(tmp_path, flushed, kind):
    root = str(tmp_path / "store")
    table = torch.randn(1000, 16)
    state = {"table": table, "dense": torch.randn(300), "step": 1}
    with Checkpointer(root, base_every=1 if kind == "base" else 10) as ckpt:
        ckpt.save(1, state)
        # Another writer's unsynced file on the store's file system.
        with open(tmp_path / "other.bin", "wb") as f:
            f.write(b"z" * 100_000)
        flushed.clear()
        table[::97] += 1
        state["step"] = 2
        assert ckpt.save(2, state).kind == kind
    with open(f"{root}/commits/{2:020d}.json") as f:
        attempt = f"{root}/steps/{json.load(f)['attempt']}"
    own_files = {os.path.join(d, n) for d, _, names in os.walk(attempt) for n in names}
    own_folders = {d for d, _, _ in os.walk(attempt)}
    assert own_files and own_files <= set(flushed)  # every file of the step
    for path in flushed:
        assert (path in own_files or path in own_folders or path in (f"{root}/steps", f"{root}/commits")
                or os.path.dirname(path) == f"{root}/commits" and path.endswith(".tmp")
                # the writer lease naming the save's head and attempt (its temp file, renamed)
                or path.startswith(f"{root}/.writer.lease.") and path.endswith(".tmp")), path
