"""A base of many small tensors goes into its writer's pack: a few files instead of a folder
and files per tensor, read back bit for bit by load, partial loads, verify, compaction, export
and gc. Large parts stay zarr arrays of their own."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import deltackpt
from deltackpt import Checkpointer, EveryK, Retention
from dist_harness import check_ok, run_ranks
from helpers import assert_same_state, same_bits


def small_state(n: int) -> dict:
    """``n`` small tensors of every kind (0-d, empty, 1-d, 2-d; float, bfloat16, int, bool)
    beside one large table."""
    gen = torch.Generator().manual_seed(0)
    kinds = [
        lambda: torch.randn(64, generator=gen),
        lambda: torch.randn(16, 8, generator=gen).bfloat16(),
        lambda: torch.randint(-9, 9, (5,), generator=gen),
        lambda: torch.rand(7, generator=gen) > 0.5,
        lambda: torch.randn((), generator=gen),
        lambda: torch.empty(0, 3),
    ]
    state: dict = {f"layer{i // len(kinds)}": {} for i in range(n)}
    for i in range(n):
        state[f"layer{i // len(kinds)}"][f"p{i % len(kinds)}"] = kinds[i % len(kinds)]()
    state["table"] = torch.randn(5000, 64, generator=gen)  # 1.2 MiB: an array of its own
    state["step"] = 3
    return state


def files_under(folder: str) -> list[str]:
    return [os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs]


@pytest.fixture
def saved(store_path):
    state = small_state(300)
    with Checkpointer(store_path, policy=EveryK(100)) as ckpt:
        ckpt.save(1, state)
        state["layer3"]["p1"][2, 5] += 1
        state["table"][17] += 1
        assert ckpt.save(2, state).kind == "delta"
    return store_path, state


def test_a_base_of_small_tensors_is_a_pack_and_large_ones_are_arrays(saved):
    path, state = saved
    with Checkpointer(path, create=False) as ckpt:
        m = ckpt.store.manifest(1)
    files = files_under(os.path.join(path, "steps", m.attempt))
    # The attempt's group, the pack (one file and its metadata), the part table, the table's
    # array (its metadata and its chunks): no file or folder per small tensor.
    table = [f for f in files if f.startswith("table" + os.sep)]
    assert sorted(set(files) - set(table)) == ["pack.0/c.0", "pack.0/zarr.json", "parts.0", "zarr.json"]
    assert len(table) == 1 + len(m.tensors["table"].parts[0].chunks) - 1
    assert m.tensors["table"].parts[0].pack is None
    small = [r for k, r in m.tensors.items() if k != "table" and r.shape[0:1] != (0,)]
    assert small and all(r.parts[0].pack == "pack.0" for r in small)
    assert m.tensors["layer0/p5"].parts[0].pack is None  # no elements: no chunks, no pack


def test_load_partial_load_and_verify_read_the_packed_base(saved):
    path, state = saved
    with Checkpointer(path, create=False) as ckpt:
        assert ckpt.verify().ok
        assert_same_state(ckpt.load(2), state)
        part = ckpt.load(1, keys=["layer7/p0", "layer2/p4"])
        assert set(part) == {"layer7/p0", "layer2/p4"}
        assert same_bits(part["layer7/p0"], state["layer7"]["p0"])
        assert same_bits(part["layer2/p4"], state["layer2"]["p4"])
        assert same_bits(ckpt.load(2, key="layer3/p1", rows=[2]), state["layer3"]["p1"][[2]])


def test_compaction_export_and_gc_read_the_packed_base(saved, tmp_path):
    path, state = saved
    deltackpt.export(path, 2, "safetensors", tmp_path / "out")  # from the packed base and a delta
    flat = {}
    for f in sorted(os.listdir(tmp_path / "out")):
        if f.endswith(".safetensors"):
            flat.update(load_file(tmp_path / "out" / f))
    assert same_bits(flat["layer3.p1"], state["layer3"]["p1"]) and same_bits(flat["table"], state["table"])
    with Checkpointer(path, create=False) as ckpt:
        assert ckpt.compact(2).done
        ckpt.gc(Retention(keep_last=1), grace_seconds=0)
        assert ckpt.steps() == [2] and ckpt.verify().ok
        assert_same_state(ckpt.load(2), state)


def test_a_two_rank_base_packs_each_ranks_small_parts(store_path, tmp_path):
    """Each rank writes its own pack; the parts it wrote point into it."""
    check_ok(run_ranks(_sharded_job, 2, str(tmp_path), str(store_path)))
    with Checkpointer(store_path, create=False) as ckpt:
        m = ckpt.store.manifest(1)
        got = ckpt.load(1)
    assert set(m.packs) == {"pack.0", "pack.1"}
    assert {p.pack for p in m.tensors["w"].parts} == {"pack.0", "pack.1"}
    want = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    assert same_bits(got["w"], want) and same_bits(got["b"], torch.ones(3))


def _sharded_job(rank: int, world: int, path: str) -> None:
    w = torch.arange(40, dtype=torch.float32).reshape(10, 4)[rank * 5 : rank * 5 + 5]
    with Checkpointer(path) as ckpt:
        ckpt.save(1, {"w": deltackpt.Shard(w, global_shape=(10, 4), global_offset=(rank * 5, 0)),
                      "b": torch.ones(3)})


def test_compaction_packs_small_parts_as_a_base_does(store_path):
    """Compacting a chain of hundreds of small tensors writes a pack, not a folder and files per
    tensor, and the compacted step restores and verifies bit for bit."""
    state = small_state(600)
    with Checkpointer(store_path, policy=EveryK(100)) as ckpt:
        ckpt.save(1, state)
        for step in (2, 3):
            state[f"layer{step}"]["p0"][5] += 1
            state["table"][step] += 1
            assert ckpt.save(step, state).kind == "delta"
        info = ckpt.compact(3)
        assert info.done and info.chain_length == 3
        base = ckpt.store.compacted(3)
        assert base is not None
        files = files_under(os.path.join(store_path, "steps", base.attempt))
        table = [f for f in files if f.startswith("table" + os.sep)]
        assert sorted(set(files) - set(table)) == ["pack.0/c.0", "pack.0/zarr.json", "parts.0", "zarr.json"]
        assert base.tensors["table"].parts[0].pack is None
        small = [r for k, r in base.tensors.items() if k != "table" and r.shape[0:1] != (0,)]
        assert small and all(r.parts[0].pack == "pack.0" for r in small)
        # Every file but the attempt's group document, which no record lists, and the record's
        # own part table.
        assert base.bytes_written == sum(os.path.getsize(os.path.join(store_path, "steps", base.attempt, f))
                                         for f in files if f not in ("zarr.json", "parts.0"))
        ckpt.gc(Retention(keep_last=1), grace_seconds=0)
        assert ckpt.verify().ok
        assert_same_state(ckpt.load(3), state)
