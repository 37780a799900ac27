"""Partial loads: some tensors of a step, or some rows of one tensor, read alone.

Selecting tensors reads only their parts of every record of the chain. Selecting rows goes
further: from a base it reads only the row chunks that hold a requested row, from a delta only the
id chunks of the tensor (8 bytes a row) and the row chunks holding a requested row, so reading a
few rows of a large table costs a few chunks per record of the chain, not the table.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..errors import IntegrityError, KeyMismatchError, StateError
from ..format import dtypes
from ..format.manifest import TensorRecord
from ..sharding import Box
from .reader import ChainReader, Job


def select_keys(keys: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The keys that any of ``patterns`` selects, in the order of ``keys``.

    A pattern selects a key equal to it, the keys under it (``model`` selects ``model/emb.weight``)
    and the keys it matches as a shell glob (``model/*.weight``).

    Raises:
        KeyMismatchError: a pattern selects nothing (named as not in the checkpoint).

    Example:
        >>> select_keys(["model/a", "model/b", "optim/x"], ["model"])
        ['model/a', 'model/b']
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    keys = list(keys)
    hits: dict[str, list[str]] = {}
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise StateError(f"a key pattern must be a non-empty str, got {p!r}")
        under = p.rstrip("/") + "/"
        hits[p] = [k for k in keys if k == p or k.startswith(under) or fnmatch.fnmatchcase(k, p)]
    unmatched = [p for p, found in hits.items() if not found]
    if unmatched:
        raise KeyMismatchError([], unmatched)
    chosen = {k for found in hits.values() for k in found}
    return [k for k in keys if k in chosen]


def row_ids(rows: torch.Tensor | Sequence[int] | np.ndarray, shape: tuple[int, ...],
            key: str) -> torch.Tensor:
    """``rows`` as an int64 CPU tensor, checked to be rows of a tensor of ``shape``.

    Raises:
        StateError: ``rows`` is not one-dimensional integers, names a row outside the tensor, or
            the tensor is 0-d.
    """
    if not shape:
        raise StateError(f"{key}: a 0-d tensor has no rows; load it with keys=[{key!r}]")
    nrows = shape[0]
    ids = torch.as_tensor(rows)
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8) or ids.dim() != 1:
        raise StateError(f"{key}: rows must be a 1-d integer tensor, got {ids.dtype} of shape "
                         f"{list(ids.shape)}")
    ids = ids.to("cpu", torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= nrows):
        bad = ids[(ids < 0) | (ids >= nrows)][0]
        raise StateError(f"{key}: row {int(bad)} is outside the tensor's {nrows} rows")
    return ids


class RowReader(ChainReader):
    """Reads chosen rows of one tensor along a chain (see :class:`ChainReader` for the arguments).

    Example:
        >>> import tempfile, torch
        >>> from deltackpt import Checkpointer
        >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     _ = ckpt.save(1, {"emb": torch.arange(12.).view(6, 2)})
        ...     ckpt.load(1, key="emb", rows=[4, 1]).tolist()
        [[8.0, 9.0], [2.0, 3.0]]
    """

    def read_rows(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64, any order, repeats allowed, checked by :func:`row_ids`) of
        ``key``'s value at the chain's last step, as a tensor of ``len(ids)`` rows."""
        rec = self._record(key)
        uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        dest = torch.empty((uniq.numel(), *rec.shape[1:]), dtype=dtypes.from_name(rec.dtype))
        # The rows from the first to the last asked for: only the part tables of the parts they
        # meet are read.
        lo, hi = (int(uniq[0]), int(uniq[-1]) + 1) if uniq.numel() else (0, 0)
        span = Box((lo, *(0,) * (len(rec.shape) - 1)), (hi - lo, *rec.shape[1:]))
        for m in self._chain:
            r = m.tensors.get(key)
            if r is None or r.dtype != rec.dtype or r.shape != rec.shape:
                raise IntegrityError(m.step, key, "the tensor is missing, or its dtype or shape "
                                     "differs along the chain")
            jobs: list[Job] = []
            for part in r.parts_meeting(span):
                a = int(torch.searchsorted(uniq, part.offset[0]))
                b = int(torch.searchsorted(uniq, part.offset[0] + part.shape[0]))
                if a < b:
                    jobs += r.encoding.read_rows(self, m, key, r, part, uniq[a:b], a, dest)
            self.run(jobs)
        if uniq.numel() == ids.numel() and torch.equal(uniq, ids):
            return dest
        return dtypes.as_bits(dest)[inverse].view(dest.dtype)

    def _record(self, key: str) -> TensorRecord:
        rec = self._chain[-1].tensors.get(key)
        if rec is None:
            raise KeyMismatchError([], [key])
        return rec
