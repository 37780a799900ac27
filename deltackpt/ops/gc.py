"""Retention and garbage collection.

:class:`Retention` says which committed steps must stay restorable. :func:`collect` then, in
this order, each step durable before the next:

1. drops the commit records of steps that are not retained and that no retained step's chain
   passes through (newest first, so every step still listed keeps its chain), then the
   compaction bases no retained chain uses; records go before data, so a crash leaves
   unreferenced data, never a record pointing at deleted data;
2. deletes attempt folders that no remaining record refers to, and commit temp files, once they
   are older than the grace period: a save in flight writes into a young folder that no record
   names yet, so the grace period must exceed the longest save.

Replacement bases are committed by compaction before GC runs, so nothing a retained step needs
is ever deleted. A dry run reports the same without deleting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import DeltackptError
from ..format.layout import BASES, COMMITS, STEPS, base_key, commit_key
from ..format.manifest import Manifest
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
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

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
        DeltackptError: a retained step's chain is broken (nothing is deleted then).
    """
    report = GCReport(dry_run=dry_run)
    steps = store.steps()
    retained = retention.retained(steps)
    needed_steps: set[int] = set(retained)
    needed_bases: set[int] = set()
    for step in sorted(retained):
        for m in store.chain(step):  # raises on a broken chain: then delete nothing
            (needed_bases if m.compacts is not None else needed_steps).add(m.step)
    report.dropped_steps = [s for s in steps if s not in needed_steps]
    report.dropped_bases = [s for s in store.compacted_steps() if s not in needed_bases]
    if not dry_run:
        # Newest first: a step's chain runs back to older steps, so after a crash here every
        # step still listed still has its whole chain.
        for s in reversed(report.dropped_steps):
            store.storage.delete(commit_key(s))
        for s in report.dropped_bases:
            store.storage.delete(base_key(s))
        store.storage.sync_folders([COMMITS, BASES])
        store.forget()
    referenced = {_attempt(store, s, base=False) for s in needed_steps}
    referenced |= {_attempt(store, s, base=True) for s in needed_bases}
    now = time.time() if now is None else now
    garbage = [f"{STEPS}/{a}" for a in store.storage.list(STEPS) if a != "zarr.json" and a not in referenced]
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


def _attempt(store: Store, step: int, *, base: bool) -> str:
    m: Manifest | None = store.compacted(step) if base else store.manifest(step)
    if m is None:
        raise DeltackptError(f"the compaction base of step {step} vanished during GC")
    return m.attempt
