"""One tracked table's marks: a mask with an entry per row (on the CPU with a log of the rows
it set, up to a share of them), and when they stand for its changes.

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
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels  # installed from kernels/, see pyproject
from ..errors import SettingError


@dataclass(frozen=True)
class Canary:
    """How a tracked table's marks are checked: a sample of its rows at each delta, and a full
    audit every ``audit_every`` deltas and at each base.

    **Sample.** A save that uses marks draws ``s = sample_size(n)`` distinct rows of the table's
    ``n`` rows, uniformly at random (without replacement), drops the marked ones and compares the
    hashes of the rest with the last commit's. A stray change, one no lookup marked, to ``m`` rows
    is found by one delta with probability::

        P = 1 - C(n - m, s) / C(n, s)        (s / n for one row; 1 when s + m > n)

    (:meth:`detection_probability`). With the defaults a table of up to 1,024 rows is checked
    whole at every delta; one stray row in a table of a million rows is found by a given delta
    with probability 1,024 / 10^6 = 0.1%, and one in 10^8 rows with probability 0.1% too
    (``fraction``). An optimizer that changes untouched rows (weight decay, dense Adam) changes
    nearly all of them, so the first delta finds it.

    **Audit.** Every ``audit_every``-th delta since the table's last audit hashes every row of
    the table and of its optimizer state, and that delta writes every row whose hash changed: a
    stray change reaches the store at most ``audit_every`` deltas after it happened, whatever the
    sample missed (the deltas in between lack it). A base writes every row anyway; its commit
    hashes the tables whole, so later comparisons start from what it stored. An audit costs a
    hash of the table (hashing runs ~5x faster than writing it), on the delta's blocked path, so
    the tables of one tracker take turns: after a base or a restore, the first audit of the
    ``i``-th table tracked comes ``frac(i x 0.618) x audit_every`` deltas early (rounded down),
    so that with ``audit_every`` >= 2 no delta hashes every table (the eight tables of a 2.2 GB
    state, all audited at one delta, blocked that background delta for 0.25 s where the others
    blocked for 0.02 s).

    Either way, a stray change found is logged as a warning naming the table, and the table is
    hashed at every save from then on, so its deltas are exact.

    Attributes:
        fraction: share of the table's rows drawn per save, in [0, 1]. The default 0.1% costs
            about a tenth of writing a 1% delta.
        min_rows: rows drawn at least, >= 1, so a small table still gets a useful sample.
        audit_every: deltas between full audits (>= 1), or None for no audit but at bases.
        seed: seed of the table's draws (None: from the operating system), for reproducible
            runs; the draws never touch torch's global generator.

    Example:
        >>> round(Canary().detection_probability(1_000_000, 1), 6)
        0.001024
        >>> Canary().detection_probability(1_000, 1)
        1.0
    """

    fraction: float = 0.001
    min_rows: int = 1024
    audit_every: int | None = 50
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise SettingError(f"fraction must be in [0, 1], got {self.fraction!r}")
        if not isinstance(self.min_rows, int) or self.min_rows < 1:
            raise SettingError(f"min_rows must be a positive int, got {self.min_rows!r}")
        if self.audit_every is not None and (not isinstance(self.audit_every, int)
                                             or self.audit_every < 1):
            raise SettingError(f"audit_every must be a positive int or None, got {self.audit_every!r}")

    def sample_size(self, rows: int) -> int:
        """Rows to draw from a table of ``rows`` rows."""
        return min(rows, max(self.min_rows, math.ceil(self.fraction * rows)))

    def detection_probability(self, rows: int, stray: int) -> float:
        """The probability that one delta's sample finds a stray change to ``stray`` rows of a
        table of ``rows`` rows: ``1 - C(rows - stray, s) / C(rows, s)``."""
        s = self.sample_size(rows)
        if stray <= 0:
            return 0.0
        if s + stray > rows:
            return 1.0
        missed = 1.0
        for i in range(stray):  # C(n - m, s) / C(n, s) = prod (n - s - i) / (n - i)
            missed *= (rows - s - i) / (rows - i)
        return 1.0 - missed

    def generator(self) -> np.random.Generator:
        """A generator for this canary's draws."""
        return np.random.default_rng(self.seed)


def draw_rows(rows: int, count: int, generator: np.random.Generator) -> torch.Tensor:
    """``count`` distinct row ids below ``rows`` (all of them if fewer), uniformly at random:
    every subset of that size is equally likely, in ascending order. Costs O(count), not
    O(rows), when ``count`` is small beside ``rows`` (numpy's sampling without replacement:
    ~20 us for 1,024 of any number of rows, where drawing with torch and deduplicating took
    ~165 us). Sorted (8 us more), so that the canary finds them among the sorted marked rows and
    gathers them in memory order: 55 us instead of 155 us for the search."""
    if count >= rows:
        return torch.arange(rows)
    drawn = generator.choice(rows, count, replace=False, shuffle=False).astype(np.int64)
    drawn.sort()
    return torch.from_numpy(drawn)


