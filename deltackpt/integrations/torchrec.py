"""TorchRec: ``DistributedModelParallel`` models and their fused optimizers, saved and restored as
deltackpt state.

Every rank passes its DMP and its ``dmp.fused_optimizer`` as they are::

    ckpt.save(step, {"model": dmp, "optim": dmp.fused_optimizer, "step": step})
    ckpt.restore({"model": dmp, "optim": dmp.fused_optimizer, "step": 0})

What they become (this module; :mod:`deltackpt.statetree` and :mod:`deltackpt.restore.planning` call it
for any object from a ``torchrec`` module):

* The model: its ``state_dict()``. Each sharded table (a ``ShardedTensor``, or with
  ``ShardingEnv(..., output_dtensor=True)`` a DTensor over TorchRec's ``LocalShardsWrapper``, read
  by its local shards and offsets, not its placements) becomes a :class:`Shard` in global
  coordinates, a view of the rank's local shard; a table the rank holds no shard of is left out
  (the other ranks cover it); several column shards of one table on one rank become one Shard
  over their columns (a copy, written back after a restore). Dense tensors are replicas.
* The fused optimizer: its ``state_dict()["state"]``. TorchRec keeps a row-wise state (row-wise
  Adagrad's ``momentum1``) as a 1-D ShardedTensor (or DTensor) of ``rows`` values, or, for a table split into
  ``k`` column shards, of ``k * rows`` values (shard ``j``'s momentum at ``[j * rows, (j+1) * rows)``).
  Here it is a ``(rows, k)`` tensor whose column ``j`` is column shard ``j``'s momentum, so it is
  row-sparse and aligned with the table's rows: a delta writes the table's marked rows of both.
  ``"columns"`` records each table's column boundaries, for conversions.

Restoring onto another plan or world size is exact for every layout with the same number of
column shards per table (table-wise and row-wise have one). A row-wise state saved with ``k``
column shards cannot be restored exactly onto ``k' != k``: that raises
:class:`MomentumLayoutError` naming the table, unless the optimizer is passed as
``Convert(dmp.fused_optimizer, momentum="column_mean")``: each new column shard then gets the
column-width-weighted mean of the saved shards' values over the columns it covers. Row-wise
Adagrad accumulates the mean over a shard's columns of the squared gradient, so merging shards
this way gives the value of the merged shard (up to float rounding); splitting one copies it to
the parts, an estimate.

Marks (:meth:`deltackpt.Checkpointer.track` on a DMP): from the model's ``ModelDeltaTracker``
(TorchRec's ``init_torchrec_delta_tracker``, any tracking mode) when it has one, read at each
save; else from deltackpt's own post-lookup function on each ``ShardedEmbeddingBagCollection``.
Both give shard-local row ids; a table's weight and its row-wise state share the marks, and the
canary checks both (:mod:`deltackpt.tracking.changes`).

torchrec is not imported here: the objects passed in come from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SettingError, StateError
from ..sharding import Shard, is_dtensor, is_sharded_tensor

CONVERSIONS = ("column_mean",)


class MomentumLayoutError(StateError):
    """A table's row-wise optimizer state was saved with another number of column shards than
    the restore target has, and no conversion was asked for."""


@dataclass(frozen=True)
class Convert:
    """A fused optimizer to restore with a conversion of its row-wise state.

    Attributes:
        optimizer: the DMP's ``fused_optimizer``.
        momentum: ``"column_mean"`` (see the module's docstring).
    """

    optimizer: Any
    momentum: str = "column_mean"

    def __post_init__(self) -> None:
        if self.momentum not in CONVERSIONS:
            raise SettingError(f"momentum conversion must be one of {CONVERSIONS}, got {self.momentum!r}")


def handles(obj: object) -> bool:
    """Whether ``obj`` is a TorchRec object this module saves and restores."""
    return isinstance(obj, Convert) or type(obj).__module__.startswith("torchrec.")


@dataclass
class LiveState:
    """A TorchRec object's state as deltackpt sees it, and how to put restored values back.

    Attributes:
        tree: the nested dict of Shards, tensors and plain values.
        copies: for each Shard that is a copy of several local shards, the function that writes
            its values back into them.
    """

    tree: dict[str, Any]
    copies: list[Callable[[], None]]

    def write_back(self) -> None:
        for fn in self.copies:
            fn()


def live_state(obj: Any) -> LiveState:
    """The state of a DMP (or any torchrec module) or a fused optimizer.

    Raises:
        StateError: a table's local shards do not form one block, or its row-wise state has a
            layout this module does not know (grid sharding).
    """
    copies: list[Callable[[], None]] = []
    if isinstance(obj, Convert):
        obj = obj.optimizer
    if isinstance(obj, torch.nn.Module):
        tree: dict[str, Any] = {}
        for key, value in obj.state_dict().items():
            parts = local_parts(value)
            if parts is None:
                tree[key] = value
            elif parts:
                tree[key] = _coalesce(key, global_shape(value), parts, copies)
        return LiveState(tree, copies)
    if not callable(getattr(obj, "state_dict", None)) or not hasattr(obj, "params"):
        raise StateError(f"cannot save a {type(obj).__name__} from torchrec: pass the DMP and "
                         "its fused_optimizer")
    sd = obj.state_dict()
    state: dict[str, dict[str, Any]] = {}
    columns: dict[str, tuple[int, ...]] = {}
    for fqn, entries in sd.get("state", {}).items():
        weight = obj.params.get(fqn)
        for name, value in entries.items():
            parts = local_parts(value)
            if parts is None:
                state.setdefault(fqn, {})[name] = value
                continue
            shape = global_shape(value)
            table = global_shape(weight) if is_sharded_tensor(weight) else ()
            if len(shape) == 1 and len(table) == 2:
                bounds = column_bounds(weight)
                parts, shape = _rows_by_column(fqn, name, parts, shape, table[0], len(bounds) - 1)
                columns[fqn] = bounds
            if parts:
                state.setdefault(fqn, {})[name] = _coalesce(f"{fqn}/{name}", shape, parts, copies)
    return LiveState({"state": state, "columns": columns}, copies)


def column_bounds(weight: Any) -> tuple[int, ...]:
    """The column boundaries of a ShardedTensor table's shards: ``(0, ..., columns)``."""
    cols = sorted({int(md.shard_offsets[1]) for md in weight.metadata().shards_metadata})
    return (*cols, int(weight.size(1)))


def global_shape(value: Any) -> tuple[int, ...]:
    """The global shape of a ShardedTensor (from its metadata: its ``size()`` goes through
    torch function dispatch, many times slower than reading the metadata) or of a DTensor."""
    size = value.metadata().size if is_sharded_tensor(value) else value.shape
    return tuple(int(n) for n in size)


def local_parts(value: Any) -> list[_Local] | None:
    """This rank's shards of a sharded TorchRec tensor with their global offsets (none where
    the rank holds none), or None if ``value`` is not one: a ShardedTensor, or a DTensor whose
    local tensor is TorchRec's ``LocalShardsWrapper`` (``output_dtensor=True``; its placements
    do not describe table-wise or column-wise layouts, its offsets do)."""
    if is_sharded_tensor(value):
        return [_Local(s.tensor, tuple(int(o) for o in s.metadata.shard_offsets))
                for s in value.local_shards()]
    if is_dtensor(value):
        local = value.to_local()
        if type(local).__name__ == "LocalShardsWrapper":
            return [_Local(t, tuple(int(o) for o in offset))
                    for t, offset in zip(local.local_shards(), local.local_offsets())]
    return None


@dataclass(frozen=True)
class _Local:
    tensor: torch.Tensor
    offset: tuple[int, ...]


def _rows_by_column(fqn: str, name: str, parts: list[_Local], shape: tuple[int, ...], rows: int,
                    k: int) -> tuple[list[_Local], tuple[int, ...]]:
    """A row-wise state's shards as blocks of a ``(rows, k)`` tensor (see the module docstring)."""
    if shape[0] != rows * k:
        raise StateError(f"{fqn}: optimizer state {name!r} has {shape[0]} values for a table of "
                         f"{rows} rows in {k} column shards (grid sharding is not supported)")
    out = []
    for p in parts:
        n = p.tensor.shape[0]
        if k == 1:
            out.append(_Local(p.tensor.view(n, 1), (p.offset[0], 0)))
        elif n == rows and p.offset[0] % rows == 0:
            out.append(_Local(p.tensor.view(n, 1), (0, p.offset[0] // rows)))
        else:
            raise StateError(f"{fqn}: optimizer state {name!r} has a shard of {n} values at "
                             f"{p.offset[0]}, not one column shard's {rows} rows")
    return out, (rows, k)


def _coalesce(key: str, shape: tuple[int, ...], parts: list[_Local],
              copies: list[Callable[[], None]]) -> Shard:
    """One Shard over a rank's local shards of a tensor: a view of a single shard, else a copy of
    shards that share their rows (column shards) or their columns, written back by ``copies``."""
    if len(parts) == 1:
        return Shard(parts[0].tensor, global_shape=shape, global_offset=parts[0].offset)
    for dim in (1, 0):
        other = 1 - dim
        ordered = sorted(parts, key=lambda p: p.offset[dim])
        same = all(p.offset[other] == ordered[0].offset[other]
                   and p.tensor.shape[other] == ordered[0].tensor.shape[other] for p in ordered)
        adjacent = all(a.offset[dim] + a.tensor.shape[dim] == b.offset[dim]
                       for a, b in zip(ordered, ordered[1:]))
        if same and adjacent:
            whole = torch.cat([p.tensor for p in ordered], dim=dim)

            def back(ordered: list[_Local] = ordered, whole: torch.Tensor = whole,
                     dim: int = dim) -> None:
                at = 0
                for p in ordered:
                    n = p.tensor.shape[dim]
                    p.tensor.copy_(whole.narrow(dim, at, n))
                    at += n

            copies.append(back)
            return Shard(whole, global_shape=shape, global_offset=ordered[0].offset)
    raise StateError(f"{key}: this rank's {len(parts)} shards at "
                     f"{sorted(p.offset for p in parts)} do not form one block")


def prepare_restore(obj: Any, saved_shape: Callable[[tuple[str, ...]], tuple[int, ...] | None]
                    ) -> tuple[LiveState, Callable[[], None]]:
    """The live state to restore ``obj`` into, and what to run once the restore filled it.

    A row-wise state saved with another number of column shards is left to a conversion: its
    place in the live tree gets a placeholder, which the restore replaces with the whole saved
    tensor, and the returned function converts that into the live shards (before writing the
    copies of coalesced shards back).

    Args:
        obj: the DMP, the fused optimizer, or a :class:`Convert` of it.
        saved_shape: the saved global shape of the tensor at a path under ``obj`` (a tuple of
            keys, as in the live tree), or None if it was not saved.

    Raises:
        MomentumLayoutError: a table's column split differs and ``obj`` is not a Convert.
    """
    live = live_state(obj)
    if isinstance(obj, torch.nn.Module):
        return live, live.write_back
    conversions = []
    for fqn, entries in live.tree["state"].items():
        bounds = live.tree["columns"].get(fqn)
        for name, target in list(entries.items()):
            saved = saved_shape(("state", fqn, name))
            if (bounds is None or not isinstance(target, Shard) or saved is None or len(saved) != 2
                    or saved == target.global_shape or saved[0] != target.global_shape[0]):
                continue  # the same layout, or a mismatch that the restore reports as it is
            table = fqn.removesuffix(".weight").rsplit(".", 1)[-1]
            if not isinstance(obj, Convert):
                raise MomentumLayoutError(
                    f"table {table!r}: optimizer state {name!r} was saved for {saved[1]} column "
                    f"shards and this plan has {len(bounds) - 1}; it cannot be restored exactly "
                    f"(pass Convert(optimizer, momentum='column_mean') to convert it)")
            entries[name] = None
            conversions.append((fqn, name, target, bounds))

    def finish() -> None:
        for fqn, name, target, bounds in conversions:
            saved = live.tree["state"][fqn][name]
            saved_bounds = live.tree["columns"].get(fqn)
            if not isinstance(saved, torch.Tensor) or saved_bounds is None:
                raise StateError(f"{fqn}: the checkpoint lacks the column boundaries of {name!r}")
            target.local.copy_(column_mean(saved, tuple(saved_bounds), bounds, target))
        live.write_back()

    return live, finish


def column_mean(saved: torch.Tensor, saved_bounds: tuple[int, ...], bounds: tuple[int, ...],
                target: Shard) -> torch.Tensor:
    """Values of ``target`` (a block of a ``(rows, k')`` row-wise state) from ``saved``
    (``(rows, k)``): each new column shard's value is the mean of the saved shards' values
    weighted by how many of its columns each covers."""
    if saved_bounds[-1] != bounds[-1]:
        raise StateError(f"saved column boundaries {list(saved_bounds)} and live ones "
                         f"{list(bounds)} span different widths")
    r0, c0 = target.global_offset
    n, w = target.local.shape
    rows = saved[r0:r0 + n].to(torch.float64)
    out = torch.zeros(n, w, dtype=torch.float64)
    for j in range(w):
        lo, hi = bounds[c0 + j], bounds[c0 + j + 1]
        for i in range(len(saved_bounds) - 1):
            overlap = min(hi, saved_bounds[i + 1]) - max(lo, saved_bounds[i])
            if overlap > 0:
                out[:, j] += rows[:, i] * overlap
        out[:, j] /= hi - lo
    return out.to(target.local.dtype)
