"""The stage seam: once ``stage`` returns, the save reads no live tensor, so training may change
them while the writes finish."""

from __future__ import annotations

import pytest
import torch

import deltackpt.save.saver as saver_module
from deltackpt import Checkpointer, EveryK, MemoryStorage


@pytest.mark.parametrize("dense_chunk_bytes", [64, 1 << 20])
def test_changing_the_state_after_stage_does_not_change_the_step(monkeypatch, dense_chunk_bytes):
    table = torch.randn(300, 16, generator=torch.Generator().manual_seed(0))
    vec = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    state = {"table": table, "vec": vec, "gpu_like": torch.arange(10.0)}
    real_write = saver_module.write

    def scribble_then_write(storage, writers, record, **kw):
        for t in (table, vec, state["gpu_like"]):
            t.fill_(-7.0)  # training moves on while the writes run
        return real_write(storage, writers, record, **kw)

    storage = MemoryStorage()
    with Checkpointer(storage, chunk_bytes=1024, memory_budget=4096,
                      dense_chunk_bytes=dense_chunk_bytes) as ckpt:
        want = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        with monkeypatch.context() as patch:
            patch.setattr(saver_module, "write", scribble_then_write)
            assert ckpt.save(1, state).kind == "base"
        got = ckpt.load(1)
        assert all(torch.equal(got[k], want[k]) for k in want)
        table.copy_(want["table"])
        vec.copy_(want["vec"])
        table[[5, 77]] += 1
        vec[999] += 1
        want = {"table": table.clone(), "vec": vec.clone(), "gpu_like": state["gpu_like"].clone()}
        with monkeypatch.context() as patch:
            patch.setattr(saver_module, "write", scribble_then_write)
            assert ckpt.save(2, state).kind == "delta"
        got = ckpt.load(2)
        assert torch.equal(got["table"], want["table"]) and torch.equal(got["vec"], want["vec"])


@pytest.mark.parametrize("blocking", [True, False])
def test_a_deltas_chunks_and_small_tensors_rows_go_into_the_pack_at_once(monkeypatch, blocking):
    # Small dense tensors, an int one (its chunks coded), one of many chunks (three changed), small
    # 2-d ones (float, bfloat16, int) and a small tracked table whose marked rows' hashes the
    # batch takes: not a put each, one put_packed for each encoding's; the step reads back bit for bit, and
    # the next delta finds exactly the rows changed since.
    from deltackpt import kernels
    from deltackpt.io.writer import StepWriter

    gen = torch.Generator().manual_seed(0)
    state = {f"norm{i}": torch.randn(48, generator=gen) for i in range(40)}
    state["counts"], state["vec"] = torch.arange(100), torch.randn(1000, generator=gen)
    state["w"], state["ids"] = torch.randn(24, 16, generator=gen), torch.arange(60).reshape(20, 3)
    state["half"] = torch.randn(10, 8, generator=gen).to(torch.bfloat16)
    emb = torch.nn.EmbeddingBag(200, 8, mode="sum")
    state["emb"] = emb
    calls = {"put": 0, "put_packed": 0}
    real_put, real_put_packed = StepWriter.put, StepWriter.put_packed

    def put(self, *args, **kwargs):
        calls["put"] += 1
        return real_put(self, *args, **kwargs)

    def put_packed(self, chunks):
        calls["put_packed"] += 1
        return real_put_packed(self, chunks)

    with Checkpointer(MemoryStorage(), chunk_bytes=256, dense_chunk_bytes=64,
                      policy=EveryK(max_delta_fraction=1.0)) as ckpt:
        ckpt.track(emb, prefix="emb")
        ckpt.save(1, state)
        emb(torch.tensor([3, 150]), torch.tensor([0]))  # marks rows 3 and 150
        with torch.no_grad():
            emb.weight[[3, 150]] += 1.0
            for key, t in state.items():
                if key.startswith("norm"):
                    t.add_(1.0)
            state["counts"][7] = -1
            state["vec"][[0, 500, 999]] += 1.0
            state["w"][[0, 5, 23]] += 1.0
            state["ids"][4] = -2
            state["half"][9] += 1
        want = {k: (t.weight if k == "emb" else t).detach().clone() for k, t in state.items()}
        monkeypatch.setattr(StepWriter, "put", put)
        monkeypatch.setattr(StepWriter, "put_packed", put_packed)
        saved = ckpt.save(2, state, blocking=blocking)
        info = saved if blocking else saved.result()
        assert info.kind == "delta" and calls == {"put": 0, "put_packed": 2}  # chunks, rows
        assert torch.equal(ckpt._tracker._refs["emb/weight"].hashes, kernels.hash_rows(emb.weight.detach()))
        got = ckpt.load(2)
        with torch.no_grad():
            emb.weight[[77]] += 1.0
            state["w"][[9]] += 1.0
        emb(torch.tensor([77]), torch.tensor([0]))
        assert ckpt.save(3, state).rows_changed == 2
    assert all(torch.equal(got["emb"]["weight"] if k == "emb" else got[k], want[k]) for k in want)


