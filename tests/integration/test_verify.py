"""verify catches a flipped byte, a truncated chunk and a deleted chunk, naming each; restore
refuses to return damaged data."""

from __future__ import annotations

import os

import pytest
import torch

from deltackpt import BrokenChainError, Checkpointer, IntegrityError, MissingChunkError
from deltackpt.format.layout import commit_key


@pytest.fixture
def store(store_path):
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(1000, 16, generator=gen)
    with Checkpointer(store_path, chunk_bytes=8192, memory_budget=1 << 16) as ckpt:
        ckpt.save(0, {"table": table, "bias": torch.zeros(10)})
        table[[3, 500]] += 1
        ckpt.save(1, {"table": table, "bias": torch.zeros(10)})
    return store_path


def chunk_file(path, step: int, key: str, name: str) -> str:
    with Checkpointer(path, create=False) as ckpt:
        m = ckpt.store.manifest(step)
        assert name in m.tensors[key].parts[0].chunks
        return os.path.join(path, "steps", m.attempt, key, *name.split("/"))


def test_clean_store_verifies(store):
    with Checkpointer(store, create=False) as ckpt:
        report = ckpt.verify()
    assert report.ok and report.steps == [0, 1] and report.chunks > 5


def test_flipped_byte(store):
    f = chunk_file(store, 0, "table", "c.1.0")
    with open(f, "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 0xFF]))
    with Checkpointer(store, create=False) as ckpt:
        report = ckpt.verify()
        assert [(p.step, p.kind) for p in report.problems if p.step == 0] == [(0, "corrupt")]
        assert report.problems[0].key.endswith("table/c.1.0")
        assert "checksum" in report.problems[0].detail
        with pytest.raises(IntegrityError, match="table/c.1.0"):
            ckpt.load(1)


def pack_file(path, step: int) -> tuple[str, dict]:
    """The first file of the step's pack, and the record's entries of the chunks of ``table``."""
    with Checkpointer(path, create=False) as ckpt:
        m = ckpt.store.manifest(step)
        part = m.tensors["table"].parts[0]
        assert part.pack == "pack.0" and set(m.packs["pack.0"]) == {"zarr.json", "c.0"}
        return os.path.join(path, "steps", m.attempt, "pack.0", "c.0"), part.chunks


def test_truncated_pack(store):
    f, _ = pack_file(store, 1)
    os.truncate(f, os.path.getsize(f) // 2)
    with Checkpointer(store, create=False) as ckpt:
        report = ckpt.verify()
        assert {(p.step, p.kind) for p in report.problems} == {(1, "corrupt")}
        assert any(p.key.endswith("pack.0/c.0") and "bytes on disk" in p.detail for p in report.problems)
        assert ckpt.verify(0).ok  # the base does not refer to it
        ckpt.load(0)
        with pytest.raises(IntegrityError, match="pack.0/c.0"):
            ckpt.load(1)


def test_flipped_byte_in_a_packed_chunk(store):
    f, chunks = pack_file(store, 1)
    size, _, at = chunks["rows/c.0.0"]
    with open(f, "r+b") as fh:
        fh.seek(at + size // 2)
        b = fh.read(1)
        fh.seek(at + size // 2)
        fh.write(bytes([b[0] ^ 0xFF]))
    with Checkpointer(store, create=False) as ckpt:
        report = ckpt.verify()
        assert {(p.step, p.kind) for p in report.problems} == {(1, "corrupt")}
        keys = sorted(p.key for p in report.problems)
        assert len(keys) == 2 and keys[0].endswith("pack.0/c.0")  # the file, and the chunk in it
        assert f"table/rows/c.0.0 (in pack.0 at byte {at})" in keys[1]
        with pytest.raises(IntegrityError, match="rows/c.0.0"):
            ckpt.load(1)


def test_deleted_chunk(store):
    os.remove(chunk_file(store, 0, "table", "c.1.0"))
    with Checkpointer(store, create=False) as ckpt:
        report = ckpt.verify()
        assert {(p.step, p.kind) for p in report.problems} == {(0, "missing"), (1, "chain")}
        assert any(p.key.endswith("table/c.1.0") for p in report.problems)
        with pytest.raises(MissingChunkError, match="table/c.1.0"):
            ckpt.load(0)


def test_deleted_base_pack(store):
    """The base's small tensor lies in its pack: without the pack, verify names the pack's
    file, and a load refuses."""
    with Checkpointer(store, create=False) as ckpt:
        m = ckpt.store.manifest(0)
    assert m.tensors["bias"].parts[0].pack == "pack.0" and m.tensors["table"].parts[0].pack is None
    os.remove(os.path.join(store, "steps", m.attempt, "pack.0", "c.0"))
    with Checkpointer(store, create=False) as ckpt:
        report = ckpt.verify()
        assert {(p.step, p.kind) for p in report.problems} == {(0, "missing"), (1, "chain")}
        assert any(p.key.endswith("pack.0/c.0") for p in report.problems)
        with pytest.raises(MissingChunkError, match="pack.0/c.0"):
            ckpt.load(0)


def test_missing_parent_record_breaks_the_chain(store):
    os.remove(os.path.join(store, *commit_key(0).split("/")))
    with Checkpointer(store, create=False) as ckpt:
        assert ckpt.steps() == [1]
        report = ckpt.verify()
        assert [p.kind for p in report.problems] == ["chain"]
        with pytest.raises(BrokenChainError, match="step 0"):
            ckpt.load(1)
