"""PyTorch Lightning adapter: a ``Callback`` that drives a :class:`~deltackpt.hooks.CheckpointHook`.

Import it only where Lightning is installed (``pip install deltackpt[lightning]``);
``import deltackpt`` never imports Lightning.

What it saves, keyed as in a :class:`~deltackpt.examples.TrainState`: the LightningModule
(``model/...``), the optimizers by position (``optim/0/...``), the LR schedulers
(``sched/0/...``), the fit loop's progress counters (``loops``, JSON), the global step
(``step``) and the torch RNG (``rng/torch``). Restoring them all at fit start resumes the loop
where the saved step left it, as Lightning's own ``ckpt_path`` would.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from ..errors import HookClosedError
from ..hooks import CheckpointHook
from ..rng import RngState
from .adapter import AdapterSettings


class _FitLoopState:
    """The fit loop's progress (epochs, batches, optimizer steps) as a checkpointable object."""

    def __init__(self, trainer: pl.Trainer):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.fit_loop.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(state)


class DeltackptCallback(AdapterSettings, pl.Callback):
    """Saves every ``every`` optimizer steps into a deltackpt store, and resumes from it.

    Args:
        checkpointer: a :class:`~deltackpt.Checkpointer`, or a path or storage to open one on.
        every: save when ``trainer.global_step % every == 0`` (after an optimizer step).
        resume: at fit start, restore the latest step (True), a given step (an int), or nothing
            (False). With nothing committed yet, ``True`` starts fresh.
        track: track the embedding rows of the LightningModule (see
            :class:`~deltackpt.hooks.CheckpointHook`).

    Raises:
        SettingError: ``every`` is not a positive int.

    Example:
        >>> import tempfile
        >>> callback = DeltackptCallback(tempfile.mkdtemp(), every=100, resume=True)
        >>> trainer = pl.Trainer(callbacks=[callback], max_steps=1000)  # doctest: +SKIP
    """

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Optimizers and schedulers exist from here on; Lightning restores its own checkpoints
        # right after this hook, at the same point.
        state = {
            "model": pl_module,
            "optim": {str(i): opt for i, opt in enumerate(trainer.optimizers)},
            "sched": {str(i): cfg.scheduler for i, cfg in enumerate(trainer.lr_scheduler_configs)},
            "loops": _FitLoopState(trainer),
            "step": trainer.global_step,
            "rng": RngState(),
        }
        self.hook = CheckpointHook(self.checkpointer, state, every=self.every, model=pl_module,
                                   track=self.track, blocking=self.blocking)
        if self.resume is not False:
            self.restored_step = self.hook.restore(None if self.resume is True else self.resume)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._hook().before_optimizer_step()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        hook = self._hook()
        step = trainer.global_step
        # Under gradient accumulation several batches end on one global step: save it once.
        if step != hook.state["step"]:
            hook.state["step"] = step
            hook.on_step_end(step)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.hook is not None:
            self.hook.close()
            self.hook = None

    def _hook(self) -> CheckpointHook:
        if self.hook is None:
            raise HookClosedError("DeltackptCallback has no open hook outside trainer.fit()")
        return self.hook
