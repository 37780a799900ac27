"""The decide phase of a save, on the coordinator: base or delta; and what each part holds."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future

from ..errors import StateError
from ..format.manifest import Manifest
from ..policy import BasePolicy, ChainState
from ..quantization import Choice
from ..store import Store
from .planner import GlobalPlan, PartPlan
from .scan import PartScan, ScanSummary
from .types import Kind, SavePlan


def decide(policy: BasePolicy, head: Manifest | None, chain: ChainState, plan: GlobalPlan,
           scans: Sequence[ScanSummary], *, step: int, attempt: str, store: Store | None = None,
           published: Future[None] | None = None, quantize: Mapping[str, Choice] | None = None
           ) -> SavePlan:
    """Base or delta by the policy, and why; a delta quantizes the tensors ``quantize`` names.
    ``scans``: each rank's scans of the parts it writes, summed up, by rank.

    First ``published`` ends: the lease names ``head`` and ``attempt`` (GC keeps both from then
    on, see :mod:`deltackpt.ops.gc`; the saver starts that write, which takes the lease at a
    checkpointer's first save, while the ranks plan and scan, and its
    error, such as WriterConflictError, is raised here). Then a head that is gone from the store
    (removed by GC before, or withdrawn by a writer that lost the lease) makes the save a base.
    Without ``store`` and ``published`` (a simulation of the control plane) neither happens."""
    if published is not None:
        published.result()
    # A tensor is aligned on some ranks, not on others, when a rank writing a part of it did not
    # scan it as aligned (each rank scans its tensors one way).
    split = sorted(k for k in aligned_keys(scans) if any(k not in scans[r].aligned for r in plan.writers[k][1]))
    if split:
        raise StateError(f"{split[0]}: aligned with a table's rows on some ranks, not on "
                         "others; declare it aligned (Checkpointer(aligned=...)) on every rank")
    kind: Kind
    if head is not None and store is not None and not store.holds(head.step, head.attempt):
        kind, reason = Kind.BASE, (f"step {head.step}, which the delta would apply to, is gone "
                                   "(removed by gc, or withdrawn by a writer that lost the lease)")
    elif head is None:
        kind, reason = Kind.BASE, ("no earlier step saved or restored by this checkpointer (or its last "
                                   "restore failed)")
    elif not all(s.complete for s in scans):
        kind, reason = Kind.BASE, "a tensor is new, or its dtype, shape or layout changed"
    else:
        decision = policy.decide(chain, sum(s.delta_bytes for s in scans), plan.state_bytes)
        kind, reason = Kind(decision.kind), decision.reason
    return SavePlan(step, kind, reason, attempt, dict(quantize or {}) if kind == Kind.DELTA else {})


def aligned_keys(scans: Sequence[ScanSummary]) -> set[str]:
    """The tensors some rank scanned as aligned."""
    return set().union(*(s.aligned for s in scans))


def counts(kind: Kind, parts: Iterable[PartPlan], scans: Iterable[PartScan]) -> list[int]:
    """Rows or chunks each part holds in a step of ``kind``, in order: in a base every row of
    ``parts``, in a delta what ``scans`` found changed: of the parts a rank writes, given with
    its own scans (one per part, in the same order)."""
    if kind == Kind.BASE:
        return [p.box.shape[0] if p.box.shape else 1 for p in parts]
    return list(map(_CHANGED, scans))


_CHANGED = operator.attrgetter("changed")
