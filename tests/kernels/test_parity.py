"""Parity of the change-tracking kernels: Triton vs the CPU reference vs the ``xxhash`` library.

The Triton kernels run here on CPU tensors through Triton's interpreter, which is chosen when
triton is first imported; hence the environment line above the imports. Without triton the
Triton tests skip and the reference is still checked against ``xxhash``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from deltackpt import kernels  # noqa: E402
from deltackpt.kernels import reference  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]
# Shapes whose row sizes hit every branch of XXH64 for every dtype: no rows, empty rows, rows
# shorter than one 32-byte stripe, exactly one, and longer ones with 8-, 4- and 1-byte tails.
SHAPES = [(0, 4), (3, 0), (1, 1), (1, 8), (3, 7), (5, 9), (4, 31), (6, 33), (2, 67)]
# (bytes, chunk_bytes): nothing, one short chunk, exact multiples, and short last chunks.
CHUNKINGS = [(0, 8), (5, 64), (64, 32), (100, 32), (1000, 96), (999, 333), (257, 1)]


@pytest.fixture(scope="module")
def tk():
    """The Triton kernel module, or a skip when triton is not installed."""
    pytest.importorskip("triton")
    from deltackpt.kernels import triton_kernels

    return triton_kernels


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    # Random bit patterns rather than random values, so NaN payloads and subnormals are covered:
    # the hash is of bytes, not numbers.
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g
    )
    return raw.view(dtype).reshape(shape)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _xxh64(data: bytes) -> int:
    """The xxhash library's XXH64 (seed 0) as the int64 bit pattern the kernels return."""
    h = xxhash.xxh64_intdigest(data)
    return h - (1 << 64) if h >= 1 << 63 else h


def _oracle_rows(t: torch.Tensor) -> torch.Tensor:
    raw = _raw(t)
    n = len(raw) // t.shape[0] if t.shape[0] else 0
    return torch.tensor(
        [_xxh64(raw[i * n : (i + 1) * n]) for i in range(t.shape[0])], dtype=torch.int64
    )


def _oracle_chunks(t: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    raw = _raw(t)
    return torch.tensor(
        [_xxh64(raw[i : i + chunk_bytes]) for i in range(0, len(raw), chunk_bytes)],
        dtype=torch.int64,
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal compares values, and NaN != NaN; the kernels promise identical bytes.
    return a.shape == b.shape and a.dtype == b.dtype and _raw(a) == _raw(b)


# Reference vs xxhash: these run without triton.


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_rows_match_xxhash(dtype, shape):
    t = _random(shape, dtype)
    assert torch.equal(reference.hash_rows(t), _oracle_rows(t))


@pytest.mark.parametrize("nbytes, chunk_bytes", CHUNKINGS)
def test_reference_chunks_match_xxhash(nbytes, chunk_bytes):
    t = _random((nbytes,), torch.uint8)
    assert torch.equal(reference.hash_chunks(t, chunk_bytes), _oracle_chunks(t, chunk_bytes))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), chunk_bytes=st.integers(1, 80))
def test_reference_matches_xxhash_on_any_bytes(data, chunk_bytes):
    t = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    assert torch.equal(reference.hash_chunks(t, chunk_bytes), _oracle_chunks(t, chunk_bytes))
    assert reference.hash_rows(t[None]).item() == _xxh64(data)


def test_reference_marks_with_int32_ids():
    mask = torch.zeros(6, dtype=torch.bool)
    reference.mark_rows(mask, torch.tensor([4, 1], dtype=torch.int32))
    assert mask.tolist() == [False, True, False, False, True, False]


# Triton (interpreted) vs reference vs xxhash.


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_rows(tk, dtype, shape):
    t = _random(shape, dtype, seed=1)
    got = tk.hash_rows(t)
    assert torch.equal(got, reference.hash_rows(t))
    assert torch.equal(got, _oracle_rows(t))


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((7,), torch.int64),
        ((5,), torch.uint8),
        ((4, 3, 5), torch.float16),
        ((3, 2, 11), torch.bfloat16),
    ],
    ids=str,
)
def test_triton_rows_of_other_ranks(tk, shape, dtype):
    t = _random(shape, dtype, seed=2)
    assert torch.equal(tk.hash_rows(t), _oracle_rows(t))


def test_triton_many_rows_span_several_programs(tk):
    t = _random((2100, 3), torch.uint8, seed=12)
    assert torch.equal(tk.hash_rows(t), _oracle_rows(t))


@pytest.mark.parametrize("nbytes, chunk_bytes", CHUNKINGS)
def test_triton_chunks(tk, nbytes, chunk_bytes):
    t = _random((nbytes,), torch.uint8, seed=3)
    got = tk.hash_chunks(t, chunk_bytes)
    assert torch.equal(got, reference.hash_chunks(t, chunk_bytes))
    assert torch.equal(got, _oracle_chunks(t, chunk_bytes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_triton_chunks_of_wider_dtypes(tk, dtype):
    t = _random((5, 13), dtype, seed=4)
    chunk_bytes = 24  # a multiple of every element size here that leaves a short last chunk
    assert torch.equal(tk.hash_chunks(t, chunk_bytes), _oracle_chunks(t, chunk_bytes))


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8], ids=str)
def test_triton_mark_rows(tk, mask_dtype, ids_dtype):
    ids = torch.tensor([3, 0, 3, 36, -2, -30, 17, 17], dtype=ids_dtype)  # duplicates, both ends
    got = torch.zeros(37, dtype=mask_dtype)
    want = torch.zeros(37, dtype=mask_dtype)
    tk.mark_rows(got, ids)
    reference.mark_rows(want, ids)
    assert torch.equal(got, want)
    assert got.nonzero().flatten().tolist() == [0, 3, 7, 17, 35, 36]  # -2 is row 35, -30 row 7


