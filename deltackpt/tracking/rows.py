"""Row tracking from lookups: which rows of an embedding table a training step may have changed.

A tracked table has a mask on its device, one entry per row, that forward hooks on the model's
``nn.Embedding`` and ``nn.EmbeddingBag`` modules (and on TorchRec's ``EmbeddingBagCollection``)
set from the lookup ids with :func:`deltackpt.kernels.mark_rows`: O(lookups) per step, never
O(table). At a save, the marked rows are the table's change set, and the change set of optimizer
state aligned with the table (Adagrad ``sum``, Adam ``exp_avg``/``exp_avg_sq``, row-wise 1-D
accumulators) too. :mod:`deltackpt.tracking.changes` uses the marks, checks them with a canary and falls
back to hashing; this module only records them.

Flat keys. A save flattens its state to ``/``-joined paths (:func:`deltackpt.statetree.flatten`).
A model passed to ``track(model, prefix="model")`` is expected at ``state["model"]``, so the
weight of its module ``tower.emb`` has the key ``"model/tower.emb.weight"``: the prefix, then the
parameter's name in ``model.named_parameters()`` as one path part (``prefix=""`` when the model's
``state_dict()`` is the whole state). An optimizer at ``state["optim"]`` keeps the state of its
``i``-th parameter (counted across ``param_groups`` in order, as ``Optimizer.state_dict()``
numbers them) under ``"optim/state/<i>/<name>"``; an entry is aligned with a table, and shares
its marks, when it has the table's shape or is 1-D with one value per row. The parameter is
found by identity in ``optimizer.param_groups`` at every save, so parameter groups added after
``track`` count. A tracked key absent from the saved state logs a warning once (a wrong prefix
costs full hashing, never correctness).

What is marked, and how TorchRec's collections are read: :mod:`deltackpt.tracking.lookups`; one table's
marks and when they can stand for its changes: :mod:`deltackpt.tracking.marks`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> rows = RowTracker()
    >>> model = nn.Sequential(nn.EmbeddingBag(100, 4, mode="sum"))
    >>> rows.track(model, prefix="model").keys
    ('model/0.weight',)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import StateError
from ..statetree import child_key
from . import lookups
from .marks import Canary, TrackedTable
from .references import same_tensors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrackedGroup:
    """A tracked table as found in one save's tensors.

    Attributes:
        table: the table's marks.
        keys: the flat keys that share the marks and are in the state: the table's, then its
            aligned optimizer state.
        rows: the table's row count.
    """

    table: TrackedTable
    keys: tuple[str, ...]
    rows: int


@dataclass
class TrackHandle:
    """What :meth:`RowTracker.track` set up.

    Attributes:
        keys: flat keys of the tables it tracks, in module order.
    """

    keys: tuple[str, ...]
    _tracker: RowTracker = field(repr=False)
    _hooks: list[RemovableHandle] = field(repr=False)

    def remove(self) -> None:
        """Removes the hooks and stops tracking these tables; their keys are hashed again."""
        self._tracker.untrack(self._hooks, self.keys)
        self._hooks.clear()


class RowTracker:
    """The tracked tables of one checkpointer, by flat key.

    Args:
        declared: 1-d tensors declared aligned with a table's rows, by flat key, each with its
            table's flat key: they share the table's marks when it has them.
    """

    def __init__(self, declared: Mapping[str, str] | None = None) -> None:
        if declared is not None and not isinstance(declared, Mapping):
            raise StateError(f"aligned must map flat keys to their tables' flat keys, got {declared!r}")
        self.declared = dict(declared or {})
        for key, table in self.declared.items():
            if not isinstance(key, str) or not isinstance(table, str) or key == table:
                raise StateError(f"aligned: {key!r} -> {table!r} must map a tensor's flat key to "
                                 "another tensor's (its table's)")
        self._tables: dict[str, TrackedTable] = {}  # by each of its keys
        self._hooks: dict[int, RemovableHandle] = {}  # by id() of the hooked module
        self._params: dict[str, tuple[torch.Tensor, tuple[torch.optim.Optimizer, str] | None]] = {}
        self._warned: set[str] = set()
        self._polls: list[Callable[[], None]] = []  # mark sources read at each save (TorchRec's)
        self._row_wise: tuple[list[str], list[torch.Tensor], set[str]] = ([], [], set())  # the last inference

    # -- registration ---------------------------------------------------------------------------

    def track(
        self,
        model: nn.Module,
        *,
        prefix: str = "model",
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_prefix: str = "optim",
        canary: Canary | None = None,
    ) -> TrackHandle:
        """Hooks every ``nn.Embedding``, ``nn.EmbeddingBag`` and TorchRec
        ``EmbeddingBagCollection`` of ``model`` so that lookups mark their rows.

        Tracking a module again replaces its hook, so a second call can add an optimizer; under
        another prefix, each table's one set of marks serves the keys of both.

        Args:
            model: the model, as it sits in the saved state.
            prefix: the flat-key path of ``model`` in the state (``""`` for the root).
            optimizer: the optimizer whose state of these tables shares their marks.
            optimizer_prefix: the flat-key path of ``optimizer`` in the state.
            canary: the canary's sample size for these tables (default ``Canary()``).

        Returns:
            The tracked keys, and a way to remove the hooks.

        Raises:
            StateError: ``model`` is not an ``nn.Module``.
        """
        if not isinstance(model, nn.Module):
            raise StateError(f"track() needs an nn.Module, got {type(model).__name__}")
        canary = canary if canary is not None else Canary()
        if type(model).__module__.startswith("torchrec."):
            return self._track_torchrec(model, prefix, optimizer, optimizer_prefix, canary)
        opt = (optimizer, optimizer_prefix) if optimizer is not None else None
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
            # Remembered so that mark() by hand on a parameter's key finds its optimizer state.
            self._params[child_key(prefix, name)] = (p, opt)

        def table(p: torch.Tensor, name: str) -> TrackedTable:
            keys = tuple(child_key(prefix, n) for n in names.get(id(p), [name]))
            return self._register(keys, p, opt, canary)

        ebc = lookups.collection_type()
        hooks: list[RemovableHandle] = []
        keys: list[str] = []
        covered: list[str] = []  # TorchRec collections hooked whole: skip their children
        for mod_name, mod in model.named_modules():
            if any(mod_name.startswith(c + ".") for c in covered):
                continue
            if ebc is not None and isinstance(mod, ebc):
                covered.append(mod_name)
                by_feature = {}
                for weight, name, features in lookups.collection_tables(mod):
                    t = table(weight, _dotted(mod_name, name))
                    keys.extend(t.keys)
                    by_feature.update(dict.fromkeys(features, t))
                hooks.append(self._hook(cast(nn.Module, mod), lookups.collection_hook(by_feature)))
            elif isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
                t = table(mod.weight, _dotted(mod_name, "weight"))
                keys.extend(t.keys)
                hooks.append(self._hook(mod, lookups.lookup_hook(t)))
        log.debug("tracking %d tables of %s: %s", len(keys), type(model).__name__, keys)
        return TrackHandle(tuple(keys), self, hooks)

    def mark(self, key: str, ids: torch.Tensor) -> None:
        """Marks rows ``ids`` of the table at flat key ``key``, tracking it from now on.

        Args:
            key: the table's flat key in the saved state.
            ids: row ids (int64 or int32, any shape) on the table's device; they must be in range.

        Raises:
            StateError: ``ids`` is not an integer tensor, or holds an id outside the table (a
                negative id would wrap around to a row that did not change). Checking reads the
                ids' range, which waits for the device when they are on one.
        """
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise StateError(f"mark({key!r}): ids must be an int64 or int32 tensor, got "
                             f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        t = self._tables.get(key)
        if t is None:
            param, opt = self._params.get(key, (None, None))
            t = self._register((key,), param, opt, Canary())
        if ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(ids))
            rows = t.mask.shape[0] if t.mask is not None else (
                t.param.shape[0] if t.param is not None and t.param.dim() else None)
            if lo < 0 or (rows is not None and hi >= rows):
                raise StateError(f"mark({key!r}): row id {lo if lo < 0 else hi} is outside the "
                                 f"table's {rows if rows is not None else 'rows'}"
                                 f"{' rows' if rows is not None else ''}")
        t.mark(ids)

    def untrack(self, hooks: Iterable[RemovableHandle], keys: Iterable[str]) -> None:
        """Removes ``hooks`` and stops tracking the tables of ``keys``; the next save hashes them."""
        hooks = list(hooks)
        for h in hooks:
            h.remove()
        self._hooks = {m: h for m, h in self._hooks.items() if h not in hooks}
        for key in keys:
            t = self._tables.pop(key, None)
            if t is not None:
                t.stop()

    def _track_torchrec(self, model: nn.Module, prefix: str, optimizer: object,
                        optimizer_prefix: str, canary: Canary) -> TrackHandle:
        """A TorchRec DMP: see :mod:`deltackpt.integrations.torchrec_marks`."""
        from ..integrations import torchrec_marks

        if not torchrec_marks.is_sharded_model(model):
            raise StateError(f"track(): {type(model).__name__} holds no sharded TorchRec "
                             "EmbeddingBagCollection")
        keys, poll, stop = torchrec_marks.track(
            lambda ks: self._register(ks, None, None, canary), model, prefix=prefix,
            optimizer=optimizer, optimizer_prefix=optimizer_prefix)
        self._polls.append(poll)
        tracker = self

        class Stop:
            def remove(self) -> None:
                stop()
                if poll in tracker._polls:
                    tracker._polls.remove(poll)

        return TrackHandle(tuple(keys), self, [Stop()])  # type: ignore[list-item]

    # -- for the change tracker -----------------------------------------------------------------

    def poll(self) -> None:
        """Moves the marks of sources read at saves (TorchRec's ModelDeltaTracker) into the tables."""
        for fn in self._polls:
            fn()

    def tables(self) -> list[TrackedTable]:
        """Every tracked table, once each."""
        return list({id(t): t for t in self._tables.values()}.values())

    def resolve(self, tensors: Mapping[str, torch.Tensor], held: Container[str] | None = None
                ) -> list[TrackedGroup]:
        """The tracked tables in ``tensors``, each with the keys that share its marks. A tracked
        key missing from ``held`` (the keys of every tensor this rank holds; default those of
        ``tensors``) is warned of once: a rank that holds a replica another rank writes has
        nothing wrong.

        Raises:
            StateError: a tracked key holds a 0-d tensor.
        """
        aligned: dict[tuple[str, int], list[str]] | None = None  # by _optimizer_entries, if needed
        groups = []
        for t in self.tables():
            present = [k for k in t.keys if k in tensors]
            for k in t.keys:
                if k not in (tensors if held is None else held) and k not in self._warned:
                    self._warned.add(k)
                    log.warning("tracked table %r is not in the saved state, so its marks go "
                                "unused; check the prefix given to track()", k)
            if not present:
                continue
            table = tensors[present[0]]
            if table.dim() == 0:
                raise StateError(f"{present[0]}: a 0-d tensor has no rows to mark")
            members = list(present)
            if t.param is not None and t.optimizer is not None:
                opt, opt_prefix = t.optimizer
                index = _param_index(opt, t.param)
                if aligned is None:
                    aligned = _optimizer_entries(tensors)
                for k in aligned.get((opt_prefix, index), []) if index is not None else []:
                    s = tensors[k]
                    # A 1-d state of a table with as many columns as rows may be per column
                    # (Adafactor's factors): not inferred, it can be declared.
                    if s.shape == table.shape or s.dim() == 1 and s.shape[0] == table.shape[0] and (
                            table.shape[0] not in table.shape[1:]):
                        members.append(k)
            members += [k for k, tab in self.declared.items() if tab in present and k in tensors
                        and k not in members]
            groups.append(TrackedGroup(t, tuple(members), table.shape[0]))
        return groups

    def aligned(self, tensors: Mapping[str, torch.Tensor], groups: list[TrackedGroup]) -> set[str]:
        """The 1-d tensors of ``tensors`` aligned with a table's rows, whose changes are their
        elements, as the table's are its rows: those declared (checked against their tables),
        the 1-d optimizer state a tracked table shares its marks with (``groups``), and the
        1-d optimizer state inferred row-wise from the shapes (:func:`row_wise_state`).

        Raises:
            StateError: a declared tensor is not 1-d, or its table (when present) has not two
                dimensions or more and as many rows as it has values.
        """
        # The same tensor objects keep their shapes from save to save (see ChangeTracker.scan).
        keys, ts, inferred = self._row_wise
        if not same_tensors(tensors, keys, ts):
            inferred = row_wise_state(tensors)
            self._row_wise = list(tensors), list(tensors.values()), inferred
        out = {k for g in groups for k in g.keys if tensors[k].dim() == 1} | inferred
        for key, table in self.declared.items():
            t, tab = tensors.get(key), tensors.get(table)
            if t is None:
                continue
            if t.dim() != 1 or tab is not None and (tab.dim() < 2 or tab.shape[0] != t.shape[0]):
                raise StateError(f"{key}: declared aligned with {table!r}, but it has shape {list(t.shape)} "
                                 f"and the table {list(tab.shape) if tab is not None else 'is absent'}; an "
                                 "aligned tensor is 1-d, with one value per row of a table of 2 or more dimensions")
            out.add(key)
        return out

    # -- internals ------------------------------------------------------------------------------

    def _register(
        self,
        keys: tuple[str, ...],
        param: torch.Tensor | None,
        optimizer: tuple[torch.optim.Optimizer, str] | None,
        canary: Canary,
    ) -> TrackedTable:
        t = next((self._tables[k] for k in keys if k in self._tables), None)
        if t is None and param is not None:  # the same table tracked under another path: one
            t = next((x for x in self.tables() if x.param is param), None)  # hook marks them all
        if t is None:
            t = TrackedTable(keys, param, optimizer, canary, order=len(self.tables()))
        else:
            # Tracked before (by hand, or by an earlier track call): keep its marks.
            t.keys = tuple(dict.fromkeys(t.keys + keys))
            t.param = param if param is not None else t.param
            t.optimizer = optimizer if optimizer is not None else t.optimizer
            t.canary = canary
            t.rng = canary.generator()
        for k in t.keys:
            self._tables[k] = t
        return t

    def _hook(self, mod: nn.Module, hook: lookups.Hook) -> RemovableHandle:
        old = self._hooks.pop(id(mod), None)
        if old is not None:
            old.remove()
        handle = mod.register_forward_hook(hook, with_kwargs=True)
        self._hooks[id(mod)] = handle
        return handle


def _dotted(module: str, name: str) -> str:
    return f"{module}.{name}" if module else name


def _param_index(opt: torch.optim.Optimizer, param: torch.Tensor) -> int | None:
    """The index ``Optimizer.state_dict()`` gives ``param``, or None if ``opt`` lacks it."""
    i = 0
    for group in opt.param_groups:
        for p in group["params"]:
            if p is param:
                return i
            i += 1
    return None


def row_wise_state(tensors: Mapping[str, torch.Tensor]) -> set[str]:
    """The 1-d optimizer state of ``tensors`` with one value per row of a table, inferred where
    the shapes leave no doubt: a floating tensor under ``<prefix>/state/<param>/<name>`` (a torch
    optimizer's, ``<param>`` its index, or a keyed optimizer's, ``<param>`` the parameter's name)
    whose length is the row count of a tensor of two dimensions or more with no column as many
    (a 1-d state of a square table may be per column). Which table it belongs to does not matter
    here: hashed per value, its changed values are its changed rows, and a tracked table's own
    state shares its marks (:meth:`RowTracker.resolve`). Each rank infers from its own shards,
    which a table and its state split alike.

    >>> sorted(row_wise_state({"emb": torch.zeros(6, 2), "optim/state/0/sum": torch.zeros(6),
    ...                        "optim/state/1/sum": torch.zeros(2), "acc": torch.zeros(6)}))
    ['optim/state/0/sum']
    """
    rows = {t.shape[0] for t in tensors.values() if t.dim() >= 2 and t.shape[0] not in t.shape[1:]}
    return {k for k, t in tensors.items()
            if t.dim() == 1 and t.shape[0] in rows and t.shape[0] > 1 and t.is_floating_point()
            and k.rsplit("/", 3)[-3:-2] == ["state"]}


def _optimizer_entries(tensors: Mapping[str, torch.Tensor]) -> dict[tuple[str, int], list[str]]:
    """Keys shaped like ``<prefix>/state/<index>/<name>``, by (prefix, index)."""
    out: dict[tuple[str, int], list[str]] = {}
    for key in tensors:
        parts = key.rsplit("/", 3)
        if len(parts) == 3:
            parts.insert(0, "")
        if len(parts) == 4 and parts[1] == "state" and parts[2].isdigit():
            out.setdefault((parts[0], int(parts[2])), []).append(key)
    return out
