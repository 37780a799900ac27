"""A DLRM (Naumov et al., 2019) sized from a Criteo-like stream, with the optimizers it trains with.

The model is the reference DLRM's: one ``nn.EmbeddingBag`` per categorical feature (sum pooling,
sparse gradients), a bottom MLP over the dense features whose output has the embedding
dimension, pairwise dot products of the 27 resulting vectors (strictly lower triangle), and a top
MLP over those products and the bottom output. Embedding rows change only where a batch looked
them up, which is what a delta checkpoint exploits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..datasets import NUM_DENSE, CriteoBatch, CriteoConfig
from ..errors import SettingError

SPARSE_OPTIMIZERS = ("sgd", "adagrad", "sparse_adam")
"""Optimizers :func:`dlrm_optimizers` can put on the embedding tables; each updates only the
rows a batch looked up."""


@dataclass(frozen=True)
class DLRMConfig:
    """Shapes of a :class:`DLRM`; every field is validated on construction.

    The reference DLRM for Criteo Kaggle uses embedding dimension 16, bottom MLP 13-512-256-64-16
    and top MLP 512-256-1; the defaults here are a CPU-sized version of that.

    Raises:
        SettingError: a field is out of range; the message names the field and the value.

    Example:
        >>> DLRMConfig(table_sizes=(10, 20), embedding_dim=8, bottom_mlp=(16, 8)).num_tables
        2
    """

    table_sizes: tuple[int, ...]
    """Rows of each embedding table, one table per categorical feature."""
    embedding_dim: int = 16
    """Width of every embedding row (and of the bottom MLP's output)."""
    bottom_mlp: tuple[int, ...] = (64, 16)
    """Layer widths of the bottom MLP after the dense input; the last must be ``embedding_dim``."""
    top_mlp: tuple[int, ...] = (64, 32)
    """Hidden layer widths of the top MLP; a final layer of width 1 gives the click logit."""
    num_dense: int = NUM_DENSE
    """Dense input features."""

    def __post_init__(self) -> None:
        sizes = tuple(self.table_sizes)
        if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise SettingError(f"table_sizes must be positive ints, got {self.table_sizes!r}")
        object.__setattr__(self, "table_sizes", sizes)
        for name in ("embedding_dim", "num_dense"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SettingError(f"{name} must be a positive int, got {value!r}")
        for name in ("bottom_mlp", "top_mlp"):
            widths = tuple(getattr(self, name))
            if any(not isinstance(w, int) or w < 1 for w in widths):
                raise SettingError(f"{name} must hold positive ints, got {getattr(self, name)!r}")
            object.__setattr__(self, name, widths)
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.embedding_dim:
            raise SettingError(
                f"bottom_mlp must end in embedding_dim ({self.embedding_dim}) so its output joins "
                f"the dot interaction, got {self.bottom_mlp!r}"
            )

    @classmethod
    def for_criteo(cls, config: CriteoConfig, **shapes: Any) -> DLRMConfig:
        """A config with one table per Criteo feature, sized from ``config.table_sizes``.

        Args:
            config: the stream the model will train on.
            **shapes: any other field (``embedding_dim``, ``bottom_mlp``, ``top_mlp``).

        Example:
            >>> DLRMConfig.for_criteo(CriteoConfig(scale=0.0001)).num_tables
            26
        """
        return cls(table_sizes=config.table_sizes, **shapes)

    @property
    def num_tables(self) -> int:
        return len(self.table_sizes)


def _mlp(widths: Sequence[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Embedding bags, bottom MLP, dot interaction, top MLP; returns one click logit per sample.

    Args:
        config: the shapes.

    Example:
        >>> from deltackpt.datasets import CriteoStream
        >>> data = CriteoConfig(scale=0.0001, batch_size=4)
        >>> model = DLRM(DLRMConfig.for_criteo(data, embedding_dim=8, bottom_mlp=(16, 8)))
        >>> batch = CriteoStream(data).batch(0)
        >>> model(batch.dense, batch.indices, batch.offsets).shape
        torch.Size([4])
    """

    def __init__(self, config: DLRMConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.ModuleList(
            nn.EmbeddingBag(rows, config.embedding_dim, mode="sum", sparse=True)
            for rows in config.table_sizes
        )
        for bag in cast(list[nn.EmbeddingBag], list(self.embeddings)):
            # The reference DLRM's initialisation: uniform in ±sqrt(1 / rows).
            bound = (1.0 / bag.num_embeddings) ** 0.5
            nn.init.uniform_(bag.weight, -bound, bound)
        self.bottom = _mlp((config.num_dense, *config.bottom_mlp), last_relu=True)
        vectors = config.num_tables + 1
        tril = torch.tril_indices(vectors, vectors, offset=-1)
        self._rows: torch.Tensor
        self._cols: torch.Tensor
        self.register_buffer("_rows", tril[0], persistent=False)
        self.register_buffer("_cols", tril[1], persistent=False)
        interactions = vectors * (vectors - 1) // 2
        self.top = _mlp((config.embedding_dim + interactions, *config.top_mlp, 1), last_relu=False)

    def forward(
        self, dense: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Click logits.

        Args:
            dense: float ``[B, num_dense]``.
            indices: int64 ``[num_tables, L]``, the ids of every table's bags.
            offsets: int64 ``[B]``, where each sample's bag starts in ``indices[t]``.

        Returns:
            float ``[B]`` logits.
        """
        x = self.bottom(dense)
        pooled = [bag(indices[t], offsets) for t, bag in enumerate(self.embeddings)]
        vectors = torch.stack([x, *pooled], dim=1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))[:, self._rows, self._cols]
        return self.top(torch.cat([x, products], dim=1)).squeeze(1)


def dlrm_loss(model: DLRM, batch: CriteoBatch) -> torch.Tensor:
    """Mean binary cross-entropy of ``model`` on ``batch``."""
    logits = model(batch.dense, batch.indices, batch.offsets)
    return F.binary_cross_entropy_with_logits(logits, batch.labels)


def dlrm_optimizers(
    model: DLRM,
    *,
    sparse: str = "adagrad",
    sparse_lr: float | None = None,
    dense_lr: float = 1e-3,
) -> dict[str, torch.optim.Optimizer]:
    """The DLRM's two optimizers: ``"sparse"`` over the embedding tables, ``"dense"`` (Adam)
    over the MLPs.

    Args:
        model: the model to train.
        sparse: ``"sgd"``, ``"adagrad"`` or ``"sparse_adam"``; each takes sparse gradients and
            changes only the rows (and row-aligned state) a batch looked up.
        sparse_lr: learning rate of the embedding optimizer; default 0.1 for SGD and Adagrad,
            1e-3 for SparseAdam.
        dense_lr: Adam's learning rate for the MLPs.

    Returns:
        ``{"sparse": ..., "dense": ...}``.

    Raises:
        SettingError: ``sparse`` names no supported optimizer.

    Example:
        >>> model = DLRM(DLRMConfig(table_sizes=(10,), embedding_dim=4, bottom_mlp=(4,)))
        >>> sorted(dlrm_optimizers(model, sparse="sgd"))
        ['dense', 'sparse']
    """
    if sparse not in SPARSE_OPTIMIZERS:
        raise SettingError(f"sparse must be one of {SPARSE_OPTIMIZERS}, got {sparse!r}")
    tables = list(model.embeddings.parameters())
    dense = [*model.bottom.parameters(), *model.top.parameters()]
    if sparse == "sparse_adam":
        lr = 1e-3 if sparse_lr is None else sparse_lr
        table_opt: torch.optim.Optimizer = torch.optim.SparseAdam(tables, lr=lr)
    else:
        lr = 0.1 if sparse_lr is None else sparse_lr
        cls = torch.optim.SGD if sparse == "sgd" else torch.optim.Adagrad
        table_opt = cls(tables, lr=lr)
    return {"sparse": table_opt, "dense": torch.optim.Adam(dense, lr=dense_lr)}
