"""Row-wise quantization: every decoded element within its row's bound, bounds no looser than
the theory allows, inf/NaN refused, torch's fused layout, and Triton (interpreted) parity."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from deltackpt.kernels import rowwise  # noqa: E402

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
_OUT_EPS = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.fixture(scope="module")
def triton_ok():
    pytest.importorskip("triton")


def _half_ulp16(v: torch.Tensor) -> torch.Tensor:
    # Half the float16 spacing at |v|: the most a round to nearest float16 moves v.
    return torch.maximum(v.abs() * 2.0**-11, torch.full_like(v, 2.0**-25))


def _theory(x: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """(max - min) / (2 (2^b - 1)) per row, plus the rounding of a float16 scale and bias and
    the float32 and output-dtype rounding of values of the row's magnitude."""
    f = x.float().reshape(x.shape[0], -1)
    lo, hi = f.min(1).values, f.max(1).values
    levels = 2**bits - 1
    bound = (hi - lo) / (2 * levels)
    if scale_dtype == torch.float16:
        bound = bound + levels * _half_ulp16((hi - lo) / levels) + _half_ulp16(lo)
    mag = torch.maximum(lo.abs(), hi.abs()) * (1 + 2.0**-8)
    return bound + mag * (2.0**-19 + _OUT_EPS[x.dtype]) + 1e-30


def _within(x: torch.Tensor, y: torch.Tensor, bound: torch.Tensor) -> bool:
    err = (x.float() - y.float()).reshape(x.shape[0], -1).abs()
    return bool((err <= bound[:, None]).all())


rows_strategy = st.tuples(st.integers(1, 9), st.integers(1, 40))


@settings(max_examples=150, deadline=None)
@given(shape=rows_strategy, dtype=st.sampled_from(FLOATS), bits=st.sampled_from([8, 4, 2]),
       adaptive=st.booleans(), scale=st.sampled_from([1e-4, 0.01, 1.0, 300.0]),
       offset=st.sampled_from([0.0, 0.5, -7.0]), constant_row=st.integers(-1, 8),
       seed=st.integers(0, 2**16))
def test_decoded_within_bound(shape, dtype, bits, adaptive, scale, offset, constant_row, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale + offset).to(dtype)
    if 0 <= constant_row < shape[0]:
        x[constant_row] = x[constant_row, 0]
    packed, bound = rowwise.quantize_rows(x, bits, adaptive=adaptive)
    assert packed.shape == (shape[0], rowwise.row_bytes(shape[1], bits, rowwise.default_scale_dtype(bits)))
    y = rowwise.dequantize_rows(packed, bits, shape[1], dtype)
    assert y.dtype == dtype
    assert _within(x, y, bound)
    if not adaptive:
        assert bool((bound <= _theory(x, bits, rowwise.default_scale_dtype(bits))).all())
    if 0 <= constant_row < shape[0] and dtype == torch.float32 and bits == 8:
        assert torch.equal(y[constant_row], x[constant_row])


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_scale_dtype_override(bits, scale_dtype):
    x = torch.randn(20, 33) * 0.01
    packed, bound = rowwise.quantize_rows(x, bits, scale_dtype=scale_dtype)
    assert packed.shape[1] == rowwise.row_bytes(33, bits, scale_dtype)
    y = rowwise.dequantize_rows(packed, bits, 33, torch.float32, scale_dtype=scale_dtype)
    assert _within(x, y, bound)
    assert bool((bound <= _theory(x, bits, scale_dtype)).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_finite_rows_are_refused(bad, backend, request):
    if backend == "triton":
        request.getfixturevalue("triton_ok")
    x = torch.randn(5, 8)
    x[3, 2] = bad
    with pytest.raises(ValueError, match="row 3 holds inf or NaN"):
        rowwise.quantize_rows(x, 4, backend=backend)


def test_rows_past_float16_range_are_refused_with_a_float16_scale():
    x = torch.tensor([[0.0, 1.0], [-1e6, 1e6]])
    with pytest.raises(ValueError, match="row 1 spans .* use a float32 scale"):
        rowwise.quantize_rows(x, 4)
    packed, bound = rowwise.quantize_rows(x, 4, scale_dtype=torch.float32)
    assert _within(x, rowwise.dequantize_rows(packed, 4, 2, torch.float32,
                                              scale_dtype=torch.float32), bound)


def test_adaptive_range_cuts_l2_error_at_low_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 128, generator=g) * 0.01
    errs = {}
    for adaptive in (False, True):
        packed, _ = rowwise.quantize_rows(x, 2, adaptive=adaptive)
        errs[adaptive] = float(((rowwise.dequantize_rows(packed, 2, 128, torch.float32) - x) ** 2).sum())
    assert errs[True] < 0.8 * errs[False]


