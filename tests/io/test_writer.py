"""StepWriter: a part's chunks as zarr v3 chunk files (or packed back to back), each with its size
and checksum recorded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from deltackpt.format.encodings import FULL, get, write_block
from deltackpt.format.zarr_meta import codec_for
from deltackpt.io.staging import StagingPool
from deltackpt.io.writer import StepWriter
from deltackpt.storage import MemoryStorage


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
