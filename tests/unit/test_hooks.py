"""CheckpointHook: saves on the schedule, attaches row tracking by itself, marks sparse gradients
the embedding hooks cannot see, restores, and closes what it opened."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deltackpt import Checkpointer, SaveHandle, SaveInfo, SettingError, StateError, StepNotFoundError
from deltackpt.datasets import CriteoConfig
from deltackpt.examples import TrainState, deterministic, dlrm_run, train
from deltackpt.hooks import CheckpointHook, HookClosedError
from helpers import assert_same_state

DATA = CriteoConfig(scale=0.0001, batch_size=32)


def small_dlrm(sparse: str = "adagrad"):
    return dlrm_run(DATA, sparse_optimizer=sparse, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8,))


class Spy:
    """Wraps a method and records the arguments of every call."""

    def __init__(self, method):
        self.method = method
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.method(*args, **kwargs)


@pytest.mark.parametrize("blocking", [None, True], ids=["default", "blocking"])
def test_saves_on_the_schedule(store_path, blocking):
    state = {"w": torch.zeros(4, 2), "step": 0}
    flag = {} if blocking is None else {"blocking": blocking}
    with CheckpointHook(store_path, state, every=3, **flag) as hook:
        saved = []
        for step in range(1, 11):
            state["step"] = step
            info = hook.on_step_end(step)
            if info is not None:
                # In the background by default: a handle; blocking, what was written.
                assert isinstance(info, SaveInfo if blocking else SaveHandle), info
                saved.append((step, info.step))
        assert saved == [(3, 3), (6, 6), (9, 9)]
        hook.checkpointer.wait()  # saves commit in the background
        assert hook.checkpointer.steps() == [3, 6, 9]
        assert hook.save(10).step == 10  # off the schedule
        assert hook.checkpointer.load(6)["step"] == 6


def test_attaches_row_tracking_with_the_table_optimizer(store_path):
    state, loss = small_dlrm("adagrad")
    ckpt = Checkpointer(store_path)
    ckpt.track = spy = Spy(ckpt.track)
    with ckpt, CheckpointHook(ckpt, state, every=2) as hook:
        (args, kwargs), = spy.calls
        assert args == (state.model,)
        assert kwargs["prefix"] == "model"
        assert kwargs["optimizer"] is state.optimizers["sparse"]
        assert kwargs["optimizer_prefix"] == "optim/sparse"
        assert hook.tracked_keys == tuple(f"model/embeddings.{i}.weight" for i in range(26))
        with deterministic(0):
            train(state, loss, 4, hook=hook)
        ckpt.wait()
        assert ckpt.steps() == [2, 4]


def test_model_found_anywhere_in_the_state(store_path):
    model = nn.Sequential(nn.Embedding(10, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"run": {"nets": [model]}, "opts": {"a/b": opt}}
    with CheckpointHook(store_path, state, every=1, model=model, blocking=True) as hook:
        assert hook.tracked_keys == ("run/nets/0/0.weight",)
        model(torch.tensor([1, 2])).sum().backward()
        opt.step()
        assert hook.on_step_end(1).kind == "base"


class FunctionalTable(nn.Module):
    """A table looked up with F.embedding: no nn.Embedding for the forward hooks to see."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(50, 3))

    def forward(self, ids):
        return F.embedding(ids, self.table, sparse=True)


def test_before_optimizer_step_marks_sparse_gradients_the_hooks_miss(store_path):
    model = nn.ModuleDict({"custom": FunctionalTable(), "bag": nn.EmbeddingBag(20, 3, sparse=True)})
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    state = TrainState(model, {"sgd": opt})
    ckpt = Checkpointer(store_path)
    ckpt.mark = spy = Spy(ckpt.mark)
    with ckpt, CheckpointHook(ckpt, state, every=1, blocking=True) as hook:
        assert hook.tracked_keys == ("model/bag.weight",)
        hook.on_step_end(0)
        opt.zero_grad(set_to_none=True)
        ids = torch.tensor([4, 9, 4])
        loss = model["custom"](ids).sum() + model["bag"](torch.tensor([[1, 2]])).sum()
        loss.backward()
        hook.before_optimizer_step()
        opt.step()
        (key, marked), = [call[0] for call in spy.calls]
        assert key == "model/custom.table"
        assert sorted(set(marked.tolist())) == [4, 9]
        info = hook.on_step_end(1)
        assert info.kind == "delta"
        # 2 rows of the custom table, 2 of the bag (marked by its forward hook).
        assert info.rows_changed == 4


def test_restore_returns_the_step(store_path):
    state = {"w": torch.zeros(3), "step": 0}
    with CheckpointHook(store_path, state, every=1) as hook:
        assert hook.restore() is None  # nothing committed: a fresh start
        for step in (1, 2, 3):
            state["w"] += 1
            state["step"] = step
            hook.on_step_end(step)
        assert hook.restore() == 3
        assert hook.restore(2) == 2
        assert_same_state(state, {"w": torch.full((3,), 2.0), "step": 2})
        with pytest.raises(StepNotFoundError):
            hook.restore(7)


def test_committed_steps_are_not_saved_again(store_path, caplog):
    state = {"w": torch.zeros(3), "step": 0}
    with CheckpointHook(store_path, state, every=1, blocking=True) as hook:
        for step in (1, 2):
            state["step"] = step
            hook.on_step_end(step)
        hook.restore(1)
        with caplog.at_level(logging.WARNING, logger="deltackpt.hooks"):
            assert hook.on_step_end(2) is None
        assert "step 2 is committed already" in caplog.text
        assert hook.on_step_end(3).kind == "delta"  # against step 1, the step restored
        assert hook.checkpointer.steps() == [1, 2, 3]


def test_close_removes_tracking_and_closes_only_what_it_opened(store_path, tmp_path):
    state, _ = small_dlrm()
    hook = CheckpointHook(store_path, state, every=1)
    bag = state.model.embeddings[0]
    assert len(bag._forward_hooks) == 1
    hook.checkpointer.close = spy = Spy(hook.checkpointer.close)
    hook.close()
    hook.close()  # idempotent
    assert hook.closed and len(bag._forward_hooks) == 0 and len(spy.calls) == 1
    for call in (hook.before_optimizer_step, lambda: hook.on_step_end(1), hook.restore):
        with pytest.raises(HookClosedError):
            call()

    mine = Checkpointer(tmp_path / "mine")
    mine.close = spy = Spy(mine.close)
    with CheckpointHook(mine, {"w": torch.zeros(1)}, every=1):
        pass
    assert spy.calls == []
    mine.close()


def test_bad_arguments(store_path):
    with pytest.raises(SettingError, match="every must be a positive int, got 0"):
        CheckpointHook(store_path, {}, every=0)
    with pytest.raises(StateError, match="mutable mapping, got list"):
        CheckpointHook(store_path, [], every=1)
    with pytest.raises(StateError, match="is not in the state"):
        CheckpointHook(store_path, {"w": torch.zeros(1)}, every=1, model=nn.Linear(1, 1))
    with CheckpointHook(store_path, {}, every=1) as hook:
        with pytest.raises(SettingError, match="non-negative int, got -1"):
            hook.on_step_end(-1)
