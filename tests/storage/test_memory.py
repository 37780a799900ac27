"""The in-memory backend: durability as a power cut sees it, and a whole checkpoint cycle."""

from __future__ import annotations

import torch

from deltackpt import Checkpointer, MemoryStorage
from deltackpt.ops.gc import Retention
from helpers import assert_same_state


def test_a_crash_keeps_only_what_was_made_durable():
    storage = MemoryStorage()
    storage.write("steps/a/c.0", [memoryview(b"synced")])
    storage.write("steps/a/c.1", [memoryview(b"not synced")])
    storage.sync(["steps/a/c.0"])
    assert storage.put_if_absent("commits/1.json", b"{}")
    assert storage.put_if_absent("commits/2.json", b"{}")
    storage.delete("commits/1.json")
    storage.crash()
    assert storage.list("steps/a") == ["c.0"]
    assert storage.list("commits") == ["1.json", "2.json"]  # the removal was never made durable
    storage.delete("commits/1.json")
    storage.sync_folders(["commits"])
    storage.crash()
    assert storage.list("commits") == ["2.json"]


def state_at(step: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(256, 8, generator=gen)
    dense = torch.randn(64, generator=gen)
    for s in range(1, step + 1):
        table[(7 * s) % 256] += s
        dense[s % 64] = s
    return {"table": table, "dense": dense, "step": step}


def test_save_restore_compact_gc_verify_in_memory():
    storage = MemoryStorage()
    with Checkpointer(storage, base_every=100, chunk_bytes=1024, memory_budget=8192) as ckpt:
        kinds = [ckpt.save(s, state_at(s)).kind for s in range(1, 7)]
        assert kinds == ["base"] + ["delta"] * 5
    with Checkpointer(storage, create=False) as ckpt:
        for s in range(1, 7):
            assert_same_state(ckpt.load(s), state_at(s))
        live = {"table": torch.zeros(256, 8), "dense": torch.zeros(64), "step": 0}
        ckpt.restore(live, 6)
        assert_same_state(live, state_at(6))
        assert ckpt.compact(4).done
        report = ckpt.gc(Retention(keep_last=3), grace_seconds=0)
        assert report.dropped_steps == [1, 2, 3] and report.deleted
        assert ckpt.steps() == [4, 5, 6]
        assert [m.step for m in ckpt.store.chain(6)] == [4, 5, 6]
        assert ckpt.verify().ok
        assert ckpt.save(7, state_at(7)).kind == "delta"
    storage.crash()  # every committed step was durable
    with Checkpointer(storage, create=False) as ckpt:
        assert ckpt.steps() == [4, 5, 6, 7]
        for s in (4, 5, 6, 7):
            assert_same_state(ckpt.load(s), state_at(s))
        assert ckpt.verify().ok
