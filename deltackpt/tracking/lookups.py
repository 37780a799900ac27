"""Reading lookup ids from the modules that look rows up: forward hooks for ``nn.Embedding``,
``nn.EmbeddingBag`` and TorchRec's ``EmbeddingBagCollection``.

Every id of every lookup is marked, ``padding_idx`` included: a row that a lookup reads but no
update changes only makes a delta a little larger, while filtering would cost a pass over the ids
on every step. EmbeddingBag inputs are marked whole, 2-D ``(B, L)`` or 1-D with ``offsets``
(offsets only split the ids into bags; ``per_sample_weights`` do not matter). The hooks run after
the module's forward, so a forward that raises marks nothing (and updates nothing).

TorchRec: a module that is an instance of TorchRec's ``EmbeddingBagCollectionInterface`` (the
plain and the fused ``EmbeddingBagCollection``) is hooked as a whole: its ``KeyedJaggedTensor``
input is split per feature with ``keys()``, ``values()`` and ``length_per_key()`` (which the
module's own forward computes and caches, so reading it adds no device sync), and each feature's
ids mark the table that ``embedding_bag_configs()`` assigns it to. torchrec is never imported
here: the interface class is looked up among the modules already imported, since a model that
holds such a module has imported it. Sharded collections (in a DMP) are tracked by
:mod:`deltackpt.integrations.torchrec_marks`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, cast

import torch
from torch import nn

from ..errors import StateError

Hook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]


class Marker(Protocol):
    """Where a hook's ids go: a tracked table."""

    def mark(self, ids: torch.Tensor, table: torch.Tensor | None = None) -> None:
        """Marks rows ``ids``; ``table``, when known, is the table looked up."""


def collection_type() -> type | None:
    """TorchRec's EmbeddingBagCollectionInterface if torchrec is imported, else None."""
    mod = sys.modules.get("torchrec.modules.embedding_modules")
    return getattr(mod, "EmbeddingBagCollectionInterface", None)


def collection_tables(ebc: Any) -> Iterator[tuple[torch.Tensor, str, list[str]]]:
    """(weight, parameter name under ``ebc``, feature names) of each table of a collection."""
    for cfg in ebc.embedding_bag_configs():
        yield (ebc.embedding_bags[cfg.name].weight, f"embedding_bags.{cfg.name}.weight",
               list(cfg.feature_names or [cfg.name]))


def lookup_hook(table: Marker) -> Hook:
    """A forward hook for an ``nn.Embedding`` or ``nn.EmbeddingBag`` that marks its input ids."""

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        table.mark(args[0] if args else kwargs["input"], cast(torch.Tensor, mod.weight))

    return hook


def collection_hook(by_feature: Mapping[str, Marker]) -> Hook:
    """A forward hook for an EmbeddingBagCollection that marks each feature's ids in its table."""

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        for feature, ids in feature_ids(args[0] if args else kwargs["features"]):
            table = by_feature.get(feature)
            if table is not None:
                table.mark(ids)

    return hook


def feature_ids(kjt: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(feature, ids) of a KeyedJaggedTensor, from its public API.

    Raises:
        StateError: ``kjt`` lacks that API (a TensorDict, say): silently skipping it would leave
            rows unmarked.
    """
    if not all(callable(getattr(kjt, a, None)) for a in ("keys", "values", "length_per_key")):
        raise StateError(
            f"a tracked EmbeddingBagCollection got a {type(kjt).__name__}; tracking reads "
            "KeyedJaggedTensor inputs only (keys(), values(), length_per_key())"
        )
    return zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key()), strict=True)
