"""CPU reference of row-wise quantization: the CPU path and the oracle of the Triton kernels.

Each row of a float matrix is stored as ``bits``-bit codes with one scale and one bias
(asymmetric: ``x ~ q * scale + bias``, ``q`` in ``[0, 2**bits - 1]``), in the fused layout of
torch's ``embedding_bag_byte_prepack`` / ``embedding_bag_4bit_prepack`` /
``embedding_bag_2bit_prepack``: the row's codes packed low bits first (element ``j`` in byte
``j * bits // 8``), then the scale, then the bias, each float32 or float16.

Every arithmetic step is float32 and rounds as the Triton kernels do (round half to even by the
``1.5 * 2**23`` trick, float16 by round to nearest even), so both backends write the same bytes.
Next to each row it returns the row's error bound: ``max(scale / 2, bias - min, max - top)``
(``top = bias + scale * (2**bits - 1)``; the last two are nonzero only when the range was narrowed
or rounded inward) plus the float32 arithmetic's and the output dtype's rounding of values of the
row's magnitude. A row with a non-finite value, or whose scale or bias overflows float16, gets a
NaN bound, which the caller turns into an error: such rows are never stored silently wrong.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, njit, prange, uint8, uint64

MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: (v + MAGIC) - MAGIC rounds v to an even tie
HALF_MIN_NORMAL = 2.0**-14
HALF_QUANTUM_SUBNORMAL = 2.0**-24
HALF_OVERFLOW = 65520.0  # the smallest magnitude float16 rounds to infinity
ARITH_EPS = np.float32(2.0**-20)  # float32 arithmetic error of quantize + dequantize, relative
GREEDY_BINS = 200  # the adaptive range moves in steps of 1/GREEDY_BINS of the row's range ...
GREEDY_STEPS = 32  # ... this many times, cutting at most 16% of it


@njit(inline="always")
def _half(v):
    # The float16 value nearest to v (ties to even), as a float32; infinite past float16's range.
    a = abs(float(v))
    if a >= HALF_OVERFLOW:
        return float32(math.copysign(math.inf, v))
    if a < HALF_MIN_NORMAL:
        q = HALF_QUANTUM_SUBNORMAL
    else:
        q = math.ldexp(1.0, math.frexp(a)[1] - 11)
    return float32(np.rint(float(v) / q) * q)


@njit(inline="always")
def _code(v, bias, inv, levels):
    # The nearest code of v, clamped to [0, levels]; float32 throughout.
    t = (v - bias) * inv
    t = min(max(t, float32(0.0)), levels)
    return (t + MAGIC) - MAGIC


@njit(inline="always")
def _inverse(scale):
    return float32(1.0) / scale if scale > float32(0.0) else float32(0.0)


@njit(inline="always")
def _loss(x, i, lo, hi, levels):
    # Squared L2 error of row i quantized to the range [lo, hi] (float32 scale and bias).
    scale = (hi - lo) / levels
    inv = _inverse(scale)
    s = float32(0.0)
    for j in range(x.shape[1]):
        e = x[i, j] - (_code(x[i, j], lo, inv, levels) * scale + lo)
        s += e * e
    return s


@njit(inline="always")
def _greedy(x, i, lo, hi, levels):
    # Check-N-Run's adaptive range: GREEDY_STEPS times, move whichever end of [lo, hi] inward
    # by one bin that lowers the row's L2 error more; return the range of least error seen.
    step = (hi - lo) / float32(GREEDY_BINS)
    best = _loss(x, i, lo, hi, levels)
    best_lo, best_hi = lo, hi
    for _ in range(GREEDY_STEPS):
        left = _loss(x, i, lo + step, hi, levels)
        right = _loss(x, i, lo, hi - step, levels)
        if left < right:
            lo = lo + step
            cur = left
        else:
            hi = hi - step
            cur = right
        if cur < best:
            best, best_lo, best_hi = cur, lo, hi
    return best_lo, best_hi


@njit(inline="always")
def _pack(xr, cr, bias, inv, levels, bits):
    # The codes of row xr into cr, packed low bits first; the loops are unrolled per bit width
    # and indexed unsigned, so that they compile to vector code (a generic loop over the codes
    # of a byte ran at a third of the speed).
    width = xr.shape[0]
    if bits == 8:
        for j in range(width):
            cr[uint64(j)] = uint8(_code(xr[uint64(j)], bias, inv, levels))
        return
    per = 8 // bits
    full = width // per
    for k in range(full):
        p = uint64(k * per)
        if bits == 4:
            cr[uint64(k)] = (uint8(_code(xr[p], bias, inv, levels))
                             | (uint8(_code(xr[p + uint64(1)], bias, inv, levels)) << uint8(4)))
        else:
            cr[uint64(k)] = (uint8(_code(xr[p], bias, inv, levels))
                             | (uint8(_code(xr[p + uint64(1)], bias, inv, levels)) << uint8(2))
                             | (uint8(_code(xr[p + uint64(2)], bias, inv, levels)) << uint8(4))
                             | (uint8(_code(xr[p + uint64(3)], bias, inv, levels)) << uint8(6)))
    if full * per < width:
        byte = uint8(0)
        for t in range(width - full * per):
            byte |= uint8(_code(xr[uint64(full * per + t)], bias, inv, levels)) << uint8(t * bits)
        cr[uint64(full)] = byte


@njit(parallel=True, cache=True, nogil=True)
def _quantize(x, bits, adaptive, half, out_eps, codes, scales, biases, bounds):
    levels = float32((1 << bits) - 1)
    for i in prange(x.shape[0]):
        xr = x[i]
        mn = xr[0]
        mx = xr[0]
        poison = float32(0.0)  # stays 0 unless the row holds inf or NaN (inf * 0 is NaN)
        for v in xr:
            mn = min(mn, v)
            mx = max(mx, v)
            poison += v * float32(0.0)
        if poison != float32(0.0):
            bounds[i] = np.nan
            continue
        lo, hi = mn, mx
        if adaptive and hi > lo:
            lo, hi = _greedy(x, i, lo, hi, levels)
        scale = (hi - lo) / levels
        bias = lo
        if half:
            scale = _half(scale)
            bias = _half(bias)
        if not (math.isfinite(scale) and math.isfinite(bias)):
            bounds[i] = np.nan
            continue
        _pack(xr, codes[i], bias, _inverse(scale), levels, bits)
        scales[i] = scale
        biases[i] = bias
        top = bias + scale * levels
        mag = max(abs(mn), abs(mx), abs(bias), abs(top))
        bounds[i] = max(scale / float32(2.0), bias - mn, mx - top) + mag * (ARITH_EPS + out_eps)


@njit(parallel=True, cache=True, nogil=True)
def _dequantize(codes, scales, biases, bits, out):
    # Unrolled per bit width and indexed unsigned, as _pack: a generic loop over the codes of a
    # byte (``j // per``, ``j % per``) ran at 1 GB/s, these at memory speed.
    width = out.shape[1]
    for i in prange(out.shape[0]):
        scale = float32(scales[i])
        bias = float32(biases[i])
        cr = codes[i]
        orow = out[i]
        if bits == 8:
            for j in range(width):
                orow[uint64(j)] = float32(cr[uint64(j)]) * scale + bias
            continue
        per = 8 // bits
        full = width // per
        for k in range(full):
            b = cr[uint64(k)]
            p = uint64(k * per)
            if bits == 4:
                orow[p] = float32(b & uint8(15)) * scale + bias
                orow[p + uint64(1)] = float32(b >> uint8(4)) * scale + bias
            else:
                orow[p] = float32(b & uint8(3)) * scale + bias
                orow[p + uint64(1)] = float32((b >> uint8(2)) & uint8(3)) * scale + bias
                orow[p + uint64(2)] = float32((b >> uint8(4)) & uint8(3)) * scale + bias
                orow[p + uint64(3)] = float32(b >> uint8(6)) * scale + bias
        for t in range(width - full * per):
            q = (cr[uint64(full)] >> uint8(t * bits)) & uint8((1 << bits) - 1)
            orow[uint64(full * per + t)] = float32(q) * scale + bias


def quantize(x: np.ndarray, bits: int, adaptive: bool, half: bool, out_eps: float) -> tuple[
        np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Quantizes the rows of a C-contiguous float32 matrix.

    Returns:
        ``(codes, scales, biases, bounds)``: uint8 ``[rows, ceil(width * bits / 8)]``, float32
        ``[rows]`` three times (scales and biases hold float16 values when ``half``); a NaN
        bound marks a row that cannot be stored (non-finite, or past float16's range).
    """
    rows, width = x.shape
    codes = np.zeros((rows, -(-width * bits // 8)), np.uint8)
    scales = np.zeros(rows, np.float32)
    biases = np.zeros(rows, np.float32)
    bounds = np.zeros(rows, np.float32)
    if rows and width:
        _quantize(x, bits, adaptive, half, np.float32(out_eps), codes, scales, biases, bounds)
    return codes, scales, biases, bounds


def dequantize(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
               width: int) -> np.ndarray:
    """The float32 rows ``q * scale + bias`` of codes made by :func:`quantize`."""
    out = np.empty((codes.shape[0], width), np.float32)
    if out.size:
        _dequantize(codes, scales, biases, bits, out)
    return out
