"""Hugging Face adapter: a ``TrainerCallback`` driving a :class:`~deltackpt.hooks.CheckpointHook`.

Import it only where transformers is installed (``pip install deltackpt[huggingface]``);
``import deltackpt`` never imports transformers.

What it saves, keyed as in a :class:`~deltackpt.examples.TrainState`: the model
(``model/...``), the optimizer (``optim/0/...``), the LR scheduler (``sched/0/...``), the
Trainer's counters (``trainer``: global step, epoch, input tokens seen, total FLOs), the global
step (``step``) and the torch RNG (``rng/torch``).

Resuming: with ``resume``, all of that is restored when training begins. The Trainer decides
which batches it feeds before any callback runs and fast-forwards its data only for its own
checkpoint folders, so after a deltackpt restore it starts its data from the beginning again:
the weights, optimizer and schedule continue exactly, the data order does not.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ..errors import HookClosedError
from ..hooks import CheckpointHook
from ..rng import RngState
from .adapter import AdapterSettings

_COUNTERS = ("global_step", "epoch", "num_input_tokens_seen", "total_flos")


class _TrainerCounters:
    """The Trainer's progress counters as a checkpointable object (JSON values only)."""

    def __init__(self, state: TrainerState):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.state, name) for name in _COUNTERS}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for name in _COUNTERS:
            setattr(self.state, name, saved[name])


class DeltackptTrainerCallback(AdapterSettings, TrainerCallback):
    """Saves every ``every`` optimizer steps of a ``transformers.Trainer`` into a deltackpt store.

    Args:
        checkpointer: a :class:`~deltackpt.Checkpointer`, or a path or storage to open one on.
        every: save when ``state.global_step % every == 0``.
        resume: when training begins, restore the latest step (True), a given step (an int), or
            nothing (False). With nothing committed yet, ``True`` starts fresh.
        track: track the model's embedding rows (see :class:`~deltackpt.hooks.CheckpointHook`).

    Raises:
        SettingError: ``every`` is not a positive int.

    Example:
        >>> import tempfile
        >>> callback = DeltackptTrainerCallback(tempfile.mkdtemp(), every=100)
        >>> Trainer(model, args, train_dataset=data, callbacks=[callback]).train()  # doctest: +SKIP
    """

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *,
        model: Any = None, optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any,
    ) -> None:
        saved: dict[str, Any] = {"model": model, "optim": {"0": optimizer}}
        if lr_scheduler is not None:
            saved["sched"] = {"0": lr_scheduler}
        saved.update(trainer=_TrainerCounters(state), step=state.global_step, rng=RngState())
        self.hook = CheckpointHook(self.checkpointer, saved, every=self.every, model=model,
                                   track=self.track, blocking=self.blocking)
        if self.resume is not False:
            self.restored_step = self.hook.restore(None if self.resume is True else self.resume)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._hook().before_optimizer_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        hook = self._hook()
        hook.state["step"] = state.global_step
        hook.on_step_end(state.global_step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.hook is not None:
            self.hook.close()
            self.hook = None

    def _hook(self) -> CheckpointHook:
        if self.hook is None:
            raise HookClosedError(
                "DeltackptTrainerCallback has no open hook outside Trainer.train()"
            )
        return self.hook