def test_triton_mark_rows_strided_and_empty(tk):
    base = torch.zeros(20, dtype=torch.uint8)
    tk.mark_rows(base[::2], torch.tensor([1, 4]))
    tk.mark_rows(base[::2], torch.empty(0, dtype=torch.int64))
    assert base.nonzero().flatten().tolist() == [2, 8]


def test_triton_mark_rows_many_ids(tk):
    ids = torch.randint(-6000, 6000, (9000,), generator=torch.Generator().manual_seed(13))
    got = torch.zeros(6000, dtype=torch.bool)
    want = torch.zeros(6000, dtype=torch.bool)
    tk.mark_rows(got, ids)
    reference.mark_rows(want, ids)
    assert torch.equal(got, want)


def test_triton_mark_rows_skips_out_of_range_ids(tk):
    mask = torch.zeros(4, dtype=torch.bool)
    tk.mark_rows(mask, torch.tensor([4, -5, 2, 1000]))
    assert mask.tolist() == [False, False, True, False]


@pytest.mark.parametrize("shape", [(0, 3), (1, 1), (5, 3), (9, 33), (4, 0)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_gather_rows(tk, dtype, shape):
    t = _random(shape, dtype, seed=5)
    ids = torch.randint(0, max(shape[0], 1), (11,), generator=torch.Generator().manual_seed(6))
    if not shape[0]:
        ids = ids[:0]
    for i in (ids, ids.int()):
        assert _same_bits(tk.gather_rows(t, i), reference.gather_rows(t, i))


def test_triton_gather_rows_misaligned_and_higher_rank(tk):
    # A uint8 view starting one byte into its storage forces the byte-wide copy path.
    t = _random((61,), torch.uint8, seed=7)[1:].reshape(4, 3, 5)
    ids = torch.tensor([3, 0, 3, 2])
    assert _same_bits(tk.gather_rows(t, ids), reference.gather_rows(t, ids))
    # Rows wider than one copy tile take several steps of the column loop.
    t = _random((2 * 70001 + 1,), torch.uint8, seed=7)[1:].reshape(2, 70001)
    assert _same_bits(tk.gather_rows(t, ids % 2), reference.gather_rows(t, ids % 2))
    t = _random((6, 2, 3), torch.float16, seed=8)
    assert _same_bits(tk.gather_rows(t, ids), reference.gather_rows(t, ids))


def test_triton_gather_rows_many_ids(tk):
    # One-word rows put the most ids in a program; this many need more than one.
    t = _random((100, 1), torch.int64, seed=14)
    ids = torch.randint(0, 100, (70000,), generator=torch.Generator().manual_seed(15))
    assert _same_bits(tk.gather_rows(t, ids), reference.gather_rows(t, ids))


def test_triton_gather_rows_zeroes_out_of_range_rows(tk):
    t = torch.arange(1, 7, dtype=torch.int32).reshape(3, 2)
    assert tk.gather_rows(t, torch.tensor([2, 3, -1])).tolist() == [[5, 6], [0, 0], [0, 0]]


# Dispatch in deltackpt.kernels.


def test_torch_backend_is_the_reference_on_cpu():
    t = _random((4, 10), torch.float32, seed=9)
    ids = torch.tensor([1, 3])
    assert torch.equal(kernels.hash_rows(t, backend="torch"), reference.hash_rows(t))
    assert torch.equal(kernels.hash_chunks(t, 12, backend="torch"), reference.hash_chunks(t, 12))
    assert torch.equal(kernels.gather_rows(t, ids, backend="torch"), t[ids])
    mask = torch.zeros(4, dtype=torch.bool)
    kernels.mark_rows(mask, ids, backend="torch")
    assert mask.tolist() == [False, True, False, True]


def test_auto_backend_on_cpu_is_the_reference():
    t = _random((3, 5), torch.int32, seed=10)
    assert torch.equal(kernels.hash_rows(t), _oracle_rows(t))


def test_triton_backend_through_the_api_on_a_strided_tensor(tk):
    t = _random((9, 6), torch.float16, seed=11).t()  # not contiguous: the API copies it first
    assert torch.equal(kernels.hash_rows(t, backend="triton"), _oracle_rows(t))
    assert torch.equal(kernels.hash_chunks(t, 10, backend="triton"), _oracle_chunks(t, 10))


@pytest.mark.parametrize(
    "call",
    [
        lambda t: kernels.hash_rows(t, backend="cuda"),
        lambda t: kernels.hash_chunks(t, 4, backend=""),
        lambda t: kernels.mark_rows(
            torch.zeros(2, dtype=torch.bool), torch.tensor([0]), backend="Torch"
        ),
        lambda t: kernels.gather_rows(t, torch.tensor([0]), backend=None),
    ],
)
def test_bad_backend_raises(call):
    with pytest.raises(ValueError, match="backend must be one of"):
        call(torch.zeros(2, 2))


@pytest.mark.parametrize("chunk_bytes", [0, -4, 6])
def test_hash_chunks_rejects_bad_chunk_bytes(chunk_bytes):
    with pytest.raises(ValueError, match="chunk_bytes"):
        kernels.hash_chunks(torch.zeros(8, dtype=torch.float32), chunk_bytes)


def test_hash_rows_rejects_a_0d_tensor():
    with pytest.raises(ValueError, match="0-d"):
        kernels.hash_rows(torch.tensor(1.0))


def test_hashing_keeps_torchs_thread_count():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference.hash_rows(torch.zeros(4096, 64))
        reference.hash_chunks(torch.zeros(1 << 20), 4096)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
