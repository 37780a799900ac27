"""The example models change only what the delta mechanisms expect: looked-up embedding rows,
routed experts, unfrozen layers."""

from __future__ import annotations

import pytest
import torch

from deltackpt import Checkpointer, EveryK, SettingError
from deltackpt.datasets import CriteoConfig, CriteoStream, TokenStreamConfig
from deltackpt.examples import (
    DLRM,
    SPARSE_OPTIMIZERS,
    DLRMConfig,
    GPTMoEConfig,
    RngState,
    deterministic,
    dlrm_loss,
    dlrm_optimizers,
    gpt_run,
    train,
)
from helpers import same_bits

DATA = CriteoConfig(scale=0.0001, batch_size=16)


@pytest.mark.parametrize("sparse", SPARSE_OPTIMIZERS)
def test_dlrm_changes_only_looked_up_rows(sparse):
    with deterministic(0):
        model = DLRM(DLRMConfig.for_criteo(DATA, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8,)))
        opts = dlrm_optimizers(model, sparse=sparse)
        batch = CriteoStream(DATA).batch(0)
        before = [bag.weight.detach().clone() for bag in model.embeddings]
        dlrm_loss(model, batch).backward()
        assert all(bag.weight.grad.is_sparse for bag in model.embeddings)
        for opt in opts.values():
            opt.step()
    for t, bag in enumerate(model.embeddings):
        changed = (bag.weight.detach() != before[t]).any(dim=1).nonzero().flatten()
        looked_up = batch.indices[t].unique()
        assert set(changed.tolist()) <= set(looked_up.tolist()), f"table {t}"
    assert any(not same_bits(bag.weight.detach(), b) for bag, b in zip(model.embeddings, before))


def test_dlrm_config_errors():
    with pytest.raises(SettingError, match=r"bottom_mlp must end in embedding_dim \(16\).*\(8,\)"):
        DLRMConfig(table_sizes=(5,), bottom_mlp=(8,))
    with pytest.raises(SettingError, match=r"table_sizes must be positive ints, got \(5, 0\)"):
        DLRMConfig(table_sizes=(5, 0))
    with pytest.raises(SettingError, match="sparse must be one of"):
        dlrm_optimizers(DLRM(DLRMConfig(table_sizes=(5,), bottom_mlp=(16,))), sparse="adam")


TOKENS = TokenStreamConfig(vocab_size=128, seq_len=8, batch_size=1, seed=1)


def test_unrouted_experts_stay_bit_identical_under_adam():
    # 8 tokens, top-1 of 12 experts: at least 4 experts get no token in every step.
    config = GPTMoEConfig(vocab_size=128, seq_len=8, num_layers=1, num_experts=12, top_k=1)
    with deterministic(0):
        state, loss = gpt_run(TOKENS, config)
        moe = state.model.blocks[0].moe
        adam = state.optimizers["dense"]
        skipped_with_momentum = 0
        for step in range(8):
            before = [[p.detach().clone() for p in e.parameters()] for e in moe.experts]
            had_state = [e.fc1.weight in adam.state for e in moe.experts]
            train(state, loss, step + 1)
            for e, expert in enumerate(moe.experts):
                if moe.tokens_per_expert[e] == 0:
                    assert all(p.grad is None for p in expert.parameters())
                    after = [p.detach() for p in expert.parameters()]
                    assert all(same_bits(a, b) for a, b in zip(after, before[e]))
                    skipped_with_momentum += had_state[e]
    assert skipped_with_momentum > 0  # Adam held momentum for an expert it then left alone


def test_finetuning_leaves_frozen_layers_alone_and_deltas_small(store_path):
    config = GPTMoEConfig(vocab_size=128, seq_len=8, num_layers=6, num_experts=4)
    with deterministic(0):
        state, loss = gpt_run(TOKENS, config, trainable_blocks=1)
        frozen = {k: v.clone() for k, v in state.model.state_dict().items()
                  if not k.startswith(("blocks.5.", "ln_f."))}
        with Checkpointer(store_path, policy=EveryK(10)) as ckpt:
            # Adam creates its state at a parameter's first step: save after that, so the
            # second save has the same tensors and can be a delta.
            train(state, loss, 2)
            base = ckpt.save(2, state)
            train(state, loss, 5)
            delta = ckpt.save(5, state)
    assert all(same_bits(state.model.state_dict()[k], v) for k, v in frozen.items())
    assert delta.kind == "delta" and delta.bytes_written < 0.5 * base.bytes_written, (base, delta)


def test_freeze_and_stream_errors():
    config = GPTMoEConfig(vocab_size=128, seq_len=8, num_layers=2)
    with pytest.raises(SettingError, match=r"trainable_blocks must be an int in \[0, 2\], got 3"):
        gpt_run(TOKENS, config, trainable_blocks=3)
    with pytest.raises(SettingError, match="does not fit the model"):
        gpt_run(TokenStreamConfig(vocab_size=500, seq_len=8), config)
    with pytest.raises(SettingError, match=r"num_heads \(3\) must divide dim"):
        GPTMoEConfig(num_heads=3)


def test_deterministic_restores_the_global_settings():
    threads = torch.get_num_threads()
    with deterministic(0, threads=1):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.get_num_threads() == 1
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == threads


def test_rng_state_round_trips_through_a_checkpoint(store_path):
    with Checkpointer(store_path) as ckpt:
        torch.manual_seed(7)
        ckpt.save(1, {"rng": RngState()})
        want = torch.rand(5)
        torch.manual_seed(8)
        ckpt.restore({"rng": RngState()}, 1)
        assert same_bits(torch.rand(5), want)
