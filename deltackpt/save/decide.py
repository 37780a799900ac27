"""The decide phase of a save, on the coordinator: base or delta, and what each part holds."""

from __future__ import annotations

import math

import torch

from ..format import dtypes
from ..format.manifest import Manifest
from ..policy import BasePolicy, ChainState
from .planner import GlobalPlan, TensorPlan
from .scan import PartScan
from .types import Kind, SavePlan


def decide(policy: BasePolicy, head: Manifest | None, chain: ChainState, plan: GlobalPlan,
           scans: list[PartScan], *, step: int, attempt: str) -> SavePlan:
    """Base or delta by the policy, why, and the rows or chunks each part will hold."""
    kind: Kind
    if head is None:
        kind, reason = Kind.BASE, "no earlier step saved or restored by this checkpointer"
    elif not all(s.complete for s in scans):
        kind, reason = Kind.BASE, "a tensor is new, or its dtype, shape or layout changed"
    else:
        full_bytes = sum(tensor_bytes(t) for t in plan.tensors.values())
        decision = policy.decide(chain, sum(s.delta_bytes for s in scans), full_bytes)
        kind, reason = Kind(decision.kind), decision.reason
    if kind == Kind.BASE:
        changed = {(t.key, p.path): p.box.shape[0] if p.box.shape else 1
                   for t in plan.tensors.values() for p in t.parts}
    else:
        changed = {(s.key, s.path): s.changed for s in scans}
    return SavePlan(step, kind, reason, attempt, plan, changed)


def itemsize(dtype_name: str) -> int:
    return torch.empty((), dtype=dtypes.from_name(dtype_name)).element_size()


def tensor_bytes(t: TensorPlan) -> int:
    return math.prod(t.global_shape) * itemsize(t.dtype)
