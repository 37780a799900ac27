"""LocalStorage writes: aligned blocks past the page cache, the rest through it, the same bytes
either way; a file system that refuses O_DIRECT gets buffered writes."""

from __future__ import annotations

import errno
import fcntl
import os
import threading

import numpy as np
import pytest
import torch

from deltackpt import Checkpointer
from deltackpt.errors import StoreError
from deltackpt.io.staging import StagingPool
from deltackpt.storage import LocalStorage
from deltackpt.storage.direct import BLOCK, BOUNCE, DIRECT_MIN


def parts_of(pool: StagingPool, rng: np.random.Generator) -> tuple[list[memoryview], bytes]:
    """An aligned buffer with a ragged end, a small unaligned part, and an aligned one again."""
    big = pool.acquire(DIRECT_MIN + 3 * BLOCK + 123)
    big.numpy()[:] = rng.integers(0, 256, big.numel(), dtype=np.uint8)
    small = memoryview(rng.integers(0, 256, 777, dtype=np.uint8).tobytes())
    parts = [memoryview(big.numpy()), small, memoryview(big.numpy())]
    return parts, b"".join(bytes(p) for p in parts)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_direct_and_buffered_writes_store_the_same_bytes(tmp_path, monkeypatch):
    pool = StagingPool(2, 2 * DIRECT_MIN)
    parts, expected = parts_of(pool, np.random.default_rng(0))
    assert parts[0].obj.ctypes.data % BLOCK == 0  # the pool's buffers are aligned
    direct_calls = []
    real = fcntl.fcntl

    def spy(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            direct_calls.append(arg)
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", spy)
    storage = LocalStorage(tmp_path)
    storage.write("a/file", parts)
    storage.sync(["a/file"])
    assert storage.read("a/file") == expected
    # Only the first part is offered to O_DIRECT: the small one is below DIRECT_MIN, and the
    # third starts at an unaligned file offset.
    assert len(direct_calls) == 1


@pytest.mark.parametrize("where", ["fcntl", "write"])
def test_a_file_system_refusing_o_direct_gets_buffered_writes(tmp_path, monkeypatch, where):
    pool = StagingPool(2, 2 * DIRECT_MIN)
    parts, expected = parts_of(pool, np.random.default_rng(1))
    real_fcntl, real_write = fcntl.fcntl, os.write
    refused = []

    def direct(fd: int) -> bool:
        return bool(real_fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))

    def refuse_fcntl(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & getattr(os, "O_DIRECT", 0):
            refused.append(arg)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    def refuse_write(fd, data):
        if direct(fd):
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    if where == "fcntl":
        monkeypatch.setattr(fcntl, "fcntl", refuse_fcntl)
    else:
        monkeypatch.setattr(os, "write", refuse_write)
    storage = LocalStorage(tmp_path)
    storage.write("x", parts)
    storage.write("y", parts)
    assert storage.read("x") == expected and storage.read("y") == expected
    assert len(refused) == (1 if hasattr(os, "O_DIRECT") else 0)  # asked once, then not again


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_unaligned_memory_is_written_direct_through_a_bounce_buffer(tmp_path, monkeypatch):
    raw = np.random.default_rng(2).integers(0, 256, 2 * BOUNCE + 3 * BLOCK + 64 + 99, dtype=np.uint8)
    start = 64 - raw.ctypes.data % BLOCK + BLOCK  # 64 B past a block, as a tensor's memory starts
    part = memoryview(raw[start:])
    storage = LocalStorage(tmp_path)
    direct = []
    real = storage._writer._write_direct
    monkeypatch.setattr(storage._writer, "_write_direct",
                        lambda fd, data: direct.append(real(fd, data)) or direct[-1])
    storage.write("f", [part])
    assert storage.read("f") == bytes(part)
    assert direct == [len(part) // BLOCK * BLOCK]  # every whole block, in three bounce copies


def test_a_base_writes_its_large_chunks_direct(tmp_path, monkeypatch):
    # A tensor's memory starts 64 B past a page; its chunks of up to 2 MiB still bypass the
    # page cache (through the staging buffers or the bounce buffer), all but each one's tail
    # of less than a block.
    storage = LocalStorage(tmp_path)
    direct = []
    real = storage._writer._write_direct
    monkeypatch.setattr(storage._writer, "_write_direct",
                        lambda fd, data: direct.append(real(fd, data)) or direct[-1])
    try:  # a file system that refuses O_DIRECT gets buffered writes (another test's case)
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except (AttributeError, OSError):
        pytest.skip("this file system refuses O_DIRECT")
    table = torch.randn(5 * (1 << 19) + 3, 1)
    with Checkpointer(storage, chunk_bytes=2 << 20, memory_budget=8 << 20) as ckpt:
        ckpt.save(1, {"table": table})
        assert torch.equal(ckpt.load(1)["table"], table)
    assert len(direct) == 6 and sum(direct) > table.nbytes - 6 * BLOCK, (direct, table.nbytes)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_files_written_direct_are_fsynced_together_by_sync(tmp_path):
    # A file written through the page cache is fsync-ed by its writer; one written direct has
    # its bytes on the disk already and is fsync-ed by sync, with the others in one batch.
    points = []
    storage = LocalStorage(tmp_path, on_point=lambda phase, key: points.append((phase, key)))
    raw = np.random.default_rng(3).integers(0, 256, DIRECT_MIN + 2 * BLOCK, dtype=np.uint8)
    aligned = memoryview(raw[-raw.ctypes.data % BLOCK:][:DIRECT_MIN])
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    storage.write("steps/1-a/small", [memoryview(b"x" * 10)])
    storage.write("steps/1-a/big.0", [aligned])
    storage.write("steps/1-a/big.1", [aligned])
    assert [k for phase, k in points if phase == "fsync"] == ["steps/1-a/small"]
    batches = []

    def run(jobs):
        batches.append(len(jobs))
        for job in jobs:
            job()

    points.clear()
    storage.sync(["steps/1-a/small", "steps/1-a/big.0", "steps/1-a/big.1"], run=run)
    assert sorted(k for phase, k in points if phase == "fsync") == ["steps/1-a/big.0", "steps/1-a/big.1"]
    assert batches[0] == 2 and points[-1][0] == "fsync_dir"  # the files before their folders
    points.clear()
    storage.sync(["steps/1-a/big.0"], run=run)  # fsync-ed once
    assert [phase for phase, _ in points] == ["fsync_dir"]
    assert storage.read("steps/1-a/big.1") == bytes(aligned)


def test_sync_issues_the_folders_fsyncs_together_through_run(tmp_path):
    # Every fsync flushes the device's cache: the folders' fsyncs of one sync are handed to
    # ``run`` together (a save runs them on its I/O threads), each folder once.
    points = []
    storage = LocalStorage(tmp_path, on_point=lambda phase, key: points.append((phase, key)))
    keys = ["steps/1-a/t/zarr.json", "steps/1-a/t/c.0", "steps/1-a/u/c.0", "steps/1-a/zarr.json"]
    for k in keys:
        storage.write(k, [memoryview(b"x" * 10)])
    batches = []

    def run(jobs):
        batches.append(len(jobs))
        threads = [threading.Thread(target=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    points.clear()
    storage.sync(keys, run=run)
    synced = sorted(os.path.relpath(k, tmp_path) for phase, k in points if phase == "fsync_dir")
    assert synced == [".", "steps", "steps/1-a", "steps/1-a/t", "steps/1-a/u"]  # made here
    assert batches == [5]
    points.clear()
    storage.sync(keys, run=run)  # the parents' new names are durable already
    assert sorted(os.path.relpath(k, tmp_path) for _, k in points) == ["steps/1-a", "steps/1-a/t", "steps/1-a/u"]


@pytest.mark.parametrize("under", ["", "inner/deeper"])
def test_a_store_path_through_a_file_names_the_file(tmp_path, under):
    # A store's path naming a file (or a path below one) is refused naming that file, on a save
    # and on a read alike.
    file = tmp_path / "a-file"
    file.write_bytes(b"not a store")
    with pytest.raises(StoreError, match=f"{file} is a file, where a folder of the store must be"):
        Checkpointer(file / under if under else file).save(1, {"w": torch.ones(3)})
    with pytest.raises(StoreError, match=f"{file} is a file"):
        LocalStorage(file / under if under else file).read("zarr.json")
    assert file.read_bytes() == b"not a store"