class _Recorder:
    """Stands for a step writer: what ``describe`` asks it to write."""

    def __init__(self) -> None:
        self.arrays: list[tuple] = []
        self.folders: list[str] = []

    def array(self, key, path, shape, chunks, dtype, *, raw=False) -> None:
        self.arrays.append((key, path, tuple(shape), tuple(chunks), dtype, raw))

    def groups(self, folders) -> None:
        self.folders = list(folders)


def test_describe_writes_the_metadata_of_every_part_not_packed():
    # Large row blocks with a shorter last one, a 2 x 2 grid with uneven cells, a whole large
    # tensor, small packed ones and an empty block: describe looks at each part shape once, and
    # must write what a look at every part writes.
    import pickle

    from deltackpt.format.layout import part_folder
    from deltackpt.save.planner import LocalPlan, make_global_plan
    from deltackpt.save.stage import describe, described
    from deltackpt.save.types import Kind, SavePlan

    rows = 3 * (1 << 18) // 4 + 5  # float32 rows of 4: blocks of ~0.75 MiB and a shorter last one
    items: list[list[tuple]] = [[] for _ in range(4)]
    for r in range(4):
        lo, hi = min(rows, r * (-(-rows // 4))), min(rows, (r + 1) * (-(-rows // 4)))
        items[r].append(("m/rows", "float32", (rows, 4), (lo, 0), (hi - lo, 4)))
        a, b = (0, 700) if r < 2 else (700, 1001)
        c, d = (0, 300) if r % 2 == 0 else (300, 513)
        items[r].append(("m/grid", "bfloat16", (1001, 513), (a, c), (b - a, d - c)))
        items[r].append((f"m/small{r}", "int64", (3, 2), (0, 0), (3, 2)))
    items[0].append(("whole", "float32", (1 << 19,), (0,), (1 << 19,)))
    plan = make_global_plan([LocalPlan.of(r, sorted(it), pickle.dumps({"dict": []}), (1, 1))
                             for r, it in enumerate(items)])
    sizes = (1 << 16, 1 << 14)  # chunks of fewer rows than a part: not packed unless tiny
    save = SavePlan(1, Kind.BASE, "test", "1-a")
    got = _Recorder()
    describe(got, save, plan, sizes)
    want, folders = [], {""}
    for key, t in plan.tensors.items():
        for p in plan.parts_of(key):
            arrays = described(Kind.BASE, getattr(torch, t.dtype), t.global_shape, p.box.shape, sizes)
            want += [(key, f"{p.path}/{a.name}".strip("/"), a.shape, a.chunk_shape, a.dtype, not a.coded)
                     for a in arrays]
            if arrays:
                names = part_folder(key, p.path).split("/")
                folders.update("/".join(names[:i]) for i in range(1, len(names)))
    assert sorted(got.arrays, key=repr) == sorted(want, key=repr)
    assert {a[0] for a in want} == {"m/rows", "m/grid", "whole"} and len(want) > 6
    assert got.folders == sorted(folders)
