"""Marks for TorchRec's sharded embedding tables: which rows of each local shard a step touched.

Two sources, both giving shard-local row ids (a row-wise shard's ids minus its first row):

* TorchRec's own ``ModelDeltaTracker``, when the DMP has one (``dmp.get_delta_tracker()``, made by
  ``init_torchrec_delta_tracker``): its unique ids per table are read at every save, as its
  consumer ``"deltackpt"`` when it lists one, else as its default consumer.
* Otherwise deltackpt's own function in each ``ShardedEmbeddingBagCollection``'s post-lookup slot,
  which TorchRec calls with each lookup's input after the input distribution: the ids of the
  rows this rank's shards look up, per feature.

A table's weight and its row-wise optimizer state (as :mod:`deltackpt.integrations.torchrec`
lays it out: one row per table row) share its marks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..errors import StateError
from ..tracking.lookups import feature_ids
from ..tracking.marks import TrackedTable
from ..statetree import child_key
from .torchrec import live_state, local_parts

WRAPPERS = ("_dmp_wrapped_module.module.", "_dmp_wrapped_module.", "module.")


def is_sharded_model(model: nn.Module) -> bool:
    """Whether ``model`` holds a TorchRec sharded EmbeddingBagCollection."""
    return any(type(m).__name__ == "ShardedEmbeddingBagCollection" for m in model.modules())


def state_fqn(module_path: str) -> str:
    """A module's path as the DMP's ``state_dict()`` keys name it (wrappers stripped)."""
    for prefix in WRAPPERS:
        if module_path.startswith(prefix):
            return module_path[len(prefix):]
    return module_path


def track(register: Callable[[tuple[str, ...]], TrackedTable], model: nn.Module, *, prefix: str,
          optimizer: Any, optimizer_prefix: str) -> tuple[list[str], Callable[[], None], Callable[[], None]]:
    """Tracks every table of ``model``'s sharded collections that this rank holds a shard of.

    Args:
        register: makes (or finds) the tracked table of some flat keys.
        model: the DMP.
        prefix: its flat-key path in the state.
        optimizer: its fused optimizer, or None.
        optimizer_prefix: the optimizer's flat-key path.

    Returns:
        The tracked keys; a poll function that moves the ModelDeltaTracker's ids into the marks
        (a no-op with deltackpt's own lookup function); and a function that stops marking.

    Raises:
        StateError: a collection's post-lookup slot is taken by something else than TorchRec's
            own tracker.
    """
    aligned: dict[str, list[str]] = {}
    if optimizer is not None:
        live = live_state(optimizer).tree
        for fqn, entries in live["state"].items():
            aligned[fqn] = [
                child_key(optimizer_prefix, "state", fqn, name)
                for name, value in entries.items() if fqn in live["columns"]
            ]
    held = {k for k, v in model.state_dict().items() if local_parts(v) != []}
    by_table: dict[str, TrackedTable] = {}  # by the table's fqn without ".weight"
    by_feature: dict[int, dict[str, TrackedTable]] = {}
    keys: list[str] = []
    for path, mod in model.named_modules():
        if type(mod).__name__ != "ShardedEmbeddingBagCollection":
            continue
        base = state_fqn(path)
        by_feature[id(mod)] = {}
        for table, cfg in mod._table_name_to_config.items():
            fqn = f"{base}.embedding_bags.{table}" if base else f"embedding_bags.{table}"
            if f"{fqn}.weight" not in held:
                continue
            weight = child_key(prefix, f"{fqn}.weight")
            t = register((weight, *aligned.get(f"{fqn}.weight", [])))
            by_table[fqn] = t
            keys.append(weight)
            by_feature[id(mod)].update(dict.fromkeys(cfg.feature_names or [table], t))
    delta_tracker = getattr(model, "get_delta_tracker", lambda: None)()
    if delta_tracker is not None:
        consumers = getattr(delta_tracker, "per_consumer_batch_idx", {})
        consumer = "deltackpt" if "deltackpt" in consumers else None

        def poll() -> None:
            for fqn, ids in delta_tracker.get_unique_ids(consumer).items():
                t = by_table.get(fqn)
                if t is not None:
                    t.mark(ids)

        return keys, poll, lambda: None
    hooked = []
    for path, mod in model.named_modules():
        if id(mod) not in by_feature:
            continue
        current = getattr(mod, "post_lookup_tracker_fn", None)
        if current is not None and not getattr(current, "deltackpt", False):
            raise StateError(f"{path}: its post-lookup tracker slot is taken by {current!r}; "
                             "give the DMP a ModelDeltaTracker instead")
        mod.register_post_lookup_tracker_fn(_lookup_fn(by_feature[id(mod)]))
        hooked.append(mod)

    def stop() -> None:
        for mod in hooked:
            mod.post_lookup_tracker_fn = None

    return keys, lambda: None, stop


def _lookup_fn(by_feature: dict[str, TrackedTable]) -> Callable[..., None]:
    def record(features: Any, embs: Any, module: Any = None, raw_ids: Any = None) -> None:
        for feature, ids in feature_ids(features):
            t = by_feature.get(feature)
            if t is not None:
                t.mark(ids)

    record.deltackpt = True  # type: ignore[attr-defined]
    return record


