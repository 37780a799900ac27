"""Flattening a nested training state into named tensors plus a JSON skeleton, and back.

The skeleton keeps everything that is not a tensor (step counters, learning rates, RNG seeds,
optimizer hyper-parameters) as JSON, with just enough type information to rebuild the same
nesting: dict keys keep their type (``int`` or ``str``), tuples stay tuples, non-finite floats are
spelled out. Nothing is pickled, so loading never runs code from the store.

Nodes: ``{"tensor": KEY}``, ``{"value": V}``, ``{"float": "nan" | "inf" | "-inf"}``,
``{"dict": [[K, NODE], ...]}``, ``{"list": [NODE, ...]}``, ``{"tuple": [NODE, ...]}``.
"""

from __future__ import annotations

import inspect
import math
import operator
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
        sources: the live plain real tensor (``torch.Tensor`` or ``Parameter``) each shard views, by
            key: what a later :func:`flatten` with ``reuse`` recognises.
        reused: how many shards that :func:`flatten` took from ``reuse``.
        strided: the keys of the shards whose bytes are not their values in order (not
            contiguous, or a conjugate or negative view): a save copies them first.
        dicts: each mapping's keys, their paths and its node, by path: what a later
            :func:`flatten` with ``reuse`` keeps when it finds them again.
    """

    tensors: dict[str, Shard]
    tree: dict[str, Any]
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    reused: int = 0
    strided: set[str] = field(default_factory=set)
    dicts: dict[str, tuple[list[Any], list[str], dict[str, Any]]] = field(default_factory=dict)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the types whose shards flatten may reuse
_CHILD = operator.itemgetter(1)  # of a mapping's [key, node] pair
_NO_DICTS: dict[str, tuple[list[Any], list[str], dict[str, Any]]] = {}
_SCALARS = (type(None), bool, int, float, str)
_NOTHING = object()


@dataclass
class _Flattening:
    """What one :func:`flatten` gathers, and the earlier result it may take shards and nodes from."""

    reuse: FlatState | None
    tensors: dict[str, Shard] = field(default_factory=dict)
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    reused: int = 0
    strided: set[str] = field(default_factory=set)
    dicts: dict[str, tuple[list[Any], list[str], dict[str, Any]]] = field(default_factory=dict)

    def again(self, obj: Any, path: str, last: dict[str, Any] | None) -> dict[str, Any] | None:
        """The node of ``obj`` at ``path`` (``last``, its node in ``reuse``, if it is that
        tensor's), taking the shard ``reuse`` made of it if it still views ``obj`` exactly: the
        same object, dtype, storage, offset, shape and strides (a ``.data`` swap or an in-place
        resize changes one); None if none does. A shard holds its storage, so no new storage can
        take its place. (``is_set_to`` checks the four last in one call: thousands of tiny
        tensors pay for each call, and for each call of this.)"""
        reuse = self.reuse
        t = None if reuse is None else reuse.sources.get(path)
        if t is None or t is not obj or type(t) not in _PLAIN:
            return None
        shard = reuse.tensors[path]  # type: ignore[union-attr]  # t is not None: reuse is set
        old = shard.local
        if not t.is_set_to(old) or t.dtype != old.dtype:
            return None
        if path in self.tensors:
            raise StateError(f"two entries of the state map to the key {path!r}")
        self.tensors[path], self.sources[path] = shard, t
        self.reused += 1
        if path in reuse.strided:  # type: ignore[union-attr]
            self.strided.add(path)
        return last if last is not None and last.get("tensor") == path else {"tensor": path}


def plain_key(k: str | int) -> str | int:
    """A dict key as the plain str or int it equals: an enum key's value (``str()`` of a
    ``(str, Enum)`` member gives its name, and a pickled one needs its class to load)."""
    return str.__str__(k) if isinstance(k, str) else int.__int__(k)


def key_part(k: str | int) -> str:
    """One path component of a flat key; ``/`` and ``%`` are escaped so keys split unambiguously."""
    return str(plain_key(k)).replace("%", "%25").replace("/", "%2F")


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
    tree = _node(state, "", out, 0, None)
    return FlatState(out.tensors, tree, out.sources, out.reused, out.strided, out.dicts)


def plain_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous), or where its strides differ from those of a fresh tensor of its shape,
    a view of the same memory with those. A dimension of one element (or none) may have any
    stride in a contiguous tensor (``torch.zeros(1, 3).t()``: strides (1, 3)), and a tensor so
    strided cannot be viewed as bytes: its save and its restore failed with a RuntimeError."""
    if not t.dim() or min(t.shape) > 1:
        return t
    plain = t.reshape(-1).view(t.shape)
    return t if plain.stride() == t.stride() else plain


def integration(obj: object) -> Any:
    """The module that saves and restores ``obj`` (TorchRec's DMP and fused optimizers), imported
    only for such an object, or None."""
    if type(obj).__module__.startswith(("torchrec.", "deltackpt.integrations.torchrec")):
        from .integrations import torchrec

        return torchrec if torchrec.handles(obj) else None
    return None


