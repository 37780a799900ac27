"""How a part's data is laid out in chunks, by encoding.

A base stores each part whole (``full``); a delta stores a row-sparse tensor's changed rows with
their ids (``rows``), quantized if a rule asks (``qrows``), and any other tensor's changed chunks
of its flat elements (``chunks``).
"""

from __future__ import annotations

import enum
import math


class Encoding(enum.StrEnum):
    """How a part's data is stored in a step (the ``encoding`` of its tensor's record)."""

    FULL = "full"
    ROWS = "rows"
    CHUNKS = "chunks"
    QROWS = "qrows"  # a delta's changed rows quantized row-wise (format 3)

    def __repr__(self) -> str:
        return repr(self.value)  # shows as the string it equals, in reports and examples

    @classmethod
    def of(cls, kind: str, shape: tuple[int, ...], quantized: bool = False) -> Encoding:
        """How a tensor of ``shape`` is stored in a step of ``kind`` (``"base"`` or ``"delta"``);
        ``quantized``: a quantization rule names it.

        Example:
            >>> Encoding.of("delta", (100, 8)), Encoding.of("delta", (100,)), Encoding.of("base", ())
            ('rows', 'chunks', 'full')
        """
        if kind == "base":
            return cls.FULL
        if quantized:
            return cls.QROWS
        return cls.ROWS if len(shape) >= 2 else cls.CHUNKS


def rows_per_chunk(rows: int, row_bytes: int, chunk_bytes: int) -> int:
    """Rows per chunk: about ``chunk_bytes`` each, split evenly so the edge chunk pads little."""
    if rows == 0:
        return 1
    target = max(1, chunk_bytes // max(1, row_bytes))
    return -(-rows // -(-rows // target))


def dense_chunk_elems(numel: int, itemsize: int, dense_chunk_bytes: int) -> int:
    """Elements per dense chunk: about ``dense_chunk_bytes``, split evenly so that the edge chunk
    pads less than one element per chunk (one chunk for a part smaller than a chunk)."""
    return rows_per_chunk(numel, itemsize, dense_chunk_bytes)


def chunk_shape(encoding: str, shape: tuple[int, ...], itemsize: int, changed: int,
                chunk_bytes: int, dense_chunk_bytes: int) -> tuple[int, ...]:
    """The chunk shape of a part's array (of its ``rows`` array for ``"rows"``)."""
    if encoding == "chunks":
        return (dense_chunk_elems(math.prod(shape), itemsize, dense_chunk_bytes),)
    if not shape:
        return ()
    row_bytes = math.prod(shape[1:]) * itemsize
    rows = shape[0] if encoding == "full" else changed
    return (rows_per_chunk(rows, row_bytes, chunk_bytes), *shape[1:])


def qrows_chunk_shape(changed: int, qrow_bytes: int, chunk_bytes: int) -> tuple[int, int]:
    """The chunk shape of a ``qrows`` part's array of quantized rows (uint8, ``qrow_bytes`` wide)."""
    return (rows_per_chunk(changed, qrow_bytes, chunk_bytes), qrow_bytes)
