"""StepWriter: a part's chunks as zarr v3 chunk files (or packed back to back), each with its size
and checksum recorded."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

from deltackpt import kernels
from deltackpt.format.encodings import FULL, get, write_block
from deltackpt.format.zarr_meta import codec_for
from deltackpt.io.staging import StagingPool
from deltackpt.io import writer
from deltackpt.io.writer import HAND_OFF_BYTES, StepWriter
from deltackpt.storage import MemoryStorage

MiB = 1 << 20


def test_whole_parts_go_to_padded_chunk_files_with_their_checksums():
    storage, pool = MemoryStorage(), StagingPool(4, 1024)
    t = torch.arange(30, dtype=torch.int32).reshape(10, 3)
    cs = FULL.chunk_shape((10, 3), 4, 10, (48, 48), None)  # 48 B: 4 rows of 12 B a chunk
    assert cs == (4, 3)
    with ThreadPoolExecutor(2) as ex:
        w = StepWriter(storage, "steps/1-a", pool, ex)
        write_block(w, "t", "", t, cs)
        files = w.finish()[("t", "")]
    assert sorted(files) == ["c.0.0", "c.1.0", "c.2.0"]
    last = storage.read("steps/1-a/t/c.2.0")  # integers are blosc-lz4 coded
    assert codec_for(torch.int32).decode(last) == t[8:].numpy().tobytes() + bytes(24)  # zero padded
    assert files["c.2.0"] == (len(last), xxhash.xxh3_64(last).hexdigest())
    assert sorted(w.written) == sorted(f"steps/1-a/t/{n}" for n in files)


def test_a_pack_holds_chunks_back_to_back_with_their_offsets():
    storage, pool = MemoryStorage(), StagingPool(4, 64)
    t = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    with ThreadPoolExecutor(2) as ex:
        w = StepWriter(storage, "steps/2-b", pool, ex, pack="pack.0")
        get("rows").encode(w, "t", "", t, torch.tensor([1, 5, 6]), (2, 4))
        entries = w.finish()[("t", "")]
    pack = b"".join(storage.read(f"steps/2-b/pack.0/c.{i}") for i in range(len(w.packs["pack.0"]) - 1))
    size, digest, at = entries["rows/c.0.0"]
    assert pack[at : at + size] == t[[1, 5]].numpy().tobytes()
    assert xxhash.xxh3_64(pack[at : at + size]).hexdigest() == digest
    size, _, at = entries["ids/c.1"]
    ids = codec_for(torch.int64).decode(pack[at : at + size])
    assert np.frombuffer(ids, np.int64).tolist() == [6, 0]  # padded to the chunk


def test_the_pack_thread_appends_staged_rows_and_the_caller_copies_live_chunks(monkeypatch):
    # A delta's gathered rows (in staging buffers of their own) are appended, and hashed, by the
    # pack thread, held here until the caller has changed every tensor; a live tensor's chunk
    # put without a release is copied before the put returns. (Every staged chunk is handed
    # off here, however small.)
    monkeypatch.setattr(writer, "HAND_OFF_BYTES", 0)
    storage, pool = MemoryStorage(), StagingPool(8, 64)
    t = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    dense = torch.arange(6, dtype=torch.float32)
    want_rows, want_dense = t[[1, 5, 6]].clone(), dense.clone()
    hashes = torch.zeros(3, dtype=torch.int64)
    held = threading.Event()
    with ThreadPoolExecutor(2) as ex, ThreadPoolExecutor(1) as packer:
        packer.submit(held.wait, 30)
        w = StepWriter(storage, "steps/3-c", pool, ex, pack="pack.0", packer=packer)
        get("rows").encode(w, "t", "", t, torch.tensor([1, 5, 6]), (2, 4), hash_into=hashes)
        write_block(w, "d", "", dense, (6,), packed=True)
        assert not hashes.any()  # not hashed yet: the pack thread is held
        t.fill_(-1.0)
        dense.fill_(-1.0)
        held.set()
        entries = w.finish()
    pack = b"".join(storage.read(f"steps/3-c/pack.0/c.{i}") for i in range(len(w.packs["pack.0"]) - 1))
    rows = b"".join(pack[at : at + size] for size, _, at in (entries[("t", "")][f"rows/c.{i}.0"] for i in (0, 1)))
    assert rows[: 3 * 16] == want_rows.numpy().tobytes()
    size, _, at = entries[("d", "")]["c.0"]
    assert pack[at : at + size] == want_dense.numpy().tobytes()
    assert torch.equal(hashes, kernels.hash_rows(want_rows))


def test_small_staged_chunks_are_appended_by_the_saving_thread():
    # Staged rows under HAND_OFF_BYTES are copied and hashed before the put returns: the pack
    # thread (held here) gets none of them. Larger ones still go to it.
    storage, pool = MemoryStorage(), StagingPool(8, 2 * HAND_OFF_BYTES)
    small = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    large = torch.randn(4, HAND_OFF_BYTES // 4)
    want_small, want_large = small[[1, 5, 6]].clone(), large[[0, 3]].clone()
    hashes, large_hashes = torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    held = threading.Event()
    with ThreadPoolExecutor(2) as ex, ThreadPoolExecutor(1) as packer:
        packer.submit(held.wait, 30)
        w = StepWriter(storage, "steps/4-d", pool, ex, pack="pack.0", packer=packer)
        get("rows").encode(w, "s", "", small, torch.tensor([1, 5, 6]), (4, 4), hash_into=hashes)
        small_at_put = hashes.clone()
        get("rows").encode(w, "l", "", large, torch.tensor([0, 3]), (2, HAND_OFF_BYTES // 4),
                           hash_into=large_hashes)
        large_at_put = large_hashes.clone()
        small.fill_(-1.0)
        large.fill_(-1.0)
        held.set()
        entries = w.finish()
    assert torch.equal(small_at_put, kernels.hash_rows(want_small))  # appended here, held or not
    assert not large_at_put.any()  # handed to the held pack thread
    pack = b"".join(storage.read(f"steps/4-d/pack.0/c.{i}") for i in range(len(w.packs["pack.0"]) - 1))
    size, _, at = entries[("s", "")]["rows/c.0.0"]
    assert pack[at : at + 3 * 16] == want_small.numpy().tobytes()
    size, _, at = entries[("l", "")]["rows/c.0.0"]
    assert pack[at : at + size] == want_large.numpy().tobytes()
    assert torch.equal(large_hashes, kernels.hash_rows(want_large))


class _Watched(MemoryStorage):
    """A MemoryStorage that tells when the first bytes of a file whose name ends with ``c.0.0``
    reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()

    def write(self, key, parts):
        def watched():
            for p in parts:
                if key.endswith("c.0.0"):
                    self.started.set()
                yield p

        super().write(key, watched())


