"""zarr v3 metadata documents of the store's groups and arrays, and the chunk codec they name."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from numcodecs import Blosc

from . import dtypes
from .limits import coded_problem


def group_doc(attributes: dict[str, Any] | None = None) -> bytes:
    return json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
    ).encode()


def array_doc(shape: tuple[int, ...], chunk_shape: tuple[int, ...], dtype: torch.dtype,
              *, raw: bool = False) -> bytes:
    """The zarr v3 metadata of an array holding ``dtype`` data, blosc-lz4 coded where the dtype
    compresses, unless ``raw``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    bytes_codec: dict[str, Any] = {"name": "bytes"}
    if itemsize > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    codecs = [bytes_codec]
    if dtypes.compresses(dtype) and not raw:
        codecs.append(
            {
                "name": "blosc",
                "configuration": {
                    "cname": dtypes.BLOSC_CNAME,
                    "clevel": dtypes.BLOSC_LEVEL,
                    "shuffle": "shuffle",
                    "typesize": itemsize,
                    "blocksize": 0,
                },
            }
        )
    fill: Any = 0
    if dtype == torch.bool:
        fill = False
    elif dtype.is_complex:
        fill = [0.0, 0.0]
    elif dtype.is_floating_point and dtypes.zarr_data_type(dtype).startswith("float"):
        fill = 0.0
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtypes.zarr_data_type(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": {"torch_dtype": dtypes.name(dtype)},
    }
    return json.dumps(doc).encode()


def codec_for(dtype: torch.dtype) -> Blosc | None:
    """The codec of chunks of ``dtype`` (None: stored raw). numcodecs is imported here, by the
    first save or read of a dtype that compresses: a fifth of ``import deltackpt`` otherwise."""
    if not dtypes.compresses(dtype):
        return None
    from numcodecs import Blosc
    itemsize = torch.empty((), dtype=dtype).element_size()
    return Blosc(cname=dtypes.BLOSC_CNAME, clevel=dtypes.BLOSC_LEVEL, shuffle=Blosc.SHUFFLE,
                 typesize=itemsize, blocksize=0)


def decode(data: np.ndarray, decoded: int) -> np.ndarray:
    """The ``decoded`` bytes (uint8) that the blosc chunk ``data`` (uint8) holds: its header is
    checked before anything is decompressed (:func:`~deltackpt.format.limits.coded_problem`),
    then its body is decompressed into a buffer of exactly that size.

    Raises:
        ValueError: why the chunk does not decode to ``decoded`` bytes.
    """
    why = coded_problem(data, decoded)
    if why is not None:
        raise ValueError(why)
    from numcodecs import blosc
    out = np.empty(decoded, np.uint8)
    try:
        blosc.decompress(data, out)
    except RuntimeError as e:  # a header that passed, a body that does not
        raise ValueError(f"does not decode ({e})") from None
    return out
