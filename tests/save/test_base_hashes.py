"""A base's row hashes are taken by its write threads from the staged copies, not in a pass
before the writes: they equal the hashes of the state as staged, so the next delta finds
exactly the rows changed since, even rows changed while the base was still being written."""

from __future__ import annotations

import torch

from deltackpt import Checkpointer, MemoryStorage, kernels


def test_the_reference_after_a_base_is_the_hash_of_every_row():
    t = torch.randn(3000, 16, generator=torch.Generator().manual_seed(0))
    acc = torch.rand(3000)
    with Checkpointer(MemoryStorage(), chunk_bytes=4096, dense_chunk_bytes=1024) as ckpt:
        hasher, passes = ckpt._tracker.hasher, []
        rows = hasher.rows
        hasher.rows = lambda x: passes.append(x.shape) or rows(x)  # a pass over a whole table
        assert ckpt.save(0, {"t": t, "acc": acc}).kind == "base"
        assert passes == []
        refs = ckpt._tracker._refs
        assert torch.equal(refs["t"].hashes, kernels.hash_rows(t))
        assert torch.equal(refs["acc"].hashes, kernels.hash_chunks(acc, ckpt._tracker.chunk_elems(acc) * 4))
        t[[5, 1700, 2999]] += 1
        info = ckpt.save(1, {"t": t, "acc": acc})
        assert (info.kind, info.rows_changed) == ("delta", 3)
        got = torch.empty_like(t)
        ckpt.restore({"t": got, "acc": torch.empty_like(acc)}, 1)
    assert torch.equal(got.view(torch.int32), t.view(torch.int32))


def test_rows_changed_right_after_a_background_base_reach_the_next_delta():
    t = torch.randn(20_000, 32, generator=torch.Generator().manual_seed(1))
    with Checkpointer(MemoryStorage(), chunk_bytes=8192, memory_budget=32768) as ckpt:
        handle = ckpt.save(0, {"t": t}, blocking=False)
        changed = [0, 7, 12_345, 19_999]
        t[changed] += 1  # while the base's writes (and its hashes) may still run
        assert handle.result().kind == "base"
        info = ckpt.save(1, {"t": t})
        assert (info.kind, info.rows_changed) == ("delta", len(changed))
        got = torch.empty_like(t)
        ckpt.restore({"t": got}, 1)
    assert torch.equal(got.view(torch.int32), t.view(torch.int32))
