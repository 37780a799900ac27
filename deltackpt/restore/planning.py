"""Matching a live state against a saved one, for an in-place restore.

Restore is strict: every check runs before any byte is read, and a mismatch raises one typed
error naming the key(s) and both values, leaving the live state untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from .. import statetree
from ..errors import (
    DtypeMismatchError,
    KeyMismatchError,
    ShapeMismatchError,
    StateError,
)
from ..format import dtypes
from ..format.manifest import Manifest
from ..io.reader import ChainReader
from ..io.row_hashes import RowHashes
from ..sharding import Box, Shard, as_shard, is_dtensor


@dataclass
class RestorePlan:
    """Tensors to fill in place, and what to do once every tensor is read.

    Attributes:
        targets: live tensors (as this rank's shards) to fill, by flat key.
        covered: every saved tensor this rank restores: the targets, and tensors loaded whole
            for an object's ``load_state_dict``.
        steps: callbacks run with every restored tensor by key (setting plain values, loading
            optimizers).
    """

    targets: dict[str, Shard] = field(default_factory=dict)
    covered: set[str] = field(default_factory=set)
    steps: list[Callable[[Mapping[str, torch.Tensor]], None]] = field(default_factory=list)

    def finish(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for step in self.steps:
            step(tensors)


def plan_restore(state: Mapping[str, Any], manifest: Manifest, *, partial: bool = False) -> RestorePlan:
    """Checks ``state`` against ``manifest`` and plans how to restore into it.

    Args:
        state: the live state.
        manifest: the step's record.
        partial: allow saved entries missing from ``state`` (on several ranks, each may hold
            only some tensors; the caller checks that together they hold all).

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
    if unexpected or (missing and not partial):
        raise KeyMismatchError(missing, unexpected)
    return plan


def _walk(live: Any, node: dict[str, Any], path: str, m: Manifest, plan: RestorePlan,
          missing: list[str], unexpected: list[str]) -> None:
    (kind, body), = node.items()
    where = path or "<root>"
    adapter = statetree.integration(live)
    if adapter is not None:
        def saved_shape(keys: tuple[str, ...]) -> tuple[int, ...] | None:
            rec = m.tensors.get(statetree.child_key(path, *keys))
            return None if rec is None else rec.shape

        view, finish = adapter.prepare_restore(live, saved_shape)
        _walk(view.tree, node, path, m, plan, missing, unexpected)
        plan.steps.append(lambda ts: finish())
        return
    if isinstance(live, (torch.Tensor, Shard)):
        if kind != "tensor":
            raise StateError(f"{where}: the target is a tensor, the checkpoint holds a {kind}")
        rec = m.tensors[body]
        shard = as_shard(live, where)
        saved_dtype = dtypes.from_name(rec.dtype)
        if shard.local.dtype != saved_dtype:
            raise DtypeMismatchError(f"{where}: target dtype {shard.local.dtype} != saved {saved_dtype}")
        if shard.global_shape != rec.shape:
            what = "global shape" if isinstance(live, Shard) or is_dtensor(live) else "shape"
            raise ShapeMismatchError(f"{where}: target {what} {shard.global_shape} != saved {rec.shape}")
        plan.targets[body] = Shard(shard.local.detach(), global_shape=shard.global_shape,
                                   global_offset=shard.global_offset)
        plan.covered.add(body)
        return
    if isinstance(live, nn.Module):
        sd = live.state_dict()
        _walk(sd, node, path, m, plan, missing, unexpected)
        if any(not isinstance(v, torch.Tensor) for v in sd.values()):
            plan.steps.append(partial(_load, live, node, where))
        return
    if statetree.is_stateful(live) and not isinstance(live, Mapping):
        # Optimizers: the live state may be empty (not stepped yet), so load the saved one whole.
        if isinstance(live, Optimizer) and type(live).state_dict is Optimizer.state_dict:
            _check_groups(live, node, where)  # torch's own format
        plan.covered.update(statetree.tensor_keys(node))
        plan.steps.append(partial(_load, live, node, where))
        return
    if isinstance(live, MutableMapping):
        if kind != "dict":
            raise StateError(f"{where}: the target is a dict, the checkpoint holds a {kind}")
        saved = dict((k, v) for k, v in body)
        missing += [statetree.child_key(path, k) for k in saved if k not in live]
        unexpected += [statetree.child_key(path, k) for k in live if k not in saved]
        for k, child in saved.items():
            if k in live:
                _child(live, k, child, statetree.child_key(path, k), m, plan, missing, unexpected)
        return
    if isinstance(live, MutableSequence):
        if kind != "list" or len(body) != len(live):
            raise StateError(f"{where}: the target is a list of {len(live)}, the checkpoint holds "
                             f"{'a list of ' + str(len(body)) if kind == 'list' else 'a ' + kind}")
        for i, child in enumerate(body):
            _child(live, i, child, statetree.child_key(path, i), m, plan, missing, unexpected)
        return
    raise StateError(f"{where}: cannot restore into a {type(live).__name__} in place")


def _child(parent: Any, k: Any, node: dict[str, Any], path: str, m: Manifest, plan: RestorePlan,
           missing: list[str], unexpected: list[str]) -> None:
    live = parent[k]
    mutable = isinstance(live, (torch.Tensor, Shard, nn.Module, MutableMapping, MutableSequence))
    if mutable or statetree.is_stateful(live) or statetree.integration(live) is not None:
        _walk(live, node, path, m, plan, missing, unexpected)
    else:
        # Immutable values (numbers, strings, tuples) are replaced in their container.
        plan.covered.update(statetree.tensor_keys(node))

        def assign(ts: Mapping[str, torch.Tensor]) -> None:
            parent[k] = statetree.build(node, ts)

        plan.steps.append(assign)


def _load(live: Any, node: dict[str, Any], where: str, ts: Mapping[str, torch.Tensor]) -> None:
    """``live.load_state_dict`` of the saved state; what it refuses is a StateError naming ``where``."""
    try:
        live.load_state_dict(statetree.build(node, ts))
    except Exception as e:
        raise StateError(f"{where}: {type(live).__name__}.load_state_dict refused the saved state "
                         f"({type(e).__name__}: {e})") from e


def _check_groups(live: Optimizer, node: dict[str, Any], where: str) -> None:
    """What torch's ``Optimizer.load_state_dict`` checks first, checked on the saved skeleton
    before any tensor is read, so a mismatch leaves the whole target as it was."""
    saved = _group_sizes(node)
    have = [len(g["params"]) for g in live.param_groups]
    if saved is None:
        raise StateError(f"{where}: the target is an optimizer, the checkpoint holds no optimizer "
                         "state ('state' and 'param_groups' with their 'params')")
    if saved != have:
        raise StateError(f"{where}: the optimizer's parameter groups hold {have} parameters, "
                         f"the checkpoint's {saved}")


def _group_sizes(node: dict[str, Any]) -> list[int] | None:
    """The parameters of each group of a saved optimizer state's skeleton (checked by
    :func:`deltackpt.format.record_checks.check_tree`), or None if it is no such state."""
    (kind, body), = node.items()
    fields = dict(body) if kind == "dict" else {}
    groups = fields.get("param_groups", {})
    if "state" not in fields or "list" not in groups:
        return None
    sizes = []
    for group in groups["list"]:
        params = dict(group["dict"]).get("params", {}) if "dict" in group else {}
        if "list" not in params:
            return None
        sizes.append(len(params["list"]))
    return sizes


def fill(plan: RestorePlan, m: Manifest, reader: ChainReader,
         hashed: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Reads every tensor the plan covers (targets in place, through a temporary when not a
    contiguous CPU tensor whose bytes are its values: a conjugate or negative view's are not),
    then runs the plan's finishing steps.

    Returns:
        For each target in ``hashed``, the hash of every row of its local tensor, taken by the
        reads from the rows they wrote (see :mod:`deltackpt.io.row_hashes`).
    """
    final: dict[str, torch.Tensor] = {}
    hashes: dict[str, torch.Tensor] = {}
    for key in sorted(plan.covered):
        rec = m.tensors[key]
        target = plan.targets.get(key)
        if target is None:  # loaded whole, for an optimizer's load_state_dict
            reader.check_files(key, Box((0,) * len(rec.shape), rec.shape))
            dest = torch.empty(rec.shape, dtype=dtypes.from_name(rec.dtype))
            reader.read(key, dest)
            final[key] = dest
            continue
        local = target.local
        direct = (local.device.type == "cpu" and local.is_contiguous()
                  and not (local.is_conj() or local.is_neg()))
        dest = statetree.plain_strides(local) if direct else torch.empty(local.shape, dtype=local.dtype)
        rows = RowHashes.of(dest.shape[0]) if key in hashed and dest.dim() else None
        reader.read(key, dest, target.box, rows)
        if rows is not None:
            hashes[key] = rows.complete(dest)
        if not direct:
            local.copy_(dest)
        final[key] = local
    plan.finish(final)
    return hashes
