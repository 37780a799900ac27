"""Flattening a nested training state into named tensors plus a JSON skeleton, and back.

The skeleton keeps everything that is not a tensor (step counters, learning rates, RNG seeds,
optimizer hyper-parameters) as JSON, with just enough type information to rebuild the same
nesting: dict keys keep their type (``int`` or ``str``), tuples stay tuples, non-finite floats are
spelled out. Nothing is pickled, so loading never runs code from the store.

Nodes: ``{"tensor": KEY}``, ``{"value": V}``, ``{"float": "nan" | "inf" | "-inf"}``,
``{"dict": [[K, NODE], ...]}``, ``{"list": [NODE, ...]}``, ``{"tuple": [NODE, ...]}``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import StateError
from .format.limits import MAX_DEPTH, has_surrogate, key_problem
from .sharding import Shard, as_shard


@dataclass(frozen=True)
class FlatState:
    """A state split into its tensors (by flat key, each as this rank's :class:`Shard`) and the
    JSON skeleton that nests them.

    Attributes:
        tensors: every tensor by flat key.
        tree: the skeleton.
        sources: the live plain tensor (``torch.Tensor`` or ``Parameter``) each shard views, by
            key: what a later :func:`flatten` with ``reuse`` recognises.
        reused: how many shards that :func:`flatten` took from ``reuse``.
    """

    tensors: dict[str, Shard]
    tree: dict[str, Any]
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    reused: int = 0


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the types whose shards flatten may reuse


@dataclass
class _Flattening:
    """What one :func:`flatten` gathers, and the earlier result it may take shards from."""

    reuse: FlatState | None
    tensors: dict[str, Shard] = field(default_factory=dict)
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    reused: int = 0

    def known(self, obj: Any, path: str) -> Shard | None:
        """The shard ``reuse`` made of ``obj`` at ``path`` if it still views ``obj`` exactly:
        the same object, dtype, shape, strides and first byte (a ``.data`` swap or an in-place
        resize changes one). A shard holds its storage, so no new storage can take its address."""
        reuse = self.reuse
        if reuse is None or type(obj) not in _PLAIN:
            return None
        t = reuse.sources.get(path)
        if t is None or t is not obj:
            return None
        shard = reuse.tensors[path]
        old = shard.local
        if (old.data_ptr() != t.data_ptr() or old.dtype != t.dtype or old.dtype.is_complex
                or old.shape != t.shape or old.stride() != t.stride()):
            return None
        return shard


def key_part(k: str | int) -> str:
    """One path component of a flat key; ``/`` and ``%`` are escaped so keys split unambiguously."""
    return str(k).replace("%", "%25").replace("/", "%2F")


def child_key(path: str, *names: str | int) -> str:
    """The flat key of ``names`` (a dict key or list index each, outermost first) under the path
    ``path`` (``""``: the root): the one way keys are joined.

    Example:
        >>> child_key("model", "emb.weight"), child_key("", "a/b", 0)
        ('model/emb.weight', 'a%2Fb/0')
    """
    for name in names:
        path = f"{path}/{key_part(name)}" if path else key_part(name)
    return path


def walk(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every value of a live state with its flat-key path, outermost first, descending as
    :func:`flatten` does into mappings, lists and tuples (not into objects with
    ``state_dict()``, whose tensors sit under their path).

    Example:
        >>> [p for p, _ in walk({"model": torch.nn.Linear(1, 1), "opt": [{"lr": 0.1}]})]
        ['', 'model', 'opt', 'opt/0', 'opt/0/lr']
    """
    yield path, obj
    if is_stateful(obj) and not isinstance(obj, Mapping):
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from walk(v, child_key(path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from walk(v, child_key(path, i))


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` is saved through ``state_dict()`` (modules, optimizers, schedulers...)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def flatten(state: Mapping[str, Any], *, reuse: FlatState | None = None) -> FlatState:
    """Splits ``state`` into tensors and a skeleton.

    Args:
        state: a mapping of tensors (plain, :class:`Shard` or DTensor), objects with
            ``state_dict()``, dicts, lists, tuples and JSON scalars, nested.
        reuse: an earlier result for (possibly) the same state: a plain tensor found again at its
            path, unchanged but for its values, keeps its shard rather than being checked and
            wrapped again (saves of thousands of tiny tensors pay for that per tensor).

    Returns:
        The flat state.

    Raises:
        StateError: a value that cannot be saved, a key that cannot name a folder of the store
            (see :func:`deltackpt.format.limits.key_problem`), nesting deeper than
            :data:`~deltackpt.format.limits.MAX_DEPTH`, or two paths that give one key.

    Example:
        >>> flat = flatten({"w": torch.zeros(2), "step": 3})
        >>> sorted(flat.tensors), flat.tree["dict"][1]
        (['w'], ['step', {'value': 3}])
    """
    if not isinstance(state, Mapping):
        raise StateError(f"state must be a mapping, got {type(state).__name__}")
    out = _Flattening(reuse)
    tree = _node(state, "", out, 0)
    return FlatState(out.tensors, tree, out.sources, out.reused)


def integration(obj: object) -> Any:
    """The module that saves and restores ``obj`` (TorchRec's DMP and fused optimizers), imported
    only for such an object, or None."""
    if type(obj).__module__.startswith(("torchrec.", "deltackpt.integrations.torchrec")):
        from .integrations import torchrec

        return torchrec if torchrec.handles(obj) else None
    return None


def _node(obj: Any, path: str, out: _Flattening, depth: int) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise StateError(f"{path}: the state is nested deeper than {MAX_DEPTH} levels")
    tensors = out.tensors
    if (known := out.known(obj, path)) is not None:
        if path in tensors:
            raise StateError(f"two entries of the state map to the key {path!r}")
        tensors[path], out.sources[path] = known, obj
        out.reused += 1
        return {"tensor": path}
    adapter = integration(obj)
    if adapter is not None:
        return _node(adapter.live_state(obj).tree, path, out, depth)
    if isinstance(obj, (torch.Tensor, Shard)):
        if path in tensors:
            raise StateError(f"two entries of the state map to the key {path!r}")
        if (why := key_problem(path)) is not None:
            raise StateError(f"tensor key {path!r:.200} cannot name a folder of the store: {why}")
        local = obj.local if isinstance(obj, Shard) else obj
        if local.is_nested or local.is_meta:
            raise StateError(f"{path}: cannot save a {'nested' if local.is_nested else 'meta'} "
                             "tensor (it holds no plain data)")
        if isinstance(obj, torch.Tensor) and type(obj) in _PLAIN:
            shard = Shard.whole(obj.detach())
            out.sources[path] = obj
        else:
            found = as_shard(obj, path)
            shard = Shard(found.local.detach(), global_shape=found.global_shape, global_offset=found.global_offset)
        if shard.local.layout != torch.strided:
            raise StateError(f"{path}: only dense (strided) tensors are supported, got {shard.local.layout}")
        tensors[path] = shard
        return {"tensor": path}
    if is_stateful(obj) and not isinstance(obj, Mapping):
        return _node(obj.state_dict(), path, out, depth)
    if isinstance(obj, Mapping):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise StateError(f"{path or '<root>'}: keys must be str or int, got {k!r}")
            if isinstance(k, str) and has_surrogate(k):
                raise StateError(f"{path or '<root>'}: key {k!r} holds a lone surrogate (not UTF-8)")
            items.append([k, _node(v, child_key(path, k), out, depth + 1)])
        return {"dict": items}
    if isinstance(obj, (list, tuple)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {kind: [_node(v, child_key(path, i), out, depth + 1) for i, v in enumerate(obj)]}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"float": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise StateError(
        f"{path or '<root>'}: cannot save a {type(obj).__name__}; use tensors, objects with "
        "state_dict(), dicts, lists, tuples, str, int, float, bool or None"
    )


def build(node: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    """Rebuilds the nested value of a skeleton node, taking tensors from ``tensors``."""
    (kind, body), = node.items()
    if kind == "tensor":
        return tensors[body]
    if kind == "value":
        return body
    if kind == "float":
        return float(body)
    if kind == "dict":
        return {k: build(v, tensors) for k, v in body}
    if kind == "list":
        return [build(v, tensors) for v in body]
    if kind == "tuple":
        return tuple(build(v, tensors) for v in body)
    raise ValueError(f"unknown skeleton node {kind!r}")


def tensor_keys(node: Mapping[str, Any]) -> list[str]:
    """The flat keys of every tensor under a skeleton node, in order."""
    (kind, body), = node.items()
    if kind == "tensor":
        return [body]
    if kind == "dict":
        return [k for _, v in body for k in tensor_keys(v)]
    if kind in ("list", "tuple"):
        return [k for v in body for k in tensor_keys(v)]
    return []


def merge(trees: list[dict[str, Any]]) -> dict[str, Any]:
    """The union of the skeletons of several ranks (each may hold only some tensors).

    Dicts are merged by key; elsewhere the first tree's node wins, so plain values are taken from
    the coordinator (the first tree).
    """
    first = trees[0]
    (kind, body), = first.items()
    if kind != "dict" or len(trees) == 1:
        return first
    merged: dict[Any, list[dict[str, Any]]] = {}
    for tree in trees:
        (k2, b2), = tree.items()
        if k2 != "dict":
            continue
        for k, child in b2:
            merged.setdefault(k, []).append(child)
    return {"dict": [[k, merge(children)] for k, children in merged.items()]}
