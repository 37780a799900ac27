"""ChainReader: any box of a tensor from a chain of records, every chunk checked on the way."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deltackpt import Checkpointer, IntegrityError, MemoryStorage
from deltackpt.format.layout import STEPS
from deltackpt.io.reader import ChainReader
from deltackpt.io.staging import StagingPool
from deltackpt.sharding import Box
from deltackpt.store import Store


def chain_of_two(storage: MemoryStorage) -> torch.Tensor:
    t = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    with Checkpointer(storage, chunk_bytes=256, memory_budget=1024) as ckpt:
        ckpt.save(1, {"t": t})
        t[[3, 40]] += 1
        ckpt.save(2, {"t": t})
    return t


def test_a_box_reads_from_the_base_and_the_delta():
    storage = MemoryStorage()
    t = chain_of_two(storage)
    chain = Store(storage).chain(2)
    out = torch.empty(20, 3)
    with ThreadPoolExecutor(2) as ex:
        ChainReader(storage, chain, StagingPool(4, 256), ex).read("t", out, Box((30, 2), (20, 3)))
    assert torch.equal(out, t[30:50, 2:5])


def test_a_corrupt_chunk_is_an_integrity_error():
    storage = MemoryStorage()
    chain_of_two(storage)
    chain = Store(storage).chain(2)
    base = chain[0]
    name = sorted(base.tensors["t"].parts[0].chunks)[0]
    key = f"{STEPS}/{base.attempt}/t/{name}"
    data = bytearray(storage.read(key))
    data[0] ^= 1
    storage.delete(key)
    storage.write(key, [memoryview(bytes(data))])
    with ThreadPoolExecutor(2) as ex, pytest.raises(IntegrityError, match=name):
        ChainReader(storage, chain, StagingPool(4, 256), ex).read("t", torch.empty(64, 8))
