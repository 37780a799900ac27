"""Triton kernels of row-wise quantization, the same arithmetic as the CPU reference.

One program quantizes ``BLOCK_R`` rows, each whole in registers (``BLOCK_W`` = the row width
rounded up to a power of two), so a row is read from memory once for its range and held for its
codes. Every step is float32 and rounds as :mod:`deltackpt.kernels.rowwise_reference` does, so
without the adaptive range both write the same bytes; with it, the L2 losses are summed in another
order, so a near tie between moving the low or the high end may go the other way (both stay
within their recorded bounds). Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import rowwise_reference as ref

_MAGIC = tl.constexpr(float(ref.MAGIC))
_ARITH_EPS = tl.constexpr(float(ref.ARITH_EPS))
_GREEDY_BINS = tl.constexpr(float(ref.GREEDY_BINS))
_GREEDY_STEPS = tl.constexpr(ref.GREEDY_STEPS)


@triton.jit
def _codes(x, bias, inv, levels):
    t = (x - bias[:, None]) * inv[:, None]
    t = tl.minimum(tl.maximum(t, 0.0), levels)
    return (t + _MAGIC) - _MAGIC


@triton.jit
def _inverse(scale):
    safe = tl.where(scale > 0.0, scale, 1.0)
    return tl.where(scale > 0.0, 1.0 / safe, 0.0)


@triton.jit
def _loss(x, live, lo, hi, levels):
    scale = (hi - lo) / levels
    inv = _inverse(scale)
    e = x - (_codes(x, lo, inv, levels) * scale[:, None] + lo[:, None])
    e = tl.where(live, e, 0.0)
    return tl.sum(e * e, axis=1)


@triton.jit
def _quantize_kernel(x, codes, scales, biases, bounds, n_rows, width, code_bytes, out_eps,
                     BITS: tl.constexpr, ADAPTIVE: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    levels = (1 << BITS) - 1.0
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_W)
    row_live = r < n_rows
    live = row_live[:, None] & (c < width)[None, :]
    v = tl.load(x + r[:, None] * width + c[None, :], mask=live, other=0.0).to(tl.float32)
    mn = tl.min(tl.where(live, v, float("inf")), axis=1)
    mx = tl.max(tl.where(live, v, float("-inf")), axis=1)
    # Rows past the end (masked out) get a range of 0, not [inf, -inf].
    mn = tl.where(row_live, mn, 0.0)
    mx = tl.where(row_live, mx, 0.0)
    finite = tl.sum(tl.where(live & ((v != v) | (tl.abs(v) == float("inf"))), 1, 0), axis=1) == 0
    lo = mn
    hi = mx
    if ADAPTIVE:
        step = (hi - lo) / _GREEDY_BINS
        best = _loss(v, live, lo, hi, levels)
        best_lo = lo
        best_hi = hi
        for _ in range(_GREEDY_STEPS):
            left = _loss(v, live, lo + step, hi, levels)
            right = _loss(v, live, lo, hi - step, levels)
            go_left = left < right
            lo = tl.where(go_left, lo + step, lo)
            hi = tl.where(go_left, hi, hi - step)
            cur = tl.where(go_left, left, right)
            better = cur < best
            best = tl.where(better, cur, best)
            best_lo = tl.where(better, lo, best_lo)
            best_hi = tl.where(better, hi, best_hi)
        # A constant row keeps its range (the reference does not search it).
        lo = tl.where(mx > mn, best_lo, mn)
        hi = tl.where(mx > mn, best_hi, mx)
    scale = (hi - lo) / levels
    bias = lo
    if HALF:
        scale = scale.to(tl.float16).to(tl.float32)
        bias = bias.to(tl.float16).to(tl.float32)
    ok = finite & (tl.abs(scale) < float("inf")) & (tl.abs(bias) < float("inf"))
    ok = ok & (scale == scale) & (bias == bias)
    inv = _inverse(scale)
    k = tl.arange(0, BLOCK_W // PER) if PER > 1 else c
    byte = tl.zeros([BLOCK_R, BLOCK_W // PER], tl.int32)
    for t in tl.static_range(PER):
        j = k * PER + t
        m = row_live[:, None] & (j < width)[None, :]
        xv = tl.load(x + r[:, None] * width + j[None, :], mask=m, other=0.0).to(tl.float32)
        q = _codes(xv, bias, inv, levels).to(tl.int32)
        byte = byte | tl.where(m, q << (t * BITS), 0)
    k_live = row_live[:, None] & (k < code_bytes)[None, :]
    tl.store(codes + r[:, None] * code_bytes + k[None, :], byte.to(tl.uint8), mask=k_live)
    top = bias + scale * levels
    mag = tl.maximum(tl.maximum(tl.abs(mn), tl.abs(mx)), tl.maximum(tl.abs(bias), tl.abs(top)))
    bound = tl.maximum(tl.maximum(scale / 2.0, bias - mn), mx - top) + mag * (_ARITH_EPS + out_eps)
    tl.store(scales + r, scale, mask=row_live)
    tl.store(biases + r, bias, mask=row_live)
    tl.store(bounds + r, tl.where(ok, bound, float("nan")), mask=row_live)


@triton.jit
def _dequantize_kernel(codes, scales, biases, out, n_rows, width, code_bytes,
                       BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_W)
    live = (r < n_rows)[:, None] & (c < width)[None, :]
    b = tl.load(codes + r[:, None] * code_bytes + (c // PER)[None, :], mask=live, other=0)
    q = (b.to(tl.int32) >> ((c % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
    scale = tl.load(scales + r, mask=r < n_rows, other=0.0)
    bias = tl.load(biases + r, mask=r < n_rows, other=0.0)
    y = q.to(tl.float32) * scale[:, None] + bias[:, None]
    tl.store(out + r[:, None] * width + c[None, :], y, mask=live)


INTERPRETED = not isinstance(_quantize_kernel, triton.runtime.JITFunction)
_TILE = 1 << 14 if INTERPRETED else 4096  # elements a program holds


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
                         f"triton is imported), got a tensor on {t.device}")


def _blocks(width: int) -> tuple[int, int]:
    bw = triton.next_power_of_2(max(width, 4))
    return max(1, _TILE // bw), bw


def quantize(x: torch.Tensor, bits: int, adaptive: bool, half: bool, out_eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused rows and bounds of a contiguous 2-D float tensor (see ``rowwise.quantize_rows``)."""
    _check_device(x)
    rows, width = x.shape
    code_bytes = -(-width * bits // 8)
    sd = torch.float16 if half else torch.float32
    codes = torch.zeros((rows, code_bytes), dtype=torch.uint8, device=x.device)
    scales = torch.zeros(rows, dtype=torch.float32, device=x.device)
    biases = torch.zeros(rows, dtype=torch.float32, device=x.device)
    bounds = torch.zeros(rows, dtype=torch.float32, device=x.device)
    if rows and width:
        br, bw = _blocks(width)
        _quantize_kernel[(triton.cdiv(rows, br),)](
            x, codes, scales, biases, bounds, rows, width, code_bytes, out_eps,
            BITS=bits, ADAPTIVE=adaptive, HALF=half, BLOCK_R=br, BLOCK_W=bw)
    tail = torch.cat([scales.to(sd)[:, None].view(torch.uint8), biases.to(sd)[:, None].view(torch.uint8)], 1)
    return torch.cat([codes, tail], 1), bounds


def dequantize(packed: torch.Tensor, bits: int, width: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """float32 ``[rows, width]`` decoded from fused rows."""
    _check_device(packed)
    rows = packed.shape[0]
    size = scale_dtype.itemsize
    n = packed.shape[1] - 2 * size
    scales = packed[:, n : n + size].flatten().clone().view(scale_dtype).float()
    biases = packed[:, n + size :].flatten().clone().view(scale_dtype).float()
    out = torch.empty((rows, width), dtype=torch.float32, device=packed.device)
    if rows and width:
        br, bw = _blocks(width)
        _dequantize_kernel[(triton.cdiv(rows, br),)](
            packed[:, :n].contiguous(), scales, biases, out, rows, width, n,
            BITS=bits, BLOCK_R=br, BLOCK_W=bw)
    return out
