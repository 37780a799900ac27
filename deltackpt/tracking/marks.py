"""One tracked table's marks: a mask with an entry per row, and when they stand for its changes.

Marks made before a table's first save are not needed (that save hashes the table) and are
dropped. A table's :class:`TableMode` moves on as :mod:`deltackpt.tracking.changes` scans and commits::

    OFF --scan (hashes; recording starts)--> STARTING --commit--> ON
    ON --scan (marks taken; pending until the commit)--> ON
    ON --scan, the canary finds an unmarked change--> HASHING (for good)
    any but HASHING --restore--> ON;  resized table --> OFF
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels  # installed from kernels/, see pyproject


@dataclass(frozen=True)
class Canary:
    """How many unmarked rows of a tracked table each delta re-hashes to check the marks.

    A save that uses marks also hashes ``max(min_rows, ceil(fraction * rows))`` rows drawn at
    random (at most every row), keeps those that are not marked, and compares their hashes with
    the last commit's. An optimizer that changes untouched rows (weight decay, dense Adam) changes
    nearly all of them, so a sample of a thousand rows finds it on the first delta; a rare stray
    update to a few rows is found only with the probability that the sample hits one of them.

    Attributes:
        fraction: share of the table's rows drawn per save, in [0, 1]. The default 0.1% costs
            about a tenth of writing a 1% delta (hashing runs ~5x faster than writing).
        min_rows: rows drawn at least, >= 1, so a small table still gets a useful sample.
    """

    fraction: float = 0.001
    min_rows: int = 1024

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction!r}")
        if not isinstance(self.min_rows, int) or self.min_rows < 1:
            raise ValueError(f"min_rows must be a positive int, got {self.min_rows!r}")

    def sample_size(self, rows: int) -> int:
        """Rows to draw from a table of ``rows`` rows."""
        return min(rows, max(self.min_rows, math.ceil(self.fraction * rows)))


class TableMode(enum.Enum):
    """Whether a table's marks can stand for its change set."""

    OFF = "off"  # no mask: the next save hashes the table and starts recording
    STARTING = "starting"  # recording since a hashing scan whose save has not committed
    ON = "on"  # the marks (plus pending ones) cover every change since the last commit
    HASHING = "hashing"  # the canary found an unmarked change: hash this table from now on


class TrackedTable:
    """One tracked table: its flat keys, its marks, and the optimizer that may hold its state.

    Args:
        keys: the flat keys of the table (several when the parameter is tied under two names).
        param: the parameter, to find its optimizer state; None for a key marked by hand.
        optimizer: an optimizer that may update ``param``, and its flat-key prefix.
        canary: the canary's sample size.
    """

    def __init__(
        self,
        keys: tuple[str, ...],
        param: torch.Tensor | None,
        optimizer: tuple[torch.optim.Optimizer, str] | None,
        canary: Canary,
    ):
        self.keys = keys
        self.param = param
        self.optimizer = optimizer
        self.canary = canary
        self.mode = TableMode.OFF
        self.mask: torch.Tensor | None = None
        # Rows taken from the mask by scans whose saves have not committed: a failed save's rows
        # reach the next save through here.
        self.pending: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.keys[0]

    def mark(self, ids: torch.Tensor, table: torch.Tensor | None = None) -> None:
        """Marks rows ``ids`` (any shape, in range).

        Args:
            ids: row ids, int64 or int32.
            table: the table looked up, when the caller has it (a hook): a table that moved to
                another device takes its mask along, and one that was resized stops its marks.
        """
        mask = self.mask
        if mask is None:
            return
        if table is not None:
            if table.shape[0] != mask.shape[0]:
                # Its marks mean nothing now, and an id past the old end would be lost: the
                # next save hashes the table.
                self.stop()
                return
            if table.device != mask.device:
                mask = self.mask = mask.to(table.device)
        kernels.mark_rows(mask, ids.reshape(-1).to(mask.device))

    def begin(self, rows: int, device: torch.device) -> None:
        """Drops every mark and records from now on into a mask of ``rows`` rows on ``device``."""
        if self.mask is not None and self.mask.shape[0] == rows and self.mask.device == device:
            self.mask.zero_()
        else:
            self.mask = torch.zeros(rows, dtype=torch.bool, device=device)
        self.pending = None

    def take(self) -> torch.Tensor:
        """The rows marked since the last take, with those of uncommitted saves: sorted, unique
        int64 ids on the CPU. They stay pending until :meth:`settle`."""
        assert self.mask is not None, "take() needs a table in mode ON"
        if self.mask.device.type == "cpu":
            # numpy finds the set bytes of a CPU mask 3x faster than torch (35 vs 120 us for
            # 250,000 rows here).
            marked = torch.from_numpy(np.flatnonzero(self.mask.numpy()))
        else:
            marked = self.mask.nonzero().flatten()
        # Clearing just the taken rows costs O(changed); marks made after the nonzero pass stay.
        self.mask.index_fill_(0, marked, False)
        ids = marked.cpu()
        if self.pending is not None and self.pending.numel():
            ids = torch.unique(torch.cat([self.pending, ids]))
        self.pending = ids
        return ids

    def settle(self) -> None:
        """Forgets the pending rows: the save that took them committed."""
        self.pending = None

    # -- mode transitions -----------------------------------------------------------------------

    def check_rows(self, rows: int) -> None:
        """Before a scan: a table resized since its marks started stops them (ON -> OFF)."""
        if self.mode is TableMode.ON and self.mask is not None and self.mask.shape[0] != rows:
            self.stop()

    def fall_back(self) -> None:
        """The canary found an unmarked change: hash the table from now on (-> HASHING)."""
        self.mode = TableMode.HASHING
        self.stop()

    def hashed(self, rows: int, device: torch.device) -> None:
        """A scan hashed the table: unless it stays HASHING, marks from here on, with this scan's
        hashes, will cover the next save (-> STARTING)."""
        if self.mode is not TableMode.HASHING:
            self.begin(rows, device)
            self.mode = TableMode.STARTING

    def committed(self) -> None:
        """The save that scanned the table committed: its pending rows are saved, and marks that
        started with it now stand for the table's changes (STARTING -> ON)."""
        if self.mode is TableMode.STARTING:
            self.mode = TableMode.ON
        self.settle()

    def restored(self, rows: int, device: torch.device) -> None:
        """The table was just restored: it matches its reference, so marks from now on stand for
        its changes (-> ON), unless it is hashed for good."""
        if self.mode is not TableMode.HASHING:
            self.begin(rows, device)
            self.mode = TableMode.ON

    def stop(self) -> None:
        """Stops recording; the next save hashes the table (``mode`` OFF, or stays HASHING)."""
        self.mask = None
        self.pending = None
        if self.mode is not TableMode.HASHING:
            self.mode = TableMode.OFF
