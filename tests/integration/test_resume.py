"""A run restored at step M and trained to N matches the uninterrupted run to N bit for bit:
weights, optimizer state, step and RNG (deterministic CPU training, same world size)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from helpers import assert_same_state

from deltackpt import Checkpointer, EveryK
from deltackpt.datasets import CriteoConfig, TokenStreamConfig
from deltackpt.examples import (
    GPTMoEConfig,
    TrainState,
    deterministic,
    dlrm_run,
    gpt_run,
    train,
)
from deltackpt.hooks import CheckpointHook
from deltackpt.save.pending import SaveHandle
import lease_procs

# Train 8 steps saving every 2, a base every 4 saves whatever a delta costs (so the chain of
# step 6 is the base at 2 and deltas at 4 and 6), restore 6.
N, K, M = 8, 2, 6

Run = Callable[[int], tuple[TrainState, Callable[[int], torch.Tensor]]]


def snapshot(state: TrainState) -> dict:
    """Copies of everything a resumed run must reproduce, optimizer state included."""
    return {
        "model": copy.deepcopy(state.model.state_dict()),
        "optim": {k: copy.deepcopy(o.state_dict()) for k, o in state.optimizers.items()},
        "step": state.step,
        "rng": torch.get_rng_state(),
    }


class RecordingHook(CheckpointHook):
    """Records the kind of every save (saved in the background: known once committed)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saves: dict[int, SaveHandle] = {}

    def on_step_end(self, step):
        out = super().on_step_end(step)
        if out is not None:
            assert isinstance(out, SaveHandle)  # the hook saves in the background by default
            self.saves[step] = out
        return out

    @property
    def kinds(self) -> dict[int, str]:
        return {step: handle.result().kind for step, handle in self.saves.items()}


def uninterrupted(make: Run, path) -> tuple[dict, dict]:
    """Trains 0 -> N saving every K; returns the snapshots at M and at N."""
    with deterministic(0):
        state, loss = make(0)
        policy = EveryK(4, max_delta_fraction=1.0)
        with Checkpointer(path, policy=policy) as ckpt, RecordingHook(ckpt, state, every=K) as hook:
            train(state, loss, M, hook=hook)
            at_m = snapshot(state)
            train(state, loss, N, hook=hook)
        assert sorted(hook.kinds) == list(range(K, N + 1, K))
        assert hook.kinds[M] == "delta", hook.kinds
        return at_m, snapshot(state)


def resumed(make: Run, path, *, reseed: bool = False) -> tuple[dict, dict]:
    """A fresh process's view: a model built from another seed, restored at M, trained to N."""
    with deterministic(1):
        state, loss = make(1)
        with Checkpointer(path, create=False) as ckpt, CheckpointHook(ckpt, state, every=K) as hook:
            assert hook.restore(M) == M
            at_m = snapshot(state)
            if reseed:
                torch.manual_seed(1)
            train(state, loss, N, hook=hook)
        return at_m, snapshot(state)


def check_resume(make: Run, path, *, negative_control: bool = False) -> None:
    want_m, want_n = uninterrupted(make, path)
    got_m, got_n = resumed(make, path)
    assert_same_state(got_m, want_m, "at M")
    assert_same_state(got_n, want_n, "at N")
    if negative_control:
        # Dropout draws from the RNG, so a resumed run that does not restore it differs: the
        # comparison is sharp enough to see that.
        _, reseeded = resumed(make, path, reseed=True)
        with pytest.raises(AssertionError):
            assert_same_state(reseeded["model"], want_n["model"])


DATA = CriteoConfig(scale=0.0001, batch_size=64, seed=3)
TOKENS = TokenStreamConfig(vocab_size=256, seq_len=16, batch_size=4, seed=5)
GPT = GPTMoEConfig(vocab_size=256, seq_len=16, dim=16, num_heads=2, num_layers=2, num_experts=6,
                   top_k=2, expert_hidden=16, dropout=0.1)


@pytest.mark.parametrize("sparse", ["sgd", "adagrad", "sparse_adam"])
def test_dlrm_resume_is_bit_exact(store_path, sparse):
    def make(seed: int):
        return dlrm_run(DATA, sparse_optimizer=sparse, seed=seed, embedding_dim=8,
                        bottom_mlp=(16, 8), top_mlp=(16,))

    check_resume(make, store_path)


@pytest.mark.parametrize("trainable_blocks", [None, 1], ids=["full", "finetune"])
def test_gpt_moe_resume_is_bit_exact(store_path, trainable_blocks):
    def make(seed: int):
        return gpt_run(TOKENS, GPT, trainable_blocks=trainable_blocks, seed=seed)

    check_resume(make, store_path, negative_control=trainable_blocks is None)


def test_hook_job_killed_and_restarted_goes_on_saving(store_path, tmp_path):
    shapes = {"sparse_optimizer": "adagrad", "embedding_dim": 8, "bottom_mlp": (16, 8), "top_mlp": (16,)}

    def make(seed: int):
        return dlrm_run(DATA, seed=seed, **shapes)

    _, want_n = uninterrupted(make, tmp_path / "uninterrupted")
    job = lease_procs.context().Process(target=lease_procs.hook_job_killed,
                                        args=(str(store_path), M, K, DATA, shapes))
    job.start()
    job.join(300)
    assert job.exitcode == -9  # killed: its lease is left behind, never released
    with deterministic(1):  # the restarted job: no take_over, no manual step
        state, loss = make(1)
        with CheckpointHook(str(store_path), state, every=K) as hook:
            assert hook.restore() == M
            train(state, loss, N, hook=hook)
            hook.checkpointer.wait()
            assert hook.checkpointer.steps() == list(range(K, N + 1, K))
    assert_same_state(snapshot(state), want_n)