@pytest.mark.parametrize("bits, unpack", [(8, "embedding_bag_byte_unpack"),
                                          (4, "embedding_bag_4bit_unpack"),
                                          (2, "embedding_bag_2bit_unpack")])
def test_layout_is_torchs_fused_layout(bits, unpack):
    x = torch.randn(30, 64) * 0.1
    packed, bound = rowwise.quantize_rows(x, bits)
    theirs = getattr(torch.ops.quantized, unpack)(packed)
    ours = rowwise.dequantize_rows(packed, bits, 64, torch.float32)
    assert torch.allclose(theirs, ours, rtol=0, atol=1e-6)
    if bits == 8:
        assert torch.equal(packed, torch.ops.quantized.embedding_bag_byte_prepack(x))


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits must be one of"):
        rowwise.quantize_rows(torch.zeros(2, 2), 3)
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        rowwise.quantize_rows(torch.zeros(2, 2, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match=r"uint8 \[rows, 6\]"):
        rowwise.dequantize_rows(torch.zeros(2, 5, dtype=torch.uint8), 4, 4, torch.float32)


def test_empty_and_higher_rank():
    packed, bound = rowwise.quantize_rows(torch.zeros(0, 8), 8)
    assert packed.shape == (0, 16) and bound.shape == (0,)
    x = torch.randn(3, 4, 5)
    packed, bound = rowwise.quantize_rows(x, 8)
    y = rowwise.dequantize_rows(packed, 8, 20, torch.float32).reshape(3, 4, 5)
    assert _within(x, y, bound)


# Triton (interpreted) vs reference.


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (17, 45), (70, 128), (5, 300)], ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_triton_matches_reference(triton_ok, bits, dtype, shape):
    g = torch.Generator().manual_seed(bits * 1000 + shape[1])
    x = (torch.randn(shape, generator=g) * 0.05 + 0.01).to(dtype)
    x[0] = x[0, 0]  # a constant row
    packed, bound = rowwise.quantize_rows(x, bits, backend="torch")
    tp, tb = rowwise.quantize_rows(x, bits, backend="triton")
    assert torch.equal(tp, packed)
    assert torch.equal(tb, bound)
    assert torch.equal(rowwise.dequantize_rows(packed, bits, shape[1], dtype, backend="triton"),
                       rowwise.dequantize_rows(packed, bits, shape[1], dtype, backend="torch"))


@pytest.mark.parametrize("bits", [4, 2])
def test_triton_adaptive_within_bounds_and_as_good(triton_ok, bits):
    # Losses are summed in another order, so a near tie may pick the other end: the two need
    # not agree bit for bit, but each stays within its bound and cuts the error alike.
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(40, 96, generator=g) * 0.02
    errs = []
    for backend in ("torch", "triton"):
        packed, bound = rowwise.quantize_rows(x, bits, adaptive=True, backend=backend)
        y = rowwise.dequantize_rows(packed, bits, 96, torch.float32, backend=backend)
        assert _within(x, y, bound)
        errs.append(float(((y - x) ** 2).sum()))
    assert abs(errs[0] - errs[1]) <= 0.01 * errs[0]
