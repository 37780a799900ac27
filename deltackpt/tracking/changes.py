"""Finding what changed since the last commit, exactly: from row marks where a table is tracked,
from content hashes everywhere else.

Tensors with two or more dimensions are row-sparse: their change set is a sorted list of row ids
(along dimension 0). So is a 1-d tensor aligned with a table's rows (one value per row: a
row-wise Adagrad sum), whose rows are its elements (declared, or inferred for optimizer state:
:meth:`~deltackpt.tracking.rows.RowTracker.aligned`), so it rides with the table's rows. Others
(0-d, 1-d) are dense: their change set lists fixed-size chunks of their bytes. Both are found
one of two ways:

* Hashes: a 64-bit hash per row or chunk, compared with the hashes of the last commit. Hashes
  compare bits, so a row holding the same NaN payload is unchanged and ``-0.0`` differs from
  ``0.0``. A change goes unseen only on an XXH64 collision (about 2^-64 per changed row or chunk).
* Marks (:mod:`deltackpt.tracking.rows`): for a tracked table and its aligned optimizer state, the
  rows its lookups marked since the last commit, with no pass over the table. The hashes of those
  rows (or of the chunks holding them, for dense state) are recomputed, so the last commit's hashes
  stay current at O(changed) cost: a delta's writer hashes them from the copies it writes
  (:meth:`deltackpt.format.encodings.base.Encoding.encode`), and :meth:`ChangeTracker.adopt` hashes
  whatever no writer did. Each such save also re-hashes a sample of distinct unmarked rows (the
  :class:`~deltackpt.tracking.marks.Canary`) and compares them with the last commit: a mismatch
  means something changes rows without a lookup (weight decay, dense Adam, a custom optimizer).
  It logs a warning naming the table, hashes that table and its optimizer state from then on, and
  the save writes the rows the hashes find. A sample finds a rare stray change only with the
  probability the canary documents, so every ``audit_every`` deltas a full audit hashes the whole
  table instead and the delta writes every changed row, and after each base the tables are hashed
  whole.

A table's marks become its change set only once they cover everything since the last commit: its
first save after tracking starts (or after it was resized) hashes it and starts recording, and a
restore restarts the marks from the restored state. Marks are dropped only when the save that
used them commits; those of a failed save go into the next one. After a restore, the references
are the row hashes the restore's reads took from the rows they wrote, or that the base stored
beside them (:mod:`deltackpt.io.row_hashes`).
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Container, Mapping

import numpy as np
import torch

from .. import kernels  # installed from kernels/, see pyproject
from ..format.encodings import dense_chunk_elems
from .hashing import Hasher
from .marks import TableMode, TrackedTable
from .joined import Joined, Layout, lay_out, scan_small, settle
from .references import NO_IDS, SMALL_TENSOR_BYTES, Reference, TensorChange, is_row_sparse, is_small, joined_piece
from .rows import RowTracker, TrackedGroup

log = logging.getLogger(__name__)
_SAME = operator.attrgetter("same")


class ChangeTracker:
    """The last commit's hashes of every tensor, and the marks of tracked tables.

    Call order: :meth:`scan` at each save, then :meth:`adopt` once that save has committed;
    :meth:`reset` after a restore.

    Args:
        dense_chunk_bytes: chunk size for dense tensors' hashes and delta chunks.
        hasher: where hashes are computed; default: on the calling thread.
        aligned: 1-d tensors declared aligned with a table's rows, by flat key, each with its
            table's flat key (see :meth:`RowTracker.aligned`).

    Attributes:
        rows: the tracked tables; ``Checkpointer.track`` and ``Checkpointer.mark`` feed it.
    """

    def __init__(self, dense_chunk_bytes: int, hasher: Hasher | None = None,
                 aligned: Mapping[str, str] | None = None):
        self.dense_chunk_bytes = dense_chunk_bytes
        self.hasher = hasher if hasher is not None else Hasher()
        self.rows = RowTracker(aligned)
        self._refs: dict[str, Reference] = {}
        self._aligned: set[str] = set()  # the aligned keys of the last scan or restore
        self._scanned: list[TrackedTable] = []  # tables of the last scan, for adopt
        self._audited: set[int] = set()  # ids of the tables the last scan audited
        # The references of the tensors the last commit's scan hashed in one call, joined: each
        # one's hashes are its reference's (see _adopted_joined). None: join them afresh.
        self._joined: Joined | None = None
        self._scanned_joined: tuple[Joined, list[TensorChange]] | None = None  # of the last scan
        self._layout: Layout | None = None  # how the last scan of tensors hashed split them
        self._hashed: dict[str, torch.Tensor] = {}  # the tensors the last scan hashed

    def chunk_elems(self, t: torch.Tensor) -> int:
        """Elements per dense chunk of ``t``, as its delta's chunks are stored."""
        return dense_chunk_elems(t.numel(), t.element_size(), self.dense_chunk_bytes)

    def hash(self, t: torch.Tensor, by_rows: bool) -> torch.Tensor:
        """Every row's (``by_rows``; a 1-d tensor's rows are its elements) or chunk's hash of
        ``t``, on the CPU."""
        return self._hash_all([(t, by_rows)])[0]

    def _hash_all(self, tensors: list[tuple[torch.Tensor, bool]]) -> list[torch.Tensor]:
        """:meth:`hash` of each ``(tensor, by_rows)``, in one run of the hasher (see :meth:`Hasher.many`)."""
        return self.hasher.many([((t if t.dim() >= 2 else t.view(-1, 1)), None) if by_rows
                                 else (t, self.chunk_elems(t) * t.element_size()) for t, by_rows in tensors])

    def by_rows(self, key: str, t: torch.Tensor) -> bool:
        """Whether ``t``'s changes are rows (else dense chunks): it has two dimensions or more,
        or is aligned with a table's rows."""
        return is_row_sparse(t) or key in self._aligned

    def keys(self) -> set[str]:
        """Keys of the tensors the last commit (or restore) hashed."""
        return set(self._refs)

    # -- the three entry points -----------------------------------------------------------------

    def scan(self, tensors: dict[str, torch.Tensor], held: Container[str] | None = None) -> dict[str, TensorChange]:
        """The change set of every tensor since the last commit: from marks for tracked tables
        whose marks are complete, from hashes for the rest (``held``: see :meth:`RowTracker.resolve`).
        A tensor given again as the same object must have kept its dtype, shape and strides (the
        saver gives its own views, which nothing reshapes): how the last scan split them is kept."""
        out: dict[str, TensorChange] = {}
        self._scanned = []
        self._audited = set()
        self._scanned_joined = None
        self.rows.poll()
        groups = self.rows.resolve(tensors, held)
        self._aligned = self.rows.aligned(tensors, groups)
        marked = [group.table.marked(group.rows) for group in groups]
        missed = self._canaries(groups, marked, tensors)
        for group, ids, keys in zip(groups, marked, missed):
            out.update(self._scan_group(group, {k: tensors[k] for k in group.keys}, ids, keys))
            self._scanned.append(group.table)
        self._hashed = {k: t for k, t in tensors.items() if k not in out} if out else tensors
        out.update(self._scan_all(self._hashed))
        return out

    def adopt(self, tensors: dict[str, torch.Tensor], changes: dict[str, TensorChange], *,
              base: bool = False) -> dict[str, TensorChange]:
        """Makes the scanned hashes the reference and drops the marks the save used, after the
        save that used them committed; a ``base`` restarts the tables' audit counts (its change
        sets come from :meth:`hash_whole`). Of the same tensors as the references', only those
        whose change set is not their reference's "unchanged" are looked at. Returns, after a
        base, the change set the next scan gives each of its small tensors if unchanged."""
        keys = list(tensors)
        if len(keys) == len(self._refs) and all(map(self._refs.__contains__, keys)):
            refs = dict(self._refs)
            keys = list(itertools.compress(keys, map(operator.is_not, map(changes.__getitem__, keys),
                                                     map(_SAME, map(refs.__getitem__, keys)))))
        else:
            refs = {}
        for key in keys:
            t, ch = tensors[key], changes[key]
            ref = self._refs.get(key)
            if ref is not None and ch is ref.same:  # unchanged: the reference stays
                refs[key] = ref
            elif ch.partial and ch.changed is not None:
                ref = self._refs[key]
                hashes = ch.hashes if ch.hashes is not None else self._hash_units(key, t, ch.changed)
                # numpy, on this thread: torch's index_put wakes its thread pool, slow on a busy node
                ref.hashes.numpy()[ch.changed.cpu().numpy()] = hashes.numpy()
                refs[key] = ref
            else:
                by_rows = self.by_rows(key, t)
                refs[key] = Reference(t.dtype, tuple(t.shape),
                                       ch.hashes if ch.hashes is not None else self.hash(t, by_rows), by_rows)
        self._refs = refs
        self._joined = self._adopted_joined(changes)
        for table in self._scanned:
            table.committed(base=base, audited=id(table) in self._audited)
        self._scanned = []
        self._audited = set()
        return self._settle() if base else {}

    def hash_whole(self, tensors: dict[str, torch.Tensor],
                   changes: dict[str, TensorChange]) -> dict[str, TensorChange]:
        """A base's change sets, with every tensor hashed whole that the scan and the base's
        writer left unhashed (or hashed from marks only: a stray change the base stores is then
        no change to the next audit). Call it once the base is staged, before the training
        changes the tensors again."""
        hashes, joined = self.hash_many({k: tensors[k] for k, ch in changes.items() if ch.partial or ch.hashes is None})
        out = {k: TensorChange(ch.changed, hashes[k], aligned=ch.aligned) if k in hashes else ch
               for k, ch in changes.items()}
        if joined is not None and (self._scanned_joined is None or len(joined.keys) > len(self._scanned_joined[0].keys)):
            # So that the next delta compares with these hashes as they are, once adopted.
            self._scanned_joined = joined, [out[k] for k in joined.keys]
        return out

    def hash_many(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Joined | None]:
        """:meth:`hash` of every tensor (by key: by rows or chunks as :meth:`by_rows` says); the
        small CPU ones all in one call (:class:`deltackpt.kernels.Segments`, split among the
        hasher's threads only when it holds megabytes): a state of thousands of tiny tensors
        costs one call, not thousands. Returns the hashes by key (those of that
        call are views of its hashes), and what that call hashed, if any."""
        pieces = {k: p for k, t in tensors.items() if (p := self._piece(t, self.by_rows(k, t)))}
        found, joined = {}, None
        if pieces:
            segments = kernels.Segments([tensors[k] for k in pieces], list(pieces.values()))
            joined = Joined(list(pieces), self.hasher.segments(segments), segments)
            found = dict(zip(pieces, joined.hashes.split(np.diff(segments.ends, prepend=0).tolist())))
        rest = [k for k in tensors if k not in found]
        found.update(zip(rest, self._hash_all([(tensors[k], self.by_rows(k, tensors[k])) for k in rest])))
        return {k: found[k] for k in tensors}, joined

    def hashed_by_reads(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """The keys of ``tensors`` that a restore's reads hash as they write them: those whose
        references are a hash per row (the others': per chunk), but not the small ones, which
        :meth:`reset` hashes in one call (a restore of 8,000 tiny tables spent 0.8-1 s hashing
        each on its own)."""
        self._aligned = self.rows.aligned(tensors, self.rows.resolve(tensors))
        return {k for k, t in tensors.items() if self.by_rows(k, t) and not is_small(t)}

    def reset(self, tensors: dict[str, torch.Tensor],
              row_hashes: Mapping[str, torch.Tensor] | None = None) -> None:
        """Takes ``tensors`` (just restored) as the reference; tracked tables' marks restart.

        Args:
            tensors: the restored tensors by flat key.
            row_hashes: the hash of every row of some of them, as the restore's reads took it
                from the rows they wrote (:mod:`deltackpt.io.row_hashes`); the others are hashed
                here.
        """
        given = row_hashes or {}
        self._scanned = []
        self.rows.poll()  # marks from before the restore are stale
        groups = self.rows.resolve(tensors)
        self._aligned = self.rows.aligned(tensors, groups)

        by_rows = {k: self.by_rows(k, t) for k, t in tensors.items()}
        taken = {k: h for k, h in given.items()
                 if k in tensors and by_rows[k] and h.shape == (tensors[k].shape[0],)}
        hashed, _ = self.hash_many({k: t for k, t in tensors.items() if k not in taken})  # small ones: one call
        self._refs = {k: Reference(t.dtype, tuple(t.shape), taken[k] if k in taken else hashed[k], by_rows[k])
                      for k, t in tensors.items()}
        self._joined = self._scanned_joined = self._layout = None
        for group in groups:
            group.table.restored(group.rows, tensors[group.keys[0]].device)

    # -- internals ------------------------------------------------------------------------------

    def _piece(self, t: torch.Tensor, by_rows: bool) -> int:
        """:func:`~deltackpt.tracking.references.joined_piece` of ``t`` hashed by rows or chunks."""
        return joined_piece(t, None if by_rows else self.chunk_elems(t) * t.element_size())

    def _scan_all(self, tensors: dict[str, torch.Tensor]) -> dict[str, TensorChange]:
        """:meth:`_scan_hashes` of every tensor: the small ones hashed in one call and compared
        with their references in one pass (:func:`~deltackpt.tracking.joined.scan_small`), the
        others in one run of the hasher. How the tensors split is kept from scan to scan while
        they are the same (:class:`~deltackpt.tracking.joined.Layout`)."""
        layout = self._layout
        if layout is None or not layout.fits(tensors, self._aligned):
            layout = self._layout = lay_out(tensors, self._refs, self._aligned, self._piece, self._joined)
        if layout is None:  # new tensors: no layout to keep (their references come with the commit)
            new = {k: TensorChange(None, None, aligned=self._aligned_1d(k, t)) for k, t in tensors.items()
                   if (ref := self._refs.get(k)) is None or not ref.matches(t, self.by_rows(k, t))}
            new.update(self._scan_hashes({k: t for k, t in tensors.items() if k not in new}))
            return {k: new[k] for k in tensors}
        out = self._scan_hashes({k: tensors[k] for k in layout.large})
        if not layout.small:
            return out
        small, joined = scan_small(layout, self.hasher.segments(layout.segments), self._refs, self._aligned,
                                   self._joined)
        self._scanned_joined = (joined, layout.found)
        out.update(small)
        return small if len(out) == len(small) else {k: out[k] for k in tensors}  # in their order

    def _settle(self) -> dict[str, TensorChange]:
        """After a base: the layout of the tensors its scan hashed, settled (see
        :func:`~deltackpt.tracking.joined.settle`) with the base, not at the first delta's scan."""
        if self._layout is None or not self._layout.fits(self._hashed, self._aligned):
            self._layout = lay_out(self._hashed, self._refs, self._aligned, self._piece, self._joined)
        if (layout := self._layout) is None:
            return {}
        settle(layout, list(map(self._refs.__getitem__, layout.small)), self._aligned)
        return dict(zip(layout.small, layout.found))

    def _adopted_joined(self, changes: dict[str, TensorChange]) -> Joined | None:
        """The last scan's joined hashes, if ``changes`` (committed) kept the change set of every
        tensor hashed in its one call: their hashes are then the new references, joined (an
        unchanged tensor's reference stays, equal to its hashes). Else None."""
        scanned, self._scanned_joined = self._scanned_joined, None
        if scanned is None or not all(map(operator.is_, map(changes.get, scanned[0].keys), scanned[1])):
            return None
        if self._layout is None or scanned[0].keys is not self._layout.small:  # a base's (hash_whole)
            for key, piece in zip(scanned[0].keys, scanned[0].segments.pieces):  # as lay_out would find them
                self._refs[key].piece = piece
        return scanned[0]

    def _aligned_1d(self, key: str, t: torch.Tensor) -> bool:
        """Whether ``t`` is a 1-d tensor whose changes are rows (see :meth:`RowTracker.aligned`)."""
        return key in self._aligned and t.dim() == 1

    def _scan_hashes(self, tensors: dict[str, torch.Tensor]) -> dict[str, TensorChange]:
        """The change sets of ``tensors`` from their hashes, all hashed in one run of the hasher."""
        out = {k: TensorChange(None, None, aligned=self._aligned_1d(k, t)) for k, t in tensors.items()
               if k not in self._refs or not self._refs[k].matches(t, self.by_rows(k, t))}
        hashed = [(k, t, self.by_rows(k, t)) for k, t in tensors.items() if k not in out]
        for (key, t, _), h in zip(hashed, self._hash_all([(t, by_rows) for _, t, by_rows in hashed])):
            out[key] = TensorChange((h != self._refs[key].hashes).nonzero().flatten(), h, aligned=self._aligned_1d(key, t))
        return {k: out[k] for k in tensors}

    def _scan_group(self, group: TrackedGroup, members: dict[str, torch.Tensor], ids: torch.Tensor | None,
                    missed: list[str]) -> dict[str, TensorChange]:
        """The change sets of a table's tensors ``members``: from its marked rows ``ids`` (None:
        marks off), unless it is audited now, or the canary ``missed`` changes of some."""
        table = group.table
        if ids is not None:
            if table.audits_now():
                return self._audit(group, members, ids)
            if not missed:
                return {k: self._from_marks(k, t, ids) for k, t in members.items()}
            log.warning(
                "tracked table %r: %s changed in rows that no lookup marked (weight decay, a "
                "dense optimizer update or a custom update?); detecting its changes by hashing "
                "from now on", table.name, ", ".join(missed))
            table.fall_back()
        table.hashed(group.rows, members[group.keys[0]].device)
        return self._scan_hashes(members)

    def _audit(self, group: TrackedGroup, members: dict[str, torch.Tensor],
               ids: torch.Tensor) -> dict[str, TensorChange]:
        """Hashes every row of a table whose marks are on and returns what the hashes find
        (so the delta writes any stray change); a change no mark explains stops the marks."""
        table = group.table
        self._audited.add(id(table))
        out = self._scan_hashes(members)
        missed = [k for k, ch in out.items() if ch.changed is not None and bool(
            (~torch.isin(ch.changed, self._units(k, members[k], ids))).any())]
        if missed:
            log.warning(
                "tracked table %r: the audit found %s changed in rows that no lookup marked "
                "(weight decay, a dense optimizer update or a custom update?); this delta writes "
                "them, and the table is hashed from now on", table.name, ", ".join(missed))
            table.mode = TableMode.HASHING
            table.stop()
        return out

    def _from_marks(self, key: str, t: torch.Tensor, ids: torch.Tensor) -> TensorChange:
        by_rows = self.by_rows(key, t)
        aligned = self._aligned_1d(key, t)
        ref = self._refs.get(key)
        if ref is None or not ref.matches(t, by_rows):
            return TensorChange(None, None, aligned=aligned)
        units = self._units(key, t, ids)
        return TensorChange(units, None if units.numel() else NO_IDS, partial=True, aligned=aligned)

    def _canaries(self, groups: list[TrackedGroup], marked: list[torch.Tensor | None],
                  tensors: dict[str, torch.Tensor]) -> list[list[str]]:
        """For each table whose marks are on (``marked``) and that is not audited now, the keys
        whose sampled unmarked rows differ from the last commit; the samples of every table's
        row-sparse tensors hashed in one run of the hasher (:meth:`Hasher.rows_at`)."""
        missed: list[list[str]] = [[] for _ in groups]
        checks: list[tuple[int, str, torch.Tensor]] = []  # table, key, the sampled rows' references
        sampled: list[tuple[torch.Tensor, torch.Tensor]] = []  # their tensor's rows, their ids
        for i, (group, ids) in enumerate(zip(groups, marked)):
            if ids is None or not group.rows or group.table.audits_now():
                continue
            sample = group.table.sample(group.rows, ids)
            for key in group.keys:
                t, ref = tensors[key], self._refs.get(key)
                by_rows = self.by_rows(key, t)
                if ref is None or not ref.matches(t, by_rows):
                    continue
                units = self._units(key, t, sample)
                if not by_rows and units.numel():  # only chunks that hold no marked row
                    units = units[~torch.isin(units, self._units(key, t, ids))]
                if not units.numel():
                    continue
                if by_rows:
                    checks.append((i, key, ref.hashes[units]))
                    sampled.append((t if t.dim() >= 2 else t.view(-1, 1), units))
                elif not torch.equal(self._hash_units(key, t, units), ref.hashes[units]):
                    missed[i].append(key)
        for (i, key, want), got in zip(checks, self.hasher.rows_at(sampled)):
            if not torch.equal(got, want):
                missed[i].append(key)
        return missed

    def _units(self, key: str, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The rows, or for a dense tensor the sorted unique chunks holding them."""
        if self.by_rows(key, t):
            return rows
        return torch.unique(rows // self.chunk_elems(t))

    def _hash_units(self, key: str, t: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
        """Hashes of rows or chunks ``units`` of ``t``, computed on ``t``'s device, on the CPU."""
        if self.by_rows(key, t):
            return self.hasher.rows_at([(t if t.dim() >= 2 else t.view(-1, 1), units)])[0]
        # A chunk's hash is the hash of its bytes, so whole chunks hash as the rows of a
        # (chunks, chunk_elems) view; the short last chunk, if any, on its own.
        ce = self.chunk_elems(t)
        flat = t.reshape(-1)
        whole = flat.numel() // ce
        out = torch.empty(units.numel(), dtype=torch.int64)
        inner = units < whole
        if inner.any():
            grid = flat[: whole * ce].view(whole, ce)
            out[inner] = self.hasher.rows_at([(grid, units[inner])])[0]
        if not inner.all():
            out[~inner] = self.hasher.rows(flat[whole * ce :].view(1, -1))
        return out
