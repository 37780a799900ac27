"""Reading many small tensors: each one's few reads run on the calling thread (a hand-off to the
I/O threads costs more than they do), with every check the threaded path makes."""

from __future__ import annotations

import os

import pytest
import torch

from deltackpt import Checkpointer
from deltackpt.errors import IntegrityError
from deltackpt.io.reader import INLINE_BYTES, ChainReader
from helpers import same_bits


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    state = {f"s{i}": torch.randn(8, 8, generator=gen) for i in range(200)}
    state["big"] = torch.randn(INLINE_BYTES // 4 + 1, generator=gen)  # one element over: threaded
    return state


SMALL_CHUNKS = {"chunk_bytes": 1 << 14, "dense_chunk_bytes": 1 << 14}  # "big" in 5 chunks


class _Counting:
    """An executor's ``submit``, counted."""

    def __init__(self, executor):
        self.submit_to, self.calls = executor.submit, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.submit_to(*args, **kwargs)


def test_small_tensors_are_read_on_the_calling_thread(store_path):
    state = _state()
    with Checkpointer(store_path, **SMALL_CHUNKS) as ckpt:
        ckpt.save(1, state)
        state["s7"][3, 3] += 1
        assert ckpt.save(2, state).kind == "delta"
    with Checkpointer(store_path, create=False) as ckpt:
        counted = _Counting(ckpt._executor)
        ckpt._executor.submit = counted
        small = ckpt.load(2, keys=[f"s{i}" for i in range(200)])
        assert counted.calls == 0
        big = ckpt.load(2, keys=["big"])
        assert counted.calls > 0  # the chunks past the one the calling thread reads first
    assert all(same_bits(small[k], state[k]) for k in small) and same_bits(big["big"], state["big"])


def test_a_damaged_pack_is_caught_on_the_calling_thread(store_path):
    state = _state()
    with Checkpointer(store_path) as ckpt:
        ckpt.save(1, state)
        m = ckpt.store.manifest(1)
    entry = m.tensors["s150"].parts[0].chunks["c.0.0"]
    pack = os.path.join(store_path, "steps", m.attempt, "pack.0", "c.0")
    with open(pack, "r+b") as f:
        f.seek(entry[2] + 5)
        byte = f.read(1)
        f.seek(entry[2] + 5)
        f.write(bytes([byte[0] ^ 1]))
    with Checkpointer(store_path, create=False) as ckpt:
        assert same_bits(ckpt.load(1, keys=["s149"])["s149"], state["s149"])
        with pytest.raises(IntegrityError, match="s150"):
            ckpt.load(1)


def test_a_chain_reads_only_the_delta_parts_that_changed(store_path, monkeypatch):
    """A delta lists every tensor; replaying a chain reads the row ids of the parts that changed
    and nothing of the others, and the state comes back bit-exact."""
    state = _state()
    with Checkpointer(store_path) as ckpt:
        ckpt.save(1, state)
        state["s7"][3, 3] += 1
        assert ckpt.save(2, state).kind == "delta"
        state["s9"][0, 1] += 1
        state["s7"][5, 0] += 1
        assert ckpt.save(3, state).kind == "delta"
    read = []
    real = ChainReader._read_ids

    def counted(self, m, key, part):
        read.append((m.step, key))
        return real(self, m, key, part)

    monkeypatch.setattr(ChainReader, "_read_ids", counted)
    with Checkpointer(store_path, create=False) as ckpt:
        back = ckpt.load(3)
    assert sorted(read) == [(2, "s7"), (3, "s7"), (3, "s9")]
    assert all(same_bits(back[k], state[k]) for k in state)
