"""How torch dtypes are stored as zarr v3 data types.

Dtypes zarr v3 knows are stored natively. The others (bfloat16, the float8 family, the packed
float4 pairs of ``float4_e2m1fn_x2``) are stored as unsigned integers of the same width; the
array's ``torch_dtype`` attribute, written for every array, names the real dtype so the bits are
reinterpreted on load, never converted.
"""

from __future__ import annotations

import torch

from ..errors import StateError

_NATIVE = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
_AS_BITS = {torch.bfloat16: "uint16"} | {
    getattr(torch, name): "uint8"
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                 "float4_e2m1fn_x2")
    if hasattr(torch, name)
}
_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in (*_NATIVE, *_AS_BITS)}
NAMES = frozenset(_BY_NAME)


def name(dtype: torch.dtype) -> str:
    """The name a dtype is recorded under (``"float32"``, ``"bfloat16"``)."""
    if dtype not in _NATIVE and dtype not in _AS_BITS:
        raise StateError(f"dtype {dtype} is not supported")
    return str(dtype).removeprefix("torch.")


def from_name(dtype_name: str) -> torch.dtype:
    """The torch dtype recorded as ``dtype_name``."""
    try:
        return _BY_NAME[dtype_name]
    except KeyError:
        raise StateError(f"unknown dtype {dtype_name!r} in the store") from None


_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element size, which torch indexes and writes by
    index for every dtype (``index_put`` is not implemented for uint16-64, float8_e8m0fnu or
    float4_e2m1fn_x2); 16-byte items (complex128, indexed natively) as they are."""
    return t.view(_SAME_SIZE.get(t.element_size(), t.dtype))


def zarr_data_type(dtype: torch.dtype) -> str:
    """The zarr v3 ``data_type`` that holds the bits of ``dtype``."""
    return _NATIVE.get(dtype) or _AS_BITS[dtype]


# The codec of integer and bool arrays: blosc with lz4 at this level and byte shuffle, in the
# zarr metadata (store.array_doc) and in the writer and reader (writer.codec_for) alike.
BLOSC_CNAME = "lz4"
BLOSC_LEVEL = 5


def compresses(dtype: torch.dtype) -> bool:
    """Whether arrays of this dtype get the lz4 codec.

    Measured (``bench/bench_codecs.py``, docs/format.md): blosc-lz4 with byte shuffle shrinks
    sorted row ids 4.8x, bool masks 18x and integer counters far more, but float weights and
    optimizer state only 1.07-1.32x, which does not pay for the codec's time against the disk.
    """
    return not (dtype.is_floating_point or dtype.is_complex)
