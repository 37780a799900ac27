"""Matching a live state against a saved one, for an in-place restore.

Restore is strict: every check runs before any byte is read, and a mismatch raises one typed
error naming the key(s) and both values, leaving the live state untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import dtypes, statetree
from .errors import DtypeMismatchError, KeyMismatchError, ShapeMismatchError, StateError
from .manifest import Manifest


@dataclass
class RestorePlan:
    """Tensors to fill in place, and what to do once every tensor is read.

    Attributes:
        targets: live tensors to fill, by flat key.
        steps: callbacks run with every restored tensor by key (setting plain values, loading
            optimizers).
    """

    targets: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[Callable[[Mapping[str, torch.Tensor]], None]] = field(default_factory=list)

    def finish(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for step in self.steps:
            step(tensors)


def plan_restore(state: Mapping[str, Any], manifest: Manifest) -> RestorePlan:
    """Checks ``state`` against ``manifest`` and plans how to restore into it.

    Raises:
        KeyMismatchError: keys missing or unexpected, anywhere in the nesting.
        DtypeMismatchError, ShapeMismatchError: a tensor differs from the saved one.
        StateError: a value's kind differs (a tensor saved where the target holds a dict...).
    """
    if not isinstance(state, MutableMapping):
        raise StateError(f"state must be a mutable mapping, got {type(state).__name__}")
    plan = RestorePlan()
    missing: list[str] = []
    unexpected: list[str] = []
    _walk(state, manifest.tree, "", manifest, plan, missing, unexpected)
    if missing or unexpected:
        raise KeyMismatchError(missing, unexpected)
    return plan


def _walk(live: Any, node: dict[str, Any], path: str, m: Manifest, plan: RestorePlan,
          missing: list[str], unexpected: list[str]) -> None:
    (kind, body), = node.items()
    where = path or "<root>"
    if isinstance(live, torch.Tensor):
        if kind != "tensor":
            raise StateError(f"{where}: the target is a tensor, the checkpoint holds a {kind}")
        rec = m.tensors[body]
        saved = dtypes.from_name(rec.dtype)
        if live.dtype != saved:
            raise DtypeMismatchError(f"{where}: target dtype {live.dtype} != saved {saved}")
        if tuple(live.shape) != rec.shape:
            raise ShapeMismatchError(f"{where}: target shape {tuple(live.shape)} != saved {rec.shape}")
        plan.targets[body] = live.detach()
        return
    if isinstance(live, nn.Module):
        sd = live.state_dict()
        _walk(sd, node, path, m, plan, missing, unexpected)
        if any(not isinstance(v, torch.Tensor) for v in sd.values()):
            plan.steps.append(lambda ts: live.load_state_dict(statetree.build(node, ts)))
        return
    if statetree.is_stateful(live) and not isinstance(live, Mapping):
        # Optimizers: the live state may be empty (not stepped yet), so load the saved one whole.
        plan.steps.append(lambda ts: live.load_state_dict(statetree.build(node, ts)))
        return
    if isinstance(live, MutableMapping):
        if kind != "dict":
            raise StateError(f"{where}: the target is a dict, the checkpoint holds a {kind}")
        saved = dict((k, v) for k, v in body)
        join = (lambda k: f"{path}/{k}") if path else str
        missing += [join(k) for k in saved if k not in live]
        unexpected += [join(k) for k in live if k not in saved]
        for k, child in saved.items():
            if k in live:
                _child(live, k, child, join(statetree.key_part(k)), m, plan, missing, unexpected)
        return
    if isinstance(live, MutableSequence):
        if kind != "list" or len(body) != len(live):
            raise StateError(f"{where}: the target is a list of {len(live)}, the checkpoint holds "
                             f"{'a list of ' + str(len(body)) if kind == 'list' else 'a ' + kind}")
        for i, child in enumerate(body):
            _child(live, i, child, f"{path}/{i}", m, plan, missing, unexpected)
        return
    raise StateError(f"{where}: cannot restore into a {type(live).__name__} in place")


def _child(parent: Any, k: Any, node: dict[str, Any], path: str, m: Manifest, plan: RestorePlan,
           missing: list[str], unexpected: list[str]) -> None:
    live = parent[k]
    mutable = isinstance(live, (torch.Tensor, nn.Module, MutableMapping, MutableSequence))
    if mutable or statetree.is_stateful(live):
        _walk(live, node, path, m, plan, missing, unexpected)
    else:
        # Immutable values (numbers, strings, tuples) are replaced in their container.
        def assign(ts: Mapping[str, torch.Tensor]) -> None:
            parent[k] = statetree.build(node, ts)

        plan.steps.append(assign)
