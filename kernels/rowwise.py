"""Row-wise asymmetric quantization of float rows to 8, 4 or 2 bits, with a per-row error bound.

A quantized row is stored in torch's fused layout (``embedding_bag_byte_prepack`` and its 4-/2-bit
siblings): the codes packed low bits first, then the scale, then the bias. The scale and bias are
float32 at 8 bits and float16 at 4 and 2 bits, as torch does. Measured with
``bench/bench_quant.py`` on 128-wide rows: on N(0, 0.01) rows float16 moves the worst error by
0.04% of the bound at every width, but on N(1, 0.01) rows (an offset far above the spread) the
float16 bias, rounded to 2**-11 of the offset, puts the worst 8-bit error at 3.5 times the bound
(4- and 2-bit steps are 17 and 85 times coarser and absorb it: 1.0004). So 8 bits pays 4 bytes a
row for float32, and 4 and 2 bits save them (4 of the 68 bytes of a 4-bit row, the margin of the
÷7 size goal). ``scale_dtype`` overrides the choice.

torch's prepack ops encode 2-8 times faster on one core, but are not used: their 8-bit
quantizer divides by ``range + 1e-8``, so a row whose range is near 1e-8 or below never reaches
its top code, and on U(0, 1e-6) rows their worst error is 6.3 times the bound (``bench_quant.py``
prints it); ours meets 2 GB/s a core, the goal, and its bound holds for every row. Their unpack
ops read this layout, but decode slower than ours (``bench_quant.py`` prints both).

Each row's bound is returned with it: every dequantized element lies within it of the input (see
:mod:`deltackpt.kernels.rowwise_reference`). Rows with inf or NaN, or past float16's range with
a float16 scale, raise :class:`ValueError` naming the row: they are never stored wrong.

Example:
    >>> import torch
    >>> from deltackpt.kernels import rowwise
    >>> x = torch.randn(4, 16)
    >>> packed, bound = rowwise.quantize_rows(x, 8)
    >>> y = rowwise.dequantize_rows(packed, 8, 16, torch.float32)
    >>> bool(((x - y).abs() <= bound[:, None]).all())
    True
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")
BITS = (8, 4, 2)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Half the spacing of the output dtype relative to a value: the rounding of a decoded element.
_OUT_EPS = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


class RowError(ValueError):
    """A row that cannot be quantized; ``row`` is its index, ``reason`` says why."""

    def __init__(self, row: int, reason: str):
        super().__init__(f"row {row} {reason}")
        self.row = row
        self.reason = reason


def _reference() -> ModuleType:
    # The compiled (numba) kernels load on first use, not with the package: see kernels/small.py.
    return importlib.import_module(".rowwise_reference", __package__)


def default_scale_dtype(bits: int) -> torch.dtype:
    """float32 at 8 bits, float16 below (the reasons are in the module's docstring)."""
    return torch.float32 if bits == 8 else torch.float16


def row_bytes(width: int, bits: int, scale_dtype: torch.dtype) -> int:
    """Bytes of one quantized row of ``width`` elements: codes, scale and bias."""
    return -(-width * bits // 8) + 2 * scale_dtype.itemsize


def check(bits: int, scale_dtype: torch.dtype) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if scale_dtype not in (torch.float32, torch.float16):
        raise ValueError(f"scale_dtype must be torch.float32 or torch.float16, got {scale_dtype}")


@functools.cache
def _triton() -> ModuleType | None:
    try:
        from . import rowwise_triton
    except ImportError:
        return None
    return rowwise_triton


def _triton_for(t: torch.Tensor, backend: str) -> ModuleType | None:
    """The Triton kernels' module if ``backend`` picks them for ``t``, else None (the reference)."""
    if backend == "triton":
        mod = _triton()
        if mod is None:
            raise RuntimeError("backend='triton' needs the triton package, which is not importable")
        return mod
    if backend == "auto":
        return _triton() if t.device.type == "cuda" else None
    if backend == "torch":
        return None
    raise ValueError(f"backend must be one of ('auto', 'triton', 'torch'), got {backend!r}")


def _refuse(x: torch.Tensor, bounds: torch.Tensor) -> None:
    bad = torch.isnan(bounds).nonzero()
    if bad.numel():
        i = int(bad[0])
        if not bool(torch.isfinite(x[i]).all()):
            raise RowError(i, "holds inf or NaN, which row-wise quantization cannot store")
        raise RowError(i, f"spans [{float(x[i].min())}, {float(x[i].max())}], past the range of "
                          f"a float16 scale and bias: use a float32 scale")


def quantize_rows(x: torch.Tensor, bits: int, *, adaptive: bool = False,
                  scale_dtype: torch.dtype | None = None, backend: str = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes each row of ``x`` to ``bits`` bits with its own scale and bias.

    Args:
        x: a float32, bfloat16 or float16 tensor of at least one dimension; rows are along
            dimension 0 and hold the other dimensions' elements.
        bits: 8, 4 or 2.
        adaptive: narrow each row's range greedily to cut its L2 error (Check-N-Run's adaptive
            range; worth it at 4 bits and below, where outliers cost the most steps).
        scale_dtype: torch.float32 or torch.float16; default :func:`default_scale_dtype`.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``, as for the other kernels.

    Returns:
        ``(packed, bound)``: uint8 ``[rows, row_bytes]`` in the fused layout, and float32
        ``[rows]``, each row's bound on ``|decoded - x|`` after decoding to ``x.dtype``.

    Raises:
        ValueError: a bad argument.
        RowError: a row that cannot be stored (inf or NaN, or past float16's range with a
            float16 scale), named by its index.
    """
    scale_dtype = scale_dtype or default_scale_dtype(bits)
    check(bits, scale_dtype)
    if x.dtype not in FLOATS or x.dim() == 0:
        raise ValueError(f"quantize_rows needs a float32/bfloat16/float16 tensor with at least one "
                         f"dimension, got {x.dtype} of shape {tuple(x.shape)}")
    half = scale_dtype == torch.float16
    flat = x.detach().reshape(x.shape[0], math.prod(x.shape[1:]))
    width = flat.shape[1]
    tk = _triton_for(flat, backend)
    if tk is not None:
        packed, bounds = tk.quantize(flat.contiguous(), bits, adaptive, half, _OUT_EPS[x.dtype])
    else:
        host = flat.to("cpu", torch.float32).contiguous()
        codes, scales, biases, b = _threads_kept(
            lambda: _reference().quantize(host.numpy(), bits, adaptive, half, _OUT_EPS[x.dtype]))
        sd = np.float16 if half else np.float32
        packed = torch.from_numpy(np.concatenate(
            [codes, scales.astype(sd)[:, None].view(np.uint8), biases.astype(sd)[:, None].view(np.uint8)],
            axis=1)).to(x.device)
        bounds = torch.from_numpy(b).to(x.device)
    _refuse(flat, bounds)
    return packed, bounds


def dequantize_rows(packed: torch.Tensor, bits: int, width: int, dtype: torch.dtype, *,
                    scale_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """Decodes rows made by :func:`quantize_rows` to ``dtype``.

    Args:
        packed: uint8 ``[rows, row_bytes(width, bits, scale_dtype)]``.
        bits: 8, 4 or 2.
        width: elements per row.
        dtype: the float dtype to decode to.
        scale_dtype: as given to :func:`quantize_rows`.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        A ``[rows, width]`` tensor of ``dtype`` on ``packed``'s device.
    """
    scale_dtype = scale_dtype or default_scale_dtype(bits)
    check(bits, scale_dtype)
    rb = row_bytes(width, bits, scale_dtype)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != rb:
        raise ValueError(f"packed rows of {width} elements at {bits} bits are uint8 [rows, {rb}], "
                         f"got {packed.dtype} of shape {tuple(packed.shape)}")
    tk = _triton_for(packed, backend)
    if tk is not None:
        decoded: torch.Tensor = tk.dequantize(packed.contiguous(), bits, width, scale_dtype)
        return decoded.to(dtype)
    host = packed.cpu().contiguous().numpy()
    n = rb - 2 * scale_dtype.itemsize
    sd = np.float16 if scale_dtype == torch.float16 else np.float32
    scales = np.ascontiguousarray(host[:, n : n + scale_dtype.itemsize]).view(sd)[:, 0]
    biases = np.ascontiguousarray(host[:, n + scale_dtype.itemsize :]).view(sd)[:, 0]
    out = _threads_kept(lambda: _reference().dequantize(
        np.ascontiguousarray(host[:, :n]), scales.astype(np.float32), biases.astype(np.float32),
        bits, width))
    return torch.from_numpy(out).to(packed.device, dtype)


def _threads_kept(fn: Callable[[], T]) -> T:
    # numba's OpenMP layer resets the OpenMP thread count torch uses: put it back, or training
    # would silently change thread count (and bits) after a save.
    threads = torch.get_num_threads()
    try:
        return fn()
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
