"""Row hashes a restore takes from the rows it has just written, so that the next delta has its
references without a second pass over everything restored.

A read job that writes whole rows of its destination hashes them right after, on its own I/O
thread, while their bytes are still in hand; a job that writes only some columns of rows (a
column-sharded part, a delta cell) marks them unknown, and :meth:`RowHashes.complete` hashes
those once every job has ended. The jobs of one replay phase write disjoint rows and columns
(:mod:`deltackpt.io.cover`), and the base's phase ends before the deltas' begins, so the last
hash a row gets is that of its final value.

The hashes are of the bytes written, which were checked against the record's checksums before
use, except where a base stored its rows' hashes beside them (:mod:`deltackpt.format.hash_files`):
the rows a job writes whole from such a part take those, hashing nothing. Those are checked only
against their file's checksum; a wrong one makes the next delta write its row again (its hash
differs from the row's), or, for a table tracked by marks, the canary or the next audit find the
row "changed" and write it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels  # installed from kernels/, see pyproject


@dataclass(frozen=True)
class RowHashes:
    """The XXH64 hash of every row of one destination (as :func:`deltackpt.kernels.hash_rows`
    gives it), filled by the read jobs that write its rows.

    Attributes:
        values: one int64 hash per row of the destination.
        known: whether each row's hash is that of its value now.

    Example:
        >>> dest = torch.arange(6.0).view(3, 2)
        >>> h = RowHashes.of(3)
        >>> h.took(slice(0, 2), dest[0:2]); h.lost(torch.tensor([1]))
        >>> torch.equal(h.complete(dest), kernels.hash_rows(dest))
        True
    """

    values: torch.Tensor
    known: torch.Tensor

    @classmethod
    def of(cls, rows: int) -> RowHashes:
        """Hashes for a destination of ``rows`` rows, none known yet."""
        return cls(torch.empty(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.bool))

    def took(self, rows: slice | torch.Tensor, data: torch.Tensor) -> None:
        """Hashes ``data`` (CPU), the whole rows just written at ``rows`` (a slice, or sorted
        row indices), on the calling thread.

        numpy for the scatter, on this thread: torch's indexing wakes its thread pool, slow
        beside the I/O threads on a busy node. The hash takes the small inputs' path while the
        compiled kernels are not loaded yet (see :mod:`deltackpt.kernels.small`): a fresh
        process's restore of a small state waited for numba's import (0.4-0.48 s)."""
        data = data.reshape(data.shape[0], math.prod(data.shape[1:]))
        at = rows if isinstance(rows, slice) else rows.numpy()
        self.values.numpy()[at] = kernels.hash_rows(data, threads=1).numpy()
        self.known.numpy()[at] = True

    def given(self, rows: slice, hashes: torch.Tensor) -> None:
        """Takes ``hashes`` as those of the whole rows just written at ``rows``: their base stored
        them beside them (see :mod:`deltackpt.format.hash_files`)."""
        self.values.numpy()[rows] = hashes.numpy()
        self.known.numpy()[rows] = True

    def lost(self, rows: slice | torch.Tensor) -> None:
        """Marks rows ``rows`` written only in part: their hash waits for :meth:`complete`."""
        if isinstance(rows, slice):
            self.known[rows] = False
        else:
            self.known.numpy()[rows.numpy()] = False

    def complete(self, dest: torch.Tensor) -> torch.Tensor:
        """Every row's hash of ``dest`` (CPU, contiguous, every job ended): the rows no job
        hashed whole are hashed now."""
        missing = np.flatnonzero(~self.known.numpy())
        if missing.size:
            flat = dest.reshape(dest.shape[0], math.prod(dest.shape[1:]))
            rows = torch.from_numpy(np.ascontiguousarray(flat.view(torch.uint8).numpy()[missing]))
            self.values.numpy()[missing] = kernels.hash_rows(rows, threads=1).numpy()
            self.known[:] = True
        return self.values
