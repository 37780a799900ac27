"""Retention and garbage collection.

:class:`Retention` says which committed steps must stay restorable. :func:`collect` then, in
this order, each step durable before the next:

1. drops the commit records of steps that are not retained and that no retained step's chain
   passes through (newest first, so every step still listed keeps its chain), then the
   compaction bases no retained chain uses; records go before data, so a crash leaves
   unreferenced data, never a record pointing at deleted data;
2. deletes attempt folders that no record refers to, and commit temp files, once they are older
   than the grace period.

The writer lease (:mod:`deltackpt.ops.lease`) names the step the holder's next delta applies to
(``head``) and the folder of its save in flight (``attempt``); GC keeps both, whatever the
retention and however long the save runs. The lease is read once before the records are chosen
and again after they are deleted, and the writer publishes its head before it checks that the
head's record still exists: so either the writer finds its head gone (its save becomes a base) or
GC finds it named in the lease and puts back the records of its chain it had just deleted (their
folders are deleted last, so they are still there). Folders of compaction runs in flight and of
writers fenced off by a take-over are protected by the grace period alone (a compaction whose
folder went finds it before its commit, and commits nothing).

Replacement bases are committed by compaction before GC runs, so nothing a retained step needs
is ever deleted. A dry run reports the same without deleting.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from . import lease
from ..errors import ManifestError, SettingError, StepNotFoundError
from ..format.manifest import Manifest
from ..format.record_checks import parse_manifest
from ..format.layout import BASES, COMMITS, STEPS, base_key, commit_key
from ..store import Store


@dataclass(frozen=True)
class Retention:
    """Which steps stay restorable.

    Attributes:
        keep_last: the newest this many steps (None: all).
        keep_every: also every step divisible by this.
        keep: also these steps (tagged).

    Example:
        >>> sorted(Retention(keep_last=2, keep_every=10).retained([5, 10, 15, 20, 25]))
        [10, 20, 25]
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise SettingError(f"{name} must be a positive int or None, got {value!r}")

    def retained(self, steps: list[int]) -> set[int]:
        if self.keep_last is None:
            return set(steps)
        kept = set(sorted(steps)[-self.keep_last :])
        if self.keep_every:
            kept |= {s for s in steps if s % self.keep_every == 0}
        return kept | (set(steps) & set(self.keep))


@dataclass
class GCReport:
    """What :func:`collect` removed (or, in a dry run, would remove).

    Attributes:
        dropped_steps: steps whose records were removed.
        dropped_bases: steps whose compaction bases were removed.
        deleted: attempt folders and temp files removed.
        freed_bytes: their bytes.
        young: unreferenced folders kept because they are younger than the grace period.
        aborted_uploads: unfinished uploads (an object store's multipart uploads) older than
            the grace period, abandoned by saves that died, that were aborted.
        dry_run: whether nothing was deleted.
    """

    dropped_steps: list[int] = field(default_factory=list)
    dropped_bases: list[int] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    young: list[str] = field(default_factory=list)
    aborted_uploads: int = 0
    dry_run: bool = False


def collect(store: Store, retention: Retention, *, grace_seconds: float = 3600.0,
            dry_run: bool = False, now: float | None = None) -> GCReport:
    """Drops steps not retained and deletes what no remaining record refers to.

    Raises:
        SettingError: ``grace_seconds`` is negative, NaN or infinite.
        DeltackptError: a retained step's chain is broken (nothing is deleted then).
    """
    if (isinstance(grace_seconds, bool) or not isinstance(grace_seconds, (int, float))
            or not math.isfinite(grace_seconds) or grace_seconds < 0):
        raise SettingError(f"grace_seconds must be a finite number >= 0, got {grace_seconds!r}")
    report = GCReport(dry_run=dry_run)
    holder = lease.read(store.storage)[1]
    steps = store.steps()
    retained = retention.retained(steps)
    needed_steps: set[int] = set(retained)
    needed_bases: set[int] = set()
    chains = [store.chain(step) for step in sorted(retained)]  # raises on a broken chain
    if holder is not None:
        chains.append(holder_chain(store, holder, {}))
    for m in (m for chain in chains for m in chain):
        (needed_bases if m.compacts is not None else needed_steps).add(m.step)
    report.dropped_steps = [s for s in steps if s not in needed_steps]
    report.dropped_bases = [s for s in store.compacted_steps() if s not in needed_bases]
    deleted: dict[str, bytes] = {}
    if not dry_run:
        deleted = _read_all(store, [commit_key(s) for s in reversed(report.dropped_steps)]
                            + [base_key(s) for s in report.dropped_bases])
        # Newest first: a step's chain runs back to older steps, so after a crash here every
        # step still listed still has its whole chain.
        for key in deleted:
            store.storage.delete(key)
        store.storage.sync_folders([COMMITS, BASES])
        store.forget()
    folders = [a for a in store.storage.list(STEPS) if a != "zarr.json"]
    holder = lease.read(store.storage)[1]
    referenced: set[str] = set()
    if holder is not None:
        if holder.attempt is not None:
            referenced.add(holder.attempt)
        if not dry_run:
            _put_back(store, holder_chain(store, holder, deleted), deleted, report)
    referenced |= _attempts(store)
    now = time.time() if now is None else now
    garbage = [f"{STEPS}/{a}" for a in folders if a not in referenced]
    garbage += [f"{folder}/{name}" for folder in (COMMITS, BASES)
                for name in store.storage.list(folder) if name.startswith(".")]
    for path in garbage:
        size, newest = store.storage.usage(path)
        if now - newest < grace_seconds:
            report.young.append(path)
            continue
        report.deleted.append(path)
        report.freed_bytes += size
        if not dry_run:
            store.storage.delete_tree(path)
    if not dry_run and report.deleted:
        store.storage.sync_folders([STEPS, COMMITS, BASES])
    if not dry_run:
        report.aborted_uploads = store.storage.abort_stale_uploads(now - grace_seconds)
    return report


