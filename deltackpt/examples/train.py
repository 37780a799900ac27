"""Deterministic CPU training loops whose whole state fits a deltackpt checkpoint.

A run is a :class:`TrainState` (model, optimizers, step, RNG) plus a loss function of the step:
the data streams of :mod:`deltackpt.datasets` are random-access, so the step alone is the data
position and a restored run needs no replay. On the CPU the same operations on the same inputs
give the same bits at a fixed thread count, so a run restored at step M and trained to N matches
the uninterrupted run to N bit for bit (``tests/integration/test_resume.py``); across thread
counts, reductions may split differently and the bits may differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..datasets import CriteoConfig, CriteoStream, TokenStream, TokenStreamConfig
from ..errors import SettingError
from ..rng import RngState
from .dlrm import DLRM, DLRMConfig, dlrm_loss, dlrm_optimizers
from .gpt_moe import GPTMoE, GPTMoEConfig, gpt_loss, gpt_optimizers

if TYPE_CHECKING:
    from ..hooks import CheckpointHook


@contextlib.contextmanager
def deterministic(seed: int, *, threads: int | None = None) -> Iterator[None]:
    """Seeds torch and makes it deterministic inside the block, restoring the settings after.

    Args:
        seed: seeds the default torch generator.
        threads: intra-op threads inside the block; None keeps the current count. Results are
            reproducible at a fixed count; fix it when comparing runs made in different processes.

    Example:
        >>> with deterministic(0):
        ...     a = torch.rand(2)
        >>> with deterministic(0):
        ...     bool(torch.equal(a, torch.rand(2)))
        True
    """
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
        torch.set_num_threads(was_threads)


class TrainState(dict):
    """Model, optimizers, step and RNG in the layout a :class:`~deltackpt.Checkpointer` saves.

    A dict with the entries ``"model"``, ``"optim"`` (optimizers by name), ``"step"`` (steps done,
    which is also the data position), ``"rng"`` (an :class:`RngState`) and any extra stateful
    objects (schedulers...). Pass it as the ``state`` of ``save`` and ``restore``: tensors are keyed
    ``model/<parameter>``, ``optim/<name>/...``, ``rng/torch``; a restore fills the model in
    place, loads the optimizers, replaces ``"step"`` and sets the RNG.

    Args:
        model: the model.
        optimizers: optimizers by name.
        step: steps done so far.
        **extra: more entries to save and restore (objects with ``state_dict()``, tensors,
            JSON-able values).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model, {"adam": torch.optim.Adam(model.parameters())})
        >>> sorted(state), state.step
        (['model', 'optim', 'rng', 'step'], 0)
    """

    def __init__(self, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer], *,
                 step: int = 0, **extra: Any):
        super().__init__(model=model, optim=dict(optimizers), step=step, rng=RngState(), **extra)

    @property
    def model(self) -> nn.Module:
        return self["model"]

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return self["optim"]

    @property
    def step(self) -> int:
        return self["step"]

    @step.setter
    def step(self, value: int) -> None:
        self["step"] = value


def train(
    state: TrainState,
    loss: Callable[[int], torch.Tensor],
    until: int,
    *,
    hook: CheckpointHook | None = None,
) -> list[float]:
    """Trains from ``state.step`` to ``until``: per step, zero the gradients (to None, so untouched
    parameters are skipped by the optimizers), back-propagate ``loss(step)``, step every optimizer.

    Args:
        state: what to train; ``state.step`` advances to ``until``.
        loss: the loss of the batch at a step (steps count from 0).
        until: the step to stop at.
        hook: if given, ``before_optimizer_step()`` runs before the optimizers step and
            ``on_step_end(step)`` after, with the number of steps done.

    Returns:
        The loss of each step trained.

    Example:
        >>> state, loss = dlrm_run(CriteoConfig(scale=0.0001, batch_size=8), embedding_dim=4,
        ...                        bottom_mlp=(4,), top_mlp=(4,))
        >>> len(train(state, loss, 3)), state.step
        (3, 3)
    """
    losses = []
    while state.step < until:
        for opt in state.optimizers.values():
            opt.zero_grad(set_to_none=True)
        value = loss(state.step)
        value.backward()
        if hook is not None:
            hook.before_optimizer_step()
        for opt in state.optimizers.values():
            opt.step()
        state.step += 1
        losses.append(value.item())
        if hook is not None:
            hook.on_step_end(state.step)
    return losses


def dlrm_run(
    data: CriteoConfig,
    *,
    sparse_optimizer: str = "adagrad",
    seed: int = 0,
    **shapes: Any,
) -> tuple[TrainState, Callable[[int], torch.Tensor]]:
    """A DLRM on a Criteo-like stream, ready for :func:`train`.

    Args:
        data: the stream; the tables are sized from it.
        sparse_optimizer: the embedding optimizer (see :func:`~.dlrm.dlrm_optimizers`).
        seed: seeds the model's initialisation.
        **shapes: :class:`~.dlrm.DLRMConfig` fields (``embedding_dim``, ``bottom_mlp``...).

    Returns:
        The state at step 0 and the loss of the batch at a step.
    """
    stream = CriteoStream(data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DLRM(DLRMConfig.for_criteo(data, **shapes))
    state = TrainState(model, dlrm_optimizers(model, sparse=sparse_optimizer))
    return state, lambda step: dlrm_loss(model, stream.batch(step))


def gpt_run(
    data: TokenStreamConfig,
    config: GPTMoEConfig,
    *,
    trainable_blocks: int | None = None,
    lr: float = 1e-3,
    seed: int = 0,
) -> tuple[TrainState, Callable[[int], torch.Tensor]]:
    """A GPT-MoE model on a token stream, ready for :func:`train`.

    Args:
        data: the stream; its ``vocab_size`` and ``seq_len`` must fit ``config``.
        config: the model's shapes.
        trainable_blocks: fine-tuning mode: train only this many top blocks and the head (see
            :meth:`~.gpt_moe.GPTMoE.freeze`); None trains everything.
        lr: the learning rate of both optimizers.
        seed: seeds the model's initialisation.

    Returns:
        The state at step 0 and the loss of the batch at a step.

    Raises:
        SettingError: the stream does not fit the model.

    Example:
        >>> config = GPTMoEConfig(vocab_size=64, seq_len=8, num_experts=4)
        >>> data = TokenStreamConfig(vocab_size=64, seq_len=8, batch_size=2)
        >>> state, loss = gpt_run(data, config, trainable_blocks=1)
        >>> sorted(state.optimizers)
        ['dense']
    """
    if data.vocab_size > config.vocab_size or data.seq_len > config.seq_len:
        raise SettingError(
            f"the stream (vocab_size={data.vocab_size}, seq_len={data.seq_len}) does not fit the "
            f"model (vocab_size={config.vocab_size}, seq_len={config.seq_len})"
        )
    stream = TokenStream(data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTMoE(config)
    if trainable_blocks is not None:
        model.freeze(trainable_blocks)
    state = TrainState(model, gpt_optimizers(model, lr=lr))
    return state, lambda step: gpt_loss(model, stream.batch(step))
