"""Example models and deterministic training loops for delta checkpointing.

* :mod:`~deltackpt.examples.dlrm`: a DLRM on Criteo-like click logs, embedding bags with sparse
  gradients trained by SGD, Adagrad or SparseAdam, MLPs by Adam.
* :mod:`~deltackpt.examples.gpt_moe`: a small GPT with mixture-of-experts blocks (unrouted experts
  stay bit-identical) and a fine-tuning mode with frozen layers.
* :mod:`~deltackpt.examples.train`: :class:`TrainState` (model, optimizers, step, RNG as one
  checkpointable dict) and the loop that trains either model, seeded and deterministic.

Example:
    >>> from deltackpt.datasets import CriteoConfig
    >>> from deltackpt.examples import deterministic, dlrm_run, train
    >>> with deterministic(0):
    ...     state, loss = dlrm_run(CriteoConfig(scale=0.0001, batch_size=8), embedding_dim=4,
    ...                            bottom_mlp=(4,), top_mlp=(4,))
    ...     _ = train(state, loss, 2)
    >>> state.step
    2
"""

from __future__ import annotations

from .dlrm import DLRM, SPARSE_OPTIMIZERS, DLRMConfig, dlrm_loss, dlrm_optimizers
from .gpt_moe import GPTMoE, GPTMoEConfig, MoE, gpt_loss, gpt_optimizers
from .train import RngState, TrainState, deterministic, dlrm_run, gpt_run, train

__all__ = [
    "DLRM",
    "DLRMConfig",
    "GPTMoE",
    "GPTMoEConfig",
    "MoE",
    "RngState",
    "SPARSE_OPTIMIZERS",
    "TrainState",
    "deterministic",
    "dlrm_loss",
    "dlrm_optimizers",
    "dlrm_run",
    "gpt_loss",
    "gpt_optimizers",
    "gpt_run",
    "train",
]
