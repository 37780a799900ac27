"""The stage seam: once ``stage`` returns, the save reads no live tensor, so training may change
them while the writes finish."""

from __future__ import annotations

import pytest
import torch

import deltackpt.save.saver as saver_module
from deltackpt import Checkpointer, MemoryStorage


@pytest.mark.parametrize("dense_chunk_bytes", [64, 1 << 20])
def test_changing_the_state_after_stage_does_not_change_the_step(monkeypatch, dense_chunk_bytes):
    table = torch.randn(300, 16, generator=torch.Generator().manual_seed(0))
    vec = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    state = {"table": table, "vec": vec, "gpu_like": torch.arange(10.0)}
    real_write = saver_module.write

    def scribble_then_write(storage, writers, record):
        for t in (table, vec, state["gpu_like"]):
            t.fill_(-7.0)  # training moves on while the writes run
        return real_write(storage, writers, record)

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