def test_a_large_file_is_written_while_its_rows_are_hashed(monkeypatch):
    # The disk starts on a base's chunk file at once: the hash of its rows, which the tracker
    # needs, and its checksum are done beside the write, not before it.
    storage, pool = _Watched(), StagingPool(2, 4 * MiB)
    t = torch.randn(1024, 2 * MiB // 4096)
    hashes = torch.zeros(1024, dtype=torch.int64)
    real = kernels.hash_rows
    seen = []

    def hash_rows(x, **kw):
        seen.append(storage.started.wait(5))  # the file's write has started meanwhile
        return real(x, **kw)

    monkeypatch.setattr(kernels, "hash_rows", hash_rows)
    with ThreadPoolExecutor(2) as ex:
        w = StepWriter(storage, "steps/5-e", pool, ex)
        FULL.encode(w, "t", "", t, None, tuple(t.shape), hash_into=hashes)
        files = w.finish()[("t", "")]
    assert seen == [True]
    data = storage.read("steps/5-e/t/c.0.0")
    assert data == t.numpy().tobytes()
    assert files["c.0.0"] == (len(data), xxhash.xxh3_64(data).hexdigest())
    assert torch.equal(hashes, real(t))


def test_finish_runs_the_queued_jobs_no_io_thread_has_started():
    # With every I/O thread busy elsewhere, the thread that waits in finish() writes and hashes
    # the files itself.
    storage, pool = MemoryStorage(), StagingPool(2, 4 * MiB)
    t = torch.randn(2 * MiB // 4)
    held = threading.Event()
    with ThreadPoolExecutor(1) as ex:
        ex.submit(held.wait, 30)
        w = StepWriter(storage, "steps/6-f", pool, ex)
        FULL.encode(w, "t", "", t, None, tuple(t.shape))
        done = []
        waiter = threading.Thread(target=lambda: done.append(w.finish()))
        waiter.start()
        waiter.join(20)
        finished_meanwhile = bool(done)
        held.set()
        waiter.join()
    assert finished_meanwhile
    data = storage.read("steps/6-f/t/c.0")
    assert data == t.numpy().tobytes()
    assert done[0][("t", "")]["c.0"] == (len(data), xxhash.xxh3_64(data).hexdigest())


def test_a_failed_hash_fails_the_file_and_gives_back_its_buffer(monkeypatch):
    storage, pool = MemoryStorage(), StagingPool(2, 4 * MiB)
    t = torch.randn(1024, 2 * MiB // 4096)

    def hash_rows(x, **kw):
        raise OSError("hash failed")

    monkeypatch.setattr(kernels, "hash_rows", hash_rows)
    with ThreadPoolExecutor(2) as ex:
        w = StepWriter(storage, "steps/7-g", pool, ex)
        FULL.encode(w, "t", "", t, None, tuple(t.shape), hash_into=torch.zeros(1024, dtype=torch.int64))
        try:
            w.finish()
        except OSError as e:
            assert str(e) == "hash failed"
        else:
            raise AssertionError("finish() did not raise the hash's error")
    assert "c.0.0" not in w.results[("t", "")]
    bufs = [pool.acquire(pool.nbytes) for _ in range(pool.buffers)]  # none is still held
    assert len(bufs) == pool.buffers


class FailingMidWrite(MemoryStorage):
    """A store whose write of ``key`` takes the first piece of its bytes, then fails (a disk that
    fills up part way)."""

    def __init__(self, key: str):
        super().__init__()
        self.key = key

    def write(self, key, parts):
        if key != self.key:
            return super().write(key, parts)
        for i, _ in enumerate(parts):
            if i:
                raise OSError(28, "No space left on device")


def test_a_pack_write_failing_part_way_gives_back_every_buffer():
    # The failure is kept (a background save raises it at the next call), and with it the frames
    # of the write; the stream's buffer must not wait for them to be collected.
    storage, pool = FailingMidWrite("steps/8-h/pack.0/c.0"), StagingPool(4, 64)
    t = torch.arange(400, dtype=torch.float32).reshape(100, 4)
    gc.disable()
    try:
        with ThreadPoolExecutor(2) as ex:
            w = StepWriter(storage, "steps/8-h", pool, ex, pack="pack.0")
            get("rows").encode(w, "t", "", t, torch.arange(0, 100, 3), (8, 4))  # pieces of 64 B
            with pytest.raises(OSError, match="No space") as failure:
                w.finish()
        assert all(pool._slots.acquire(timeout=5) for _ in range(4)), failure  # every buffer came back
    finally:
        gc.enable()


@pytest.mark.parametrize("rows, pieces", [(100, 1), (2048 + 7, 2), (100_000, writer.MAX_PIECES)])
def test_a_gather_is_split_into_pieces_of_at_least_a_mib(monkeypatch, rows, pieces):
    """Rows of 1 KiB from all over a table: a gather of under two pieces' bytes runs on the
    calling thread alone, a larger one in pieces shared with the I/O threads, at most
    MAX_PIECES; the same rows either way."""
    runs: list[int] = []
    shared = writer.run_shared
    monkeypatch.setattr(writer, "run_shared", lambda ex, jobs, *a: (runs.append(len(jobs)), shared(ex, jobs, *a)))
    table = torch.randn(200_000, 256)
    ids = torch.randperm(200_000)[:rows].sort().values
    pool = StagingPool(1, rows * 1024)
    with ThreadPoolExecutor(2) as ex:
        w = StepWriter(MemoryStorage(), "steps/6-f", pool, ex)
        out = pool.acquire(rows * 1024).view(torch.float32).view(rows, 256)
        w.gather(table, ids, out)
    assert runs == ([] if pieces == 1 else [pieces])
    assert out.equal(table[ids])


def test_a_background_save_codes_a_deltas_ids_after_staging_and_abandons_them_cleanly():
    """Without ``blocking`` (``defer``), the ids of a delta's rows, which do not change until the
    save ends, are coded and appended by finish(), not by the staging thread; an abandoned
    writer drops them and gives back every staging buffer and every place of the appends."""
    rows = torch.randn(64, 32)
    changed = torch.tensor([1, 5, 9])
    storage = MemoryStorage()
    for abandon in (False, True):
        pool = StagingPool(4, 4096)
        with ThreadPoolExecutor(2) as ex:
            w = StepWriter(storage, f"steps/7-{abandon:d}", pool, ex, pack="pack.0", defer=True)
            ahead = w._ahead._value
            try:
                get("rows").encode(w, "t", "", rows, changed, (4, 32))
                staged = dict(w.results[("t", "")])
            finally:
                w.abandon() if abandon else w.finish()  # the pack's file ends either way
        assert "ids/c.0" not in staged  # left to finish()
        if abandon:
            assert w._ahead._value == ahead and pool._slots._value == pool.buffers
            continue
        entries = w.results[("t", "")]
        pack = b"".join(storage.read(f"steps/7-0/pack.0/c.{i}") for i in range(len(w.packs["pack.0"]) - 1))
        size, _, at = entries["ids/c.0"]
        assert codec_for(torch.int64).decode(pack[at : at + size])[:24] == changed.numpy().tobytes()
        size, _, at = entries["rows/c.0.0"]
        assert pack[at : at + 3 * 128] == rows[changed].numpy().tobytes()
