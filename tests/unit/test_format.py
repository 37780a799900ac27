"""The arrays of a step are standard zarr v3 arrays that zarr-python reads."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
import zarr
from numcodecs import Blosc

from deltackpt import Checkpointer


def read(path, step: int, key: str, attempt_of) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # commits/ is not a zarr node; zarr says so
        return zarr.open_array(os.path.join(path, "steps", attempt_of(step), key), mode="r")[...]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8])
def test_base_arrays_and_delta_packs_read_with_zarr(store_path, dtype):
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 2, (1001, 3), generator=gen).to(dtype)
    vec = torch.randint(0, 2, (517,), generator=gen).to(dtype)
    with Checkpointer(store_path, chunk_bytes=1000, memory_budget=4000, dense_chunk_bytes=64) as ckpt:
        ckpt.save(0, {"t": table, "v": vec, "s": torch.tensor(3, dtype=dtype)})
        table[[5, 900]] = torch.full((2, 3), 1 if dtype == torch.bool else 7).to(dtype)
        vec[500] = ~vec[500] if dtype == torch.bool else 9
        ckpt.save(1, {"t": table, "v": vec, "s": torch.tensor(3, dtype=dtype)})
        attempt = lambda s: ckpt.store.manifest(s).attempt  # noqa: E731
        m0, m1 = ckpt.store.manifest(0), ckpt.store.manifest(1)
    # A delta's chunks, and a base's small parts, lie back to back in a pack, which zarr reads
    # as bytes.
    pack = read(store_path, 1, "pack.0", attempt)
    assert set(m1.packs) == {"pack.0"} and pack.dtype == np.uint8

    def chunk(key: str, name: str, np_dtype, m=m1, pack=pack) -> np.ndarray:
        size, _, at = m.tensors[key].parts[0].chunks[name]
        data = pack[at : at + size].tobytes()
        if np_dtype in (np.int64, np.bool_, np.uint8):  # integer arrays are blosc-coded
            data = Blosc().decode(data)
        return np.frombuffer(data, np_dtype)

    np_dtype = table.numpy().dtype.type
    assert m0.tensors["s"].parts[0].pack == "pack.0"  # one element: packed
    got = chunk("s", "c", np_dtype, m0, read(store_path, 0, "pack.0", attempt))
    np.testing.assert_array_equal(got, [1 if dtype == torch.bool else 3])
    np.testing.assert_array_equal(chunk("t", "ids/c.0", np.int64), [5, 900])
    np.testing.assert_array_equal(chunk("t", "rows/c.0.0", np_dtype).reshape(2, 3), table[[5, 900]].numpy())
    # A dense delta holds only the changed chunk.
    # About 64 B a chunk, split evenly: 517 elements in chunks of ceil(517 / ceil(517 / (64 / itemsize))).
    target = 64 // vec.element_size()
    per_chunk = -(-517 // -(-517 // target))
    assert m1.tensors["v"].parts[0].chunk_shape == (per_chunk,)
    assert set(m1.tensors["v"].parts[0].chunks) == {f"c.{500 // per_chunk}"}
    lo = 500 // per_chunk * per_chunk
    want = vec[lo : lo + per_chunk].numpy()  # the edge chunk, zero-padded as zarr stores it
    want = np.concatenate([want, np.zeros(per_chunk - want.size, want.dtype)])
    np.testing.assert_array_equal(chunk("v", f"c.{500 // per_chunk}", np_dtype), want)


def test_bfloat16_is_stored_as_its_bits(store_path):
    w = torch.randn(10, 4).bfloat16()
    with Checkpointer(store_path, chunk_bytes=16) as ckpt:  # two rows a chunk: a zarr array
        ckpt.save(0, {"w": w})
        arr = zarr.open_array(os.path.join(store_path, "steps", ckpt.store.manifest(0).attempt, "w"))
    assert arr.dtype == np.uint16 and arr.attrs["torch_dtype"] == "bfloat16"
    assert torch.equal(torch.from_numpy(arr[...]).view(torch.bfloat16), w)
