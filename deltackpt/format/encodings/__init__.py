"""The registry of encodings: how a part's data lies in a step (see :mod:`.base`).

A base stores each part whole (``full``); a delta stores a row-sparse tensor's changed rows with
their ids (``rows``), quantized if a rule asks (``qrows``), and any other tensor's changed chunks
of its flat elements (``chunks``). Adding an encoding is one more class registered with
:func:`register`.
"""

from __future__ import annotations

from .base import (
    Array,
    ChunkSink,
    ChunkSource,
    Encoding,
    Job,
    Packed,
    choose,
    dense_chunk_elems,
    get,
    register,
    rows_per_chunk,
)
from .full import FULL, Full, in_pack, write_block  # registered in this order: full, rows, qrows, chunks
from .rows import ROWS, QRows, RowChunks, Rows
from .chunks import CHUNKS, Chunks

__all__ = ["CHUNKS", "FULL", "ROWS", "Array", "ChunkSink", "ChunkSource", "Chunks", "Encoding", "Full", "Job",
           "Packed", "QRows", "RowChunks", "Rows", "choose", "dense_chunk_elems", "get", "in_pack", "register",
           "rows_per_chunk", "write_block"]
