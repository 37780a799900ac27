"""A restore into a live state, on every rank: the coordinator finds the chain and sends every
rank its root records (never their parts), each rank plans against its own tensors, and together
they must hold every saved tensor; then each rank reads what its tensors need, the part tables
of their tensors included (see :meth:`deltackpt.Checkpointer.restore`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import torch

from .. import statetree
from ..collectives import Collective
from ..collector import paused
from ..errors import KeyMismatchError
from ..format.manifest import Manifest
from ..io.reader import ChainReader
from ..io.staging import StagingPool
from ..store import Store
from .planning import RestorePlan, fill, plan_restore

if TYPE_CHECKING:
    from ..tracking.changes import ChangeTracker


@paused()  # a collection of a trainer's heap mid-restore took 0.22 s of a TorchRec one
def restore(state: Mapping[str, Any], step_of: Callable[[], int], *, store: Store, coll: Collective,
            pool: StagingPool, executor: Executor, tracker: ChangeTracker) -> list[Manifest]:
    """Fills ``state`` in place from the chain of the step ``step_of`` returns (called on the
    coordinator), then resets ``tracker`` to the restored tensors, with the row hashes the reads
    took on the way (:mod:`deltackpt.io.row_hashes`). Returns the chain this rank read: the
    step's chain resolved again where a compaction and GC replaced it meanwhile (see
    :meth:`Store.read_chain`).

    Raises:
        KeyMismatchError, DtypeMismatchError, ShapeMismatchError: ``state`` does not match what
            was saved; nothing was changed.
        CheckpointAborted: on several ranks, any rank's failure.
    """
    found: list[Manifest] = []  # the coordinator's

    def read_chain() -> list[tuple[str, bytes]]:
        found.extend(store.chain(step_of()))
        return [store.root(m) for m in found]

    roots = coll.one("read_chain", read_chain)
    chain = found or [store.parse(key, data) for key, data in roots]
    m = chain[-1]

    def check() -> tuple[set[str], RestorePlan]:
        plan = plan_restore(state, m, partial=coll.size > 1)
        return plan.covered, plan

    covered, plan = coll.each("restore_plan", check)
    if set().union(*covered) != set(m.tensors):
        raise KeyMismatchError(sorted(set(m.tensors) - set().union(*covered)), [])

    def read(through: list[Manifest]) -> list[Manifest]:
        """Fills the state from ``through``: ``chain``, or the chain of its step resolved again
        (see :meth:`Store.read_chain`), whose last record may lay the tensors out otherwise."""
        last = through[-1]
        planned = plan if last is m else plan_restore(state, last, partial=coll.size > 1)
        live = _local_tensors(state)
        reader = ChainReader(store.storage, through, pool, executor, planned.covered)
        with pool.staging():  # the warm of track() waits: it faulted pages beside the reads
            hashes = fill(planned, last, reader, tracker.hashed_by_reads(live))
        if planned.steps:  # flattened again: loading an optimizer's state replaces its tensors
            live = _local_tensors(state)
        # Hashed as saves hash them: their values' bytes (a conjugate or negative view's are not its own).
        tracker.reset({k: t.resolve_conj().resolve_neg().contiguous() for k, t in live.items()}, hashes)
        return through

    read_from: list[list[Manifest]] = []  # this rank's
    coll.all("restore_read", lambda: read_from.append(store.read_chain(chain, read)))
    return read_from[0]


def _local_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's tensors of ``state``, by flat key."""
    return {k: s.local for k, s in statetree.flatten(state).tensors.items()}