def _node(obj: Any, path: str, out: _Flattening, depth: int, last: dict[str, Any] | None) -> dict[str, Any]:
    """The skeleton node of ``obj`` at ``path``; ``last``: its node in the reused flattening, if
    any, returned again when ``obj`` flattens the same (a state of an unchanged layout makes no
    new node for its thousands of tensors)."""
    if depth > MAX_DEPTH:
        raise StateError(f"{path}: the state is nested deeper than {MAX_DEPTH} levels")
    if type(obj) is dict:  # the plain kinds first: an optimizer's state holds thousands
        return _mapping(obj, path, out, depth)
    if type(obj) in _SCALARS:
        return _scalar(obj, last)
    if (node := out.again(obj, path, last)) is not None:
        return node
    tensors = out.tensors
    adapter = integration(obj)
    if adapter is not None:
        return _node(adapter.live_state(obj).tree, path, out, depth, None)
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
            if not obj.is_complex():  # a complex view may differ by its conjugate bit alone
                out.sources[path] = obj
        else:
            found = as_shard(obj, path)
            shard = Shard(found.local.detach(), global_shape=found.global_shape, global_offset=found.global_offset)
        if shard.local.layout != torch.strided:
            raise StateError(f"{path}: only dense (strided) tensors are supported, got {shard.local.layout}")
        if not shard.local.is_contiguous() or shard.local.is_conj() or shard.local.is_neg():
            out.strided.add(path)
        elif (local := plain_strides(shard.local)) is not shard.local:
            shard = Shard(local, global_shape=shard.global_shape, global_offset=shard.global_offset)
        tensors[path] = shard
        return {"tensor": path}
    if is_stateful(obj) and not isinstance(obj, Mapping):
        return _node(_state_of(obj), path, out, depth, None)
    if isinstance(obj, Mapping):
        return _mapping(obj, path, out, depth)
    if isinstance(obj, (list, tuple)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        kept: list[Any] | None = None if last is None else last.get(kind)
        olds = kept if kept is not None and len(kept) == len(obj) else [None] * len(obj)
        children = [_node(v, child_key(path, i), out, depth + 1, old) for i, (v, old) in enumerate(zip(obj, olds))]
        if last is not None and olds is kept and all(map(operator.is_, children, olds)):
            return last
        return {kind: children}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return _scalar(obj, last)
    raise StateError(
        f"{path or '<root>'}: cannot save a {type(obj).__name__}; use tensors, objects with "
        "state_dict(), dicts, lists, tuples, str, int, float, bool or None"
    )


def _scalar(obj: Any, last: dict[str, Any] | None) -> dict[str, Any]:
    """The node of a JSON scalar (None, bool, int, float or str); ``last`` again if it holds the
    same value of the same type, to the bit (1, 1.0 and True are not, nor 0.0 and -0.0)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"float": repr(obj)}
    old: Any = last.get("value", _NOTHING) if last is not None else _NOTHING
    same = type(old) is type(obj) and (old is obj or (old == obj and (
        not isinstance(obj, float) or math.copysign(1.0, old) == math.copysign(1.0, obj))))
    return last if same else {"value": obj}  # type: ignore[return-value]


def _state_of(obj: Any) -> Any:
    """``obj.state_dict()``; a module's with its parameters and buffers themselves
    (``keep_vars``), which flatten detaches: the same objects at every save, whose shards a save
    of an unchanged layout keeps (detached copies are new objects every time)."""
    if isinstance(obj, torch.nn.Module) and "keep_vars" in inspect.signature(obj.state_dict).parameters:
        return obj.state_dict(keep_vars=True)
    return obj.state_dict()


def _mapping(obj: Mapping[Any, Any], path: str, out: _Flattening, depth: int) -> dict[str, Any]:
    """The node of a mapping: its keys checked and joined into paths once, then kept while the
    mapping at ``path`` has the same keys, in order; the node itself kept when every child's is."""
    keys = list(obj)
    last = (out.reuse.dicts if out.reuse is not None else _NO_DICTS).get(path)
    # Equal keys of the same types (1 == True == 1.0, and keys were checked by type).
    if last is not None and last[0] == keys and all(map(operator.is_, map(type, keys), map(type, last[0]))):
        _, paths, node = last
        olds = list(map(_CHILD, node["dict"]))
        children = [out.again(v, p, old) or _node(v, p, out, depth + 1, old)
                    for v, p, old in zip(obj.values(), paths, olds)]
        if not all(map(operator.is_, children, olds)):
            node = {"dict": [[plain_key(k), c] for k, c in zip(keys, children)]}
        out.dicts[path] = (keys, paths, node)
        return node
    paths = []
    for k in keys:
        if not isinstance(k, (str, int)) or isinstance(k, bool):
            raise StateError(f"{path or '<root>'}: keys must be str or int, got {k!r}")
        if isinstance(k, str) and has_surrogate(k):
            raise StateError(f"{path or '<root>'}: key {k!r} holds a lone surrogate (not UTF-8)")
        paths.append(child_key(path, k))
    node = {"dict": [[plain_key(k), _node(v, p, out, depth + 1, None)]
                     for k, v, p in zip(keys, obj.values(), paths)]}
    out.dicts[path] = (keys, paths, node)
    return node


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


def held_bytes(model: Any, optimizer: torch.optim.Optimizer | None = None) -> int:
    """The bytes of ``model``'s parameters and buffers (0 if it is no ``nn.Module``) and of the
    state ``optimizer`` holds yet (most make theirs at their first step): each plain, non-meta
    tensor once.

    Example:
        >>> held_bytes(torch.nn.Linear(4, 2))
        40
    """
    if not isinstance(model, torch.nn.Module):
        return 0
    states = optimizer.state.values() if optimizer is not None else ()
    tensors = [*model.parameters(), *model.buffers(), *(v for s in states for v in s.values())]
    unique = {id(t): t for t in tensors if type(t) in _PLAIN and not t.is_meta}
    return sum(t.nbytes for t in unique.values())
