"""Hashing many small tensors in one call: the same bits as one hash per tensor, on both paths
(the ``xxhash`` library for a few pieces, the compiled kernel that reads each tensor in place)."""

from __future__ import annotations

import math

import numpy as np

import pytest
import torch
import xxhash

from deltackpt import kernels
from deltackpt.kernels import reference, small


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _mixed(n: int) -> tuple[list[torch.Tensor], list[int]]:
    """``n`` tensors of every dtype and odd sizes, each with a piece size it holds whole."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
    shapes = [(), (1,), (7,), (3, 5), (16, 64), (64, 16), (2, 3, 9), (33,)]
    tensors, pieces = [], []
    for i in range(n):
        t = _random(shapes[i % len(shapes)], dtypes[i % len(dtypes)], i)
        tensors.append(t)
        pieces.append(t.nbytes // t.shape[0] if t.dim() >= 2 else t.nbytes)
    return tensors, pieces


def _one_by_one(tensors: list[torch.Tensor], pieces: list[int]) -> torch.Tensor:
    out = []
    for t, p in zip(tensors, pieces):
        b = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out += [xxhash.xxh64_intdigest(b[i:i + p]) for i in range(0, len(b), p)]
    return torch.tensor([h - (1 << 64) if h >= 1 << 63 else h for h in out], dtype=torch.int64)


@pytest.mark.parametrize("n", [1, 5, 48, 3000])
def test_segments_equal_one_hash_per_piece(n):
    tensors, pieces = _mixed(n)
    want = _one_by_one(tensors, pieces)
    assert torch.equal(kernels.hash_segments(tensors, pieces), want)
    sizes = np.array([t.nbytes for t in tensors])
    out = np.empty(int((sizes // pieces).sum()), dtype=np.uint64)
    reference.hash_segments_at(reference.addresses_of(tensors), sizes, np.array(pieces), out)
    assert torch.equal(torch.from_numpy(out.view(np.int64)), want)
    assert torch.equal(small.hash_segments(tensors, pieces), want)


@pytest.mark.parametrize("piece", [1, 100, 4096, 1 << 30])
def test_jobs_of_segments_give_the_hash_together(piece):
    """The jobs threads share (one each for the next tensors of about ``piece`` bytes, run here
    in reverse order) fill in every hash of the one call, and only those."""
    tensors, pieces = _mixed(3000)
    segments = kernels.Segments(tensors, pieces)
    out = torch.full((segments.count,), 7, dtype=torch.int64)
    jobs = segments.jobs(out, piece)
    if piece in (1, 1 << 30):
        assert len(jobs) == (len(tensors) if piece == 1 else 1)
    else:
        assert 1 < len(jobs) < len(tensors)
    for job in reversed(jobs):
        job()
    assert torch.equal(out, _one_by_one(tensors, pieces))


def test_jobs_refuse_a_call_of_the_small_inputs_path():
    segments = kernels.Segments([torch.zeros(4)], [16])
    with pytest.raises(ValueError, match="small inputs' path"):
        segments.jobs(torch.empty(1, dtype=torch.int64), 8)


def test_segments_equal_rows_and_chunks_of_each():
    rows = _random((40, 24), torch.float32, 1)
    flat = _random((1000,), torch.int32, 2)
    got = kernels.hash_segments([rows, flat], [96, 400])
    assert torch.equal(got[:40], kernels.hash_rows(rows))
    assert torch.equal(got[40:], kernels.hash_chunks(flat, 400))


def test_one_changed_element_of_many_tensors_is_found():
    """The change detection this serves: one element of tensor 17,345 of 20,000 changes its hash,
    and no other."""
    tensors = [torch.full((4, 4), float(i)) for i in range(20_000)]
    pieces = [16] * len(tensors)
    before = kernels.hash_segments(tensors, pieces)
    tensors[17_345][2, 1] = torch.nextafter(tensors[17_345][2, 1], torch.tensor(1e9))
    diff = (kernels.hash_segments(tensors, pieces) != before).nonzero().flatten().tolist()
    assert diff == [17_345 * 4 + 2]


def test_views_are_read_where_they_lie():
    base = torch.arange(64, dtype=torch.float32)
    view = base[8:24].view(4, 4)  # contiguous, at an offset into its storage
    assert torch.equal(kernels.hash_segments([view], [16]), kernels.hash_rows(view))


@pytest.mark.parametrize("tensor, piece", [
    (torch.zeros(6, 4).t(), 24),      # not contiguous
    (torch.zeros(10), 12),            # not whole pieces
    (torch.zeros(0, 4), 16),          # no bytes
    (torch.zeros(4), 0),              # no piece size
])
def test_bad_segments_are_refused(tensor, piece):
    with pytest.raises(ValueError, match="cannot hash"):
        kernels.hash_segments([tensor], [piece])