GOLDEN = (5 ** 0.5 - 1) / 2
"""Spreads the tables' audits: the shares ``i x GOLDEN mod 1`` of the first ``n`` tables, for
any ``n``, leave gaps of at most three lengths (the three-distance theorem), the longest under
three times the shortest."""

LOG_SHARE = 1 / 16
"""The most rows a table's log of marked rows holds, as a share of its rows: where a sort of the
logged ids stops paying against a pass over the mask (62,500 ids sorted in about the 0.5 ms that
a pass over 10^6 rows takes), at half a byte a row."""

LOG_MIN = 1024
"""The log's first size, and the most rows it holds for a table of under LOG_MIN / LOG_SHARE rows."""


class TableMode(enum.Enum):
    """Whether a table's marks can stand for its change set."""

    OFF = "off"  # no mask: the next save hashes the table and starts recording
    STARTING = "starting"  # recording since a hashing scan whose save has not committed
    ON = "on"  # the marks (plus pending ones) cover every change since the last commit
    HASHING = "hashing"  # the canary or an audit found an unmarked change: hash it from now on


class TrackedTable:
    """One tracked table: its flat keys, its marks, and the optimizer that may hold its state.

    Args:
        keys: the flat keys of the table (several when the parameter is tied under two names).
        param: the parameter, to find its optimizer state; None for a key marked by hand.
        optimizer: an optimizer that may update ``param``, and its flat-key prefix.
        canary: the canary's sample size.
        order: how many tables its tracker had tracked before it, which places its audits
            among theirs (see :class:`Canary`).
    """

    def __init__(
        self,
        keys: tuple[str, ...],
        param: torch.Tensor | None,
        optimizer: tuple[torch.optim.Optimizer, str] | None,
        canary: Canary,
        order: int = 0,
    ):
        self.keys = keys
        self.param = param
        self.optimizer = optimizer
        self.canary = canary
        self.rng = canary.generator()
        self.audit_share = order * GOLDEN % 1.0  # of audit_every, counted ahead after a base or restore
        self.deltas_since_audit = 0  # marks-based deltas committed since the last audit (or counted ahead)
        self.mode = TableMode.OFF
        self.mask: torch.Tensor | None = None
        # A CPU mask's set rows, each once, in the order they were first marked: a take sorts
        # them instead of passing over the mask (a sort of 10,000 ids took 63 us, a pass over a
        # mask of 10^6 rows 500 us). None while the mask is on a device, or once more rows were
        # marked than the log may hold (LOG_SHARE of the rows): then the take passes over it.
        self.log: np.ndarray | None = None
        self.logged = 0  # how many ids of log are set
        self._lock = threading.Lock()  # a take and a mark from another thread, one at a time
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
                with self._lock:
                    mask = self.mask = mask.to(table.device)
                    self.log = None  # logs what it held: the take passes over it once
        ids = ids.reshape(-1).to(mask.device)
        with self._lock:
            if not (mask.device.type == "cpu" and self._log(mask, ids)):
                kernels.mark_rows(mask, ids)

    def _log(self, mask: torch.Tensor, ids: torch.Tensor) -> bool:
        """Marks ``ids`` in the CPU ``mask`` and logs the new ones, the log growing up to its
        limit; False where the mask keeps no log, or past the log's limit (some may be marked:
        marking them again is harmless)."""
        if self.log is None or mask is not self.mask:
            return False
        start = 0
        while True:
            start, self.logged = kernels.reference.mark_rows_logged(mask, ids, start, self.log, self.logged)
            if start < 0:
                return True
            if not -mask.shape[0] <= int(ids[start]) < mask.shape[0]:
                raise IndexError(f"row id {int(ids[start])} is out of range for {mask.shape[0]} rows")
            limit = max(LOG_MIN, int(mask.shape[0] * LOG_SHARE))
            if self.log.shape[0] >= limit:
                self.log = None  # the take passes over the mask
                return False
            grown = np.empty(min(limit, 2 * self.log.shape[0]), dtype=np.int64)
            grown[: self.logged] = self.log[: self.logged]
            self.log = grown

    def begin(self, rows: int, device: torch.device) -> None:
        """Drops every mark and records from now on into a mask of ``rows`` rows on ``device``."""
        with self._lock:
            if self.mask is not None and self.mask.shape[0] == rows and self.mask.device == device:
                self.mask.zero_()
            else:
                self.mask = torch.zeros(rows, dtype=torch.bool, device=device)
            self._restart_log()
        self.pending = None

    def _restart_log(self) -> None:
        """An empty log, for a CPU mask with no row set."""
        self.logged = 0
        if self.mask is None or self.mask.device.type != "cpu":
            self.log = None
        elif self.log is None:
            self.log = np.empty(LOG_MIN, dtype=np.int64)

    def take(self) -> torch.Tensor:
        """The rows marked since the last take, with those of uncommitted saves: sorted, unique
        int64 ids on the CPU. They stay pending until :meth:`settle`."""
        assert self.mask is not None, "take() needs a table in mode ON"
        # Clearing just the taken rows costs O(changed); marks made after the nonzero pass stay.
        if self.mask.device.type == "cpu":
            with self._lock:
                # numpy finds the set bytes of a CPU mask 3x faster than torch (35 vs 120 us
                # for 250,000 rows here), and clears them on this thread: torch's index_fill_
                # took 31 ms for 125,000 rows on a busy machine.
                found = (np.flatnonzero(self.mask.numpy()) if self.log is None
                         else np.sort(self.log[: self.logged]))
                self.mask.numpy()[found] = False
                self._restart_log()
            marked = torch.from_numpy(found)
        else:
            marked = self.mask.nonzero().flatten()
            self.mask.index_fill_(0, marked, False)
        ids = marked.cpu()
        if self.pending is not None and self.pending.numel():
            ids = torch.unique(torch.cat([self.pending, ids]))
        self.pending = ids
        return ids

    def settle(self) -> None:
        """Forgets the pending rows: the save that took them committed."""
        self.pending = None

    def audits_now(self) -> bool:
        """Whether the scan of the next delta audits the table (hashes it whole)."""
        every = self.canary.audit_every
        return every is not None and self.deltas_since_audit + 1 >= every

    def sample(self, rows: int, marked: torch.Tensor) -> torch.Tensor:
        """The canary's draw of the table's ``rows`` rows, less the ``marked`` ones (sorted ids,
        as :meth:`take` gives them): found in numpy on this thread, as ``adopt`` does."""
        drawn = draw_rows(rows, self.canary.sample_size(rows), self.rng)
        if not marked.numel():
            return drawn
        ids, d = marked.cpu().numpy(), drawn.numpy()
        return torch.from_numpy(d[ids[np.searchsorted(ids, d).clip(max=ids.size - 1)] != d])

    # -- mode transitions -----------------------------------------------------------------------

    def marked(self, rows: int) -> torch.Tensor | None:
        """At a scan of the table's ``rows`` rows: the rows marked (see :meth:`take`) where the
        marks stand for its changes, else None; a table resized since they started stops them
        (ON -> OFF)."""
        if self.mode is TableMode.ON and self.mask is not None and self.mask.shape[0] != rows:
            self.stop()
        return self.take() if self.mode is TableMode.ON else None

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

    def committed(self, *, base: bool = False, audited: bool = False) -> None:
        """The save that scanned the table committed, a ``base`` or a delta (``audited``: whose
        scan audited the table): its pending rows are saved, the deltas toward its next audit
        counted (a delta that took the table's changes from its marks counts one, one that
        hashed it starts again), and marks that started with it now stand for the table's
        changes (STARTING -> ON)."""
        if base:
            self.restart_audits()
        else:
            marked = self.mode is TableMode.ON and not audited
            self.deltas_since_audit = self.deltas_since_audit + 1 if marked else 0
        if self.mode is TableMode.STARTING:
            self.mode = TableMode.ON
        self.settle()

    def restored(self, rows: int, device: torch.device) -> None:
        """The table was just restored: it matches its reference, so marks from now on stand for
        its changes (-> ON), unless it is hashed for good."""
        self.restart_audits()
        if self.mode is not TableMode.HASHING:
            self.begin(rows, device)
            self.mode = TableMode.ON

    def restart_audits(self) -> None:
        """After a base or a restore: the deltas toward the next audit start at this table's
        share of ``audit_every`` (see :class:`Canary`)."""
        every = self.canary.audit_every
        self.deltas_since_audit = int(self.audit_share * every) if every is not None else 0

    def stop(self) -> None:
        """Stops recording; the next save hashes the table (``mode`` OFF, or stays HASHING)."""
        with self._lock:
            self.mask = None
            self.log = None
        self.pending = None
        if self.mode is not TableMode.HASHING:
            self.mode = TableMode.OFF