def _read_all(store: Store, keys: list[str]) -> dict[str, bytes]:
    """The bytes of the records ``keys``, in order (those that vanished meanwhile left out)."""
    found = {}
    for key in keys:
        try:
            found[key] = store.storage.read(key)
        except FileNotFoundError:
            pass
    return found


def holder_chain(store: Store, holder: lease.Lease, deleted: dict[str, bytes] | None = None
                 ) -> list[Manifest]:
    """The chain the lease holder's next delta builds on: that of the step it saved last if its
    save committed (its attempt has a record), else that of the head it published."""
    deleted = deleted or {}
    step, _, _ = (holder.attempt or "").partition("-")
    if step.isdigit() and holder.attempt is not None:
        chain = _chain_of(store, (int(step), holder.attempt), deleted)
        if chain:
            return chain
    return [] if holder.head is None else _chain_of(store, holder.head, deleted)


def _chain_of(store: Store, head: tuple[int, str], deleted: dict[str, bytes]) -> list[Manifest]:
    """The chain of the record of step ``head[0]`` saved as ``head[1]``, as :meth:`Store.chain`
    finds it, reading the records that this GC ``deleted`` from memory; empty where that record
    is not in the store (a writer whose head it is finds it gone and writes a base)."""

    def record(key: str) -> Manifest | None:
        try:
            data = deleted[key] if key in deleted else store.storage.read(key)
            return parse_manifest(data, key, store.read_table)
        except (FileNotFoundError, ManifestError):
            return None

    step, attempt = head
    chain: list[Manifest] = []
    while True:
        base = record(base_key(step))
        if base is not None and attempt in (base.compacts, base.attempt):
            return [base, *chain]
        m = record(commit_key(step))
        if m is None or m.attempt != attempt:
            return []
        chain.insert(0, m)
        if m.kind != "delta" or m.parent is None or m.parent_attempt is None:
            return chain
        step, attempt = m.parent, m.parent_attempt


def _put_back(store: Store, chain: list[Manifest], deleted: dict[str, bytes], report: GCReport) -> None:
    """Recreates the records of ``chain`` that this GC deleted (the writer builds on them)."""
    keys = [base_key(m.step) if m.compacts is not None else commit_key(m.step) for m in chain]
    back = [k for k in keys if k in deleted]
    for key in back:
        store.storage.put_if_absent(key, deleted[key])
    if back:
        steps = {m.step for m in chain if m.compacts is None and commit_key(m.step) in back}
        bases = {m.step for m in chain if m.compacts is not None and base_key(m.step) in back}
        report.dropped_steps = [s for s in report.dropped_steps if s not in steps]
        report.dropped_bases = [s for s in report.dropped_bases if s not in bases]


def _attempts(store: Store) -> set[str]:
    """The attempt folders of every record in the store now."""
    found = set()
    for step in store.steps():
        try:
            found.add(store.manifest(step).attempt)
        except StepNotFoundError:
            continue  # withdrawn or dropped meanwhile
    for step in store.compacted_steps():
        m = store.compacted(step)
        if m is not None:
            found.add(m.attempt)
    return found
