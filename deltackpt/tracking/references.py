"""What a change tracker keeps of each tensor between saves, and what it finds changed (see
:mod:`deltackpt.tracking.changes`)."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..format.hash_files import HASHED_ROW_BYTES

NO_IDS = torch.empty(0, dtype=torch.int64)
"""No row or chunk, or the hashes of none (shared: never written to)."""

SMALL_TENSOR_BYTES = 1 << 16
"""Tensors of at most this many bytes are hashed together, in one call (:meth:`~deltackpt.tracking.changes.ChangeTracker.hash_many`)."""


def is_row_sparse(t: torch.Tensor) -> bool:
    return t.dim() >= 2


def same_tensors(tensors: Mapping[str, torch.Tensor], keys: list[str], objects: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` are ``objects`` under ``keys``, in order, the same objects: what was
    found of them holds, for a tensor given again keeps its dtype, shape and strides (see
    :meth:`~deltackpt.tracking.changes.ChangeTracker.scan`)."""
    return (len(tensors) == len(objects) and all(map(operator.is_, tensors.values(), objects))
            and list(tensors) == keys)


def is_small(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CPU tensor of a few elements, laid out contiguously: one that is hashed
    with the other small ones (see :meth:`~deltackpt.tracking.changes.ChangeTracker.hash_many`)
    and that a base appends to its pack with them."""
    return t.is_cpu and t.is_contiguous() and 0 < t.nbytes <= SMALL_TENSOR_BYTES


def stores_row_hashes(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether a base stores the hash of every row of a part of ``shape`` (see
    :mod:`deltackpt.format.hash_files`): two or more dimensions, more than
    ``SMALL_TENSOR_BYTES`` (the small ones are hashed together), rows of ``HASHED_ROW_BYTES`` or more."""
    nbytes = math.prod(shape) * itemsize
    return len(shape) >= 2 and nbytes > SMALL_TENSOR_BYTES and nbytes // shape[0] >= HASHED_ROW_BYTES


def joined_piece(t: torch.Tensor, chunk_bytes: int | None) -> int:
    """The bytes of ``t``'s rows (``chunk_bytes`` None) or of its chunks if it is small enough to
    be hashed with others (:func:`is_small`), else 0."""
    if not is_small(t):
        return 0
    n = t.nbytes
    if chunk_bytes is None:
        return n // t.shape[0]
    return n if n <= chunk_bytes else chunk_bytes if not n % chunk_bytes else 0


class TensorChange(NamedTuple):
    """What changed in one tensor (a tuple: a scan makes thousands for a state of small tensors,
    and a tuple is made in a third of the time of a frozen dataclass).

    Attributes:
        changed: sorted changed row ids or chunk indices (int64, CPU), or None when there is
            nothing to compare with (a new tensor, or a new dtype or shape): the tensor must be
            written whole.
        hashes: the tensor's hashes now (per row or per chunk, on the CPU): of every row or
            chunk, or when ``partial`` only of those in ``changed``, then None until the save's
            writer (or :meth:`ChangeTracker.adopt`) computes them. None as well when ``changed``
            is None: the base that writes the tensor whole hashes it as it writes (see
            :meth:`ChangeTracker.hash_whole`).
        partial: whether ``hashes`` covers ``changed`` only (a change set found from marks).
        aligned: a 1-d tensor aligned with a table's rows, whose units are its elements (rows)
            rather than chunks (see :meth:`~deltackpt.tracking.rows.RowTracker.aligned`).
    """

    changed: torch.Tensor | None
    hashes: torch.Tensor | None
    partial: bool = False
    aligned: bool = False


@dataclass
class Reference:
    """A tensor's hashes at the last commit (or restore), with what a scan keeps of it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    hashes: torch.Tensor  # CPU int64, one per row or chunk
    by_rows: bool
    same: TensorChange | None = None  # the change set "unchanged", kept while ``hashes`` are
    piece: int | None = None  # ChangeTracker._piece of a contiguous CPU tensor it matches

    def matches(self, t: torch.Tensor, by_rows: bool) -> bool:
        return self.dtype == t.dtype and self.shape == tuple(t.shape) and self.by_rows == by_rows

    def unchanged(self, aligned: bool) -> TensorChange:
        """No change since the reference: one object, kept from save to save (a delta of
        thousands of unchanged tensors makes none)."""
        if self.same is None or self.same.aligned != aligned:
            self.same = TensorChange(NO_IDS, self.hashes, aligned=aligned)
        return self.same
