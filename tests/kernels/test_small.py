"""The small-input hash path (the ``xxhash`` library, no compiled kernels) against the reference,
and the package importing without numba."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import assert_runs_fresh

from deltackpt import kernels
from deltackpt.kernels import reference, small

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8, torch.bool]
SHAPES = [(0, 4), (3, 0), (1, 1), (1, 8), (3, 7), (5, 9), (4, 31), (6, 33), (2, 67), (512, 3), (7, 2, 5)]
CHUNKINGS = [(0, 8), (5, 64), (64, 32), (100, 32), (1000, 96), (999, 333), (257, 1), (1 << 20, 4096)]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_small_rows_equal_the_reference(dtype, shape):
    t = _random(shape, dtype)
    assert small.fits(t, t.shape[0])
    got = small.hash_rows(t)
    assert got.dtype == torch.int64 and torch.equal(got, reference.hash_rows(t))
    assert torch.equal(kernels.hash_rows(t), got)


@pytest.mark.parametrize(("nbytes", "chunk_bytes"), CHUNKINGS)
def test_small_chunks_equal_the_reference(nbytes, chunk_bytes):
    t = _random((nbytes,), torch.uint8, seed=nbytes)
    got = small.hash_chunks(t, chunk_bytes)
    assert torch.equal(got, reference.hash_chunks(t, chunk_bytes))
    assert torch.equal(kernels.hash_chunks(t, chunk_bytes), got)


def test_strided_input_hashes_its_c_order_bytes():
    t = _random((9, 6), torch.float32, seed=3).t()
    assert torch.equal(small.hash_rows(t), reference.hash_rows(t.contiguous()))
    assert torch.equal(small.hash_chunks(t, 12), reference.hash_chunks(t.contiguous(), 12))


@pytest.mark.parametrize("dtype", DTYPES)
def test_flat_bytes_are_the_c_order_bytes_of_any_tensor(dtype):
    """Through numpy where it has the dtype, else through torch's views: the same bytes for a
    contiguous, a strided, a 0-d and an empty tensor and one that requires grad."""
    t = _random((6, 5), dtype, seed=7) if dtype != torch.bool else _random((6, 5), torch.uint8, seed=7) % 2 == 1
    cases = [t, t.t(), t[::2, 1:], t[:, 1], t.reshape(-1)[::3], t[2, 3], t[:0]]
    if dtype.is_floating_point:
        cases.append(t.clone().requires_grad_())
    for c in cases:
        want = c.detach().contiguous().reshape(-1).view(torch.uint8)
        got = small.flat_bytes(c)
        assert got.dtype == np.uint8 and got.ndim == 1 and got.tobytes() == want.numpy().tobytes()


def test_only_small_inputs_fit():
    assert small.fits(torch.zeros(small.SMALL_PIECES, 4), small.SMALL_PIECES)
    assert not small.fits(torch.zeros(small.SMALL_PIECES + 1, 4), small.SMALL_PIECES + 1)
    assert not small.fits(torch.zeros(small.SMALL_BYTES + 1, dtype=torch.uint8), 1)
    assert not small.fits(torch.zeros(2, 2, device="meta"), 2)


def test_bad_backend_is_refused_on_small_inputs_too():
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.hash_rows(torch.zeros(2, 2), backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.hash_chunks(torch.zeros(4), 4, backend="")


def test_import_and_small_hashes_leave_numba_unloaded():
    code = ("import sys, torch, deltackpt\n"
            "from deltackpt import kernels\n"
            "assert 'numba' not in sys.modules, 'import deltackpt loaded numba'\n"
            "kernels.hash_rows(torch.zeros(100, 16)); kernels.hash_chunks(torch.zeros(1000), 64)\n"
            "assert 'numba' not in sys.modules, 'a small hash loaded numba'\n"
            "kernels.hash_rows(torch.zeros(4096, 16))\n"
            "assert 'numba' in sys.modules\n")
    assert_runs_fresh(code)


def test_small_saves_and_restores_leave_numba_unloaded(tmp_path):
    """The first saves and restores of a fresh process run beside the kernels' warm-up: one of
    a small state that needed the compiled kernels' module would wait for numba's import (a
    first one-row delta took 0.15 s instead of 0.035 s, a restore 0.4 s instead of 0.03 s).
    Here no warm-up runs, so any such need shows."""
    code = ("import sys, torch, deltackpt, deltackpt.checkpointer as c\n"
            "c.warm_kernels = lambda: None\n"
            "state = {'w': torch.randn(256, 64), 'b': torch.randn(64), 'step': 1}\n"
            "with deltackpt.Checkpointer(sys.argv[1]) as ckpt:\n"
            "    ckpt.save(0, state)\n"
            "    state['w'][3] += 1\n"
            "    assert ckpt.save(1, state).kind == 'delta'\n"
            "    assert ckpt.load(1)['w'].equal(state['w'])\n"
            "    into = {'w': torch.zeros(256, 64), 'b': torch.zeros(64), 'step': 0}\n"
            "    assert ckpt.restore(into) == 1 and into['w'].equal(state['w'])\n"
            "assert 'numba' not in sys.modules, 'a small save loaded numba'\n")
    assert_runs_fresh(code, str(tmp_path))


def test_small_inputs_take_the_compiled_kernels_once_they_are_warm(monkeypatch):
    kernels.warm()

    def refused(*_):
        raise AssertionError("hashed one library call a piece after the compiled kernels were warm")

    monkeypatch.setattr(small, "hash_rows", refused)
    monkeypatch.setattr(small, "hash_chunks", refused)
    t = _random((500, 32), torch.float32)
    assert torch.equal(kernels.hash_rows(t), reference.hash_rows(t))
    assert torch.equal(kernels.hash_chunks(t, 100), reference.hash_chunks(t, 100))
