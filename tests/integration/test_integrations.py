"""The Lightning and Hugging Face adapters inside real training loops: saves on the schedule,
the saved state is the trained one, and a restored run continues from it. Skipped where the
framework is not installed (``pip install deltackpt[lightning]`` / ``deltackpt[huggingface]``)."""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from deltackpt import Checkpointer
from deltackpt.examples import deterministic
from helpers import assert_same_state

IDS = torch.randint(0, 50, (32, 3), generator=torch.Generator().manual_seed(0))
TARGETS = torch.randn(32, generator=torch.Generator().manual_seed(1))


def test_importing_deltackpt_imports_no_framework():
    code = ("import sys, deltackpt, deltackpt.hooks, deltackpt.integrations; "
            "print(sorted(m for m in ('lightning', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def committed(path) -> list[int]:
    with Checkpointer(path, create=False) as ckpt:
        return ckpt.steps()


class Regressor(nn.Module):
    """An embedding bag and a linear head, with dropout so that the RNG matters."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(50, 4, mode="sum")
        self.drop = nn.Dropout(0.2)
        self.lin = nn.Linear(4, 1)

    def forward(self, ids):
        return self.lin(self.drop(self.emb(ids))).squeeze(1)


# -- Lightning ----------------------------------------------------------------------------------


def fit_lightning(path, max_steps, *, resume=False, seed=0, accumulate=1, kill_at=None, **settings):
    pl = pytest.importorskip("lightning.pytorch")
    from deltackpt.integrations.lightning import DeltackptCallback

    class Kill(pl.Callback):
        # After the deltackpt callback: the job dies right after its save at ``kill_at``.
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == kill_at:
                callback.hook.checkpointer.wait()  # its save at kill_at commits (in the background)
                os.kill(os.getpid(), signal.SIGKILL)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Regressor()

        def training_step(self, batch, batch_idx):
            ids, y = batch
            return nn.functional.mse_loss(self.net(ids), y)

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=0.01)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    data = torch.utils.data.TensorDataset(IDS, TARGETS)
    # 8 batches per epoch; without an explicit generator the shuffle order is drawn from the
    # torch RNG, which the callback saves and restores.
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    with deterministic(seed):
        module = Module()
        callback = DeltackptCallback(path, every=4, resume=resume, **settings)
        trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback, Kill()],
                             accumulate_grad_batches=accumulate, accelerator="cpu", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(module, loader)
    return module, trainer, callback


def lightning_state(module, trainer) -> dict:
    return {"model": copy.deepcopy(module.state_dict()),
            "optim": copy.deepcopy(trainer.optimizers[0].state_dict()),
            "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict()}


def test_lightning_saves_on_schedule_and_resumes_bit_exactly(store_path):
    module, trainer, callback = fit_lightning(store_path, 16)
    assert callback.hook is None  # closed at teardown
    with Checkpointer(store_path, create=False) as ckpt:
        assert ckpt.steps() == [4, 8, 12, 16]
        saved = ckpt.load(16)
    assert saved["step"] == 16 and saved["loops"]["epoch_progress"]["current"]["completed"] == 1
    assert_same_state(saved["model"], dict(module.state_dict()))
    want = lightning_state(module, trainer)

    # Restored at an epoch boundary into a module built from another seed.
    module2, trainer2, callback2 = fit_lightning(store_path, 16, resume=8, seed=1)
    assert callback2.restored_step == 8 and trainer2.global_step == 16
    assert_same_state(lightning_state(module2, trainer2), want)


@pytest.fixture
def saves(monkeypatch) -> list[bool]:
    """Whether each save of any Checkpointer blocked (its ``blocking`` argument)."""
    made: list[bool] = []
    real = Checkpointer.save

    def save(self, step, state, *, blocking=True):
        made.append(blocking)
        return real(self, step, state, blocking=blocking)

    monkeypatch.setattr(Checkpointer, "save", save)
    return made


@pytest.mark.parametrize("settings", [{}, {"blocking": True}], ids=["default", "blocking"])
def test_lightning_saves_in_the_background_unless_told_to_block(store_path, saves, settings):
    fit_lightning(store_path, 8, **settings)
    assert saves == [settings.get("blocking", False)] * 2
    assert committed(store_path) == [4, 8]


def test_lightning_saves_each_global_step_once_under_accumulation(store_path, caplog):
    with caplog.at_level(logging.WARNING, logger="deltackpt.hooks"):
        fit_lightning(store_path, 4, accumulate=2)
    assert committed(store_path) == [4]
    assert "committed already" not in caplog.text


# -- Hugging Face -------------------------------------------------------------------------------


@pytest.fixture
def transformers(monkeypatch):
    """transformers, imported without the repository root on sys.path: there, the source folder
    of deltackpt.datasets is a top-level ``datasets`` that transformers would take for Hugging
    Face's (``python -m pytest`` from the root puts the root on sys.path)."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != root])
    return pytest.importorskip("transformers")


class HFRegressor(Regressor):
    def forward(self, ids, labels):
        out = super().forward(ids)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def train_hf(transformers, path, max_steps, *, resume=False, spy=None, kill_at=None, **settings):
    from deltackpt.integrations.huggingface import DeltackptTrainerCallback

    class Kill(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == kill_at:
                callback.hook.checkpointer.wait()
                os.kill(os.getpid(), signal.SIGKILL)

    callback = DeltackptTrainerCallback(path, every=2, resume=resume, **settings)
    args = transformers.TrainingArguments(
        output_dir=str(path) + "-hf", max_steps=max_steps, per_device_train_batch_size=4,
        learning_rate=0.01, save_strategy="no", report_to=[], logging_strategy="no",
        disable_tqdm=True, use_cpu=True, seed=0)
    data = [{"ids": IDS[i], "labels": TARGETS[i]} for i in range(len(IDS))]
    with deterministic(0):
        model = HFRegressor()
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       callbacks=[callback, Kill()] + ([spy] if spy else []))
        trainer.train()
    return model, trainer, callback


def test_huggingface_saves_on_schedule(transformers, store_path):
    model, trainer, callback = train_hf(transformers, store_path, 6)
    assert callback.hook is None  # closed at train end
    with Checkpointer(store_path, create=False) as ckpt:
        assert ckpt.steps() == [2, 4, 6]
        saved = ckpt.load(6)
    assert saved["step"] == 6 and saved["trainer"]["global_step"] == 6
    assert_same_state(saved["model"], dict(model.state_dict()))
    assert_same_state(saved["optim"]["0"]["state"],
                      copy.deepcopy(trainer.optimizer.state_dict()["state"]))


@pytest.mark.parametrize("settings", [{}, {"blocking": True}], ids=["default", "blocking"])
def test_huggingface_saves_in_the_background_unless_told_to_block(transformers, store_path, saves, settings):
    train_hf(transformers, store_path, 4, **settings)
    assert saves == [settings.get("blocking", False)] * 2
    assert committed(store_path) == [2, 4]


def test_huggingface_resume_restores_the_state_when_training_begins(transformers, store_path):
    train_hf(transformers, store_path, 6)
    with Checkpointer(store_path, create=False) as ckpt:
        want = ckpt.load(4)
    seen = {}

    class Spy(transformers.TrainerCallback):
        # Runs after the deltackpt callback, so it sees the restored state.
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            seen.update(model=copy.deepcopy(model.state_dict()), step=state.global_step,
                        optim=copy.deepcopy(optimizer.state_dict()["state"]))

    _, trainer, callback = train_hf(transformers, store_path, 8, resume=4, spy=Spy())
    assert callback.restored_step == 4 and seen["step"] == 4
    assert_same_state(seen["model"], want["model"])
    assert_same_state(seen["optim"], want["optim"]["0"]["state"])
    assert trainer.state.global_step == 8
    assert committed(store_path) == [2, 4, 6, 8]


# -- a job killed (kill -9) and restarted ---------------------------------------------------------


def killed_job(call: str, tmp_path) -> None:
    """Runs ``call`` (an expression over this module's functions) in a fresh interpreter that
    kills itself with SIGKILL inside it, leaving its lease and no close() behind."""
    here = Path(__file__).resolve()
    code = ("import importlib.util, sys\n"
            f"sys.path[:0] = [{str(here.parents[1])!r}]\n"
            f"spec = importlib.util.spec_from_file_location('job', {str(here)!r})\n"
            "job = importlib.util.module_from_spec(spec); spec.loader.exec_module(job)\n"
            f"job.{call}\n")
    # Run from elsewhere: the repository root holds a top-level ``datasets`` folder.
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, timeout=600)
    assert done.returncode == -signal.SIGKILL


def test_lightning_job_killed_and_restarted_goes_on_saving(store_path, tmp_path):
    pytest.importorskip("lightning.pytorch")
    module, trainer, _ = fit_lightning(tmp_path / "uninterrupted", 16)
    want = lightning_state(module, trainer)
    killed_job(f"fit_lightning({str(store_path)!r}, 16, kill_at=8)", tmp_path)
    assert committed(store_path) == [4, 8]
    module2, trainer2, callback2 = fit_lightning(store_path, 16, resume=True, seed=1)
    assert callback2.restored_step == 8
    assert committed(store_path) == [4, 8, 12, 16]
    assert_same_state(lightning_state(module2, trainer2), want)


def test_huggingface_job_killed_and_restarted_goes_on_saving(transformers, store_path, tmp_path):
    killed_job(f"train_hf(__import__('transformers'), {str(store_path)!r}, 8, kill_at=4)", tmp_path)
    assert committed(store_path) == [2, 4]
    _, trainer, callback = train_hf(transformers, store_path, 8, resume=True)
    assert callback.restored_step == 4 and trainer.state.global_step == 8
    assert committed(store_path) == [2, 4, 6, 8]
