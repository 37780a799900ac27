"""Strict restore, step rules and the delta after a restore."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deltackpt.io.reader as reader_module
import deltackpt.statetree as statetree
from deltackpt import (
    Checkpointer,
    DtypeMismatchError,
    KeyMismatchError,
    SettingError,
    ShapeMismatchError,
    StateError,
    StepExistsError,
    StepNotFoundError,
)
from helpers import assert_same_state, same_bits
from hostile import read_record, write_record


def model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(50, 4), nn.Linear(4, 2))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    return model, opt


def train(model, opt, steps: int) -> None:
    for i in range(steps):
        opt.zero_grad()
        model(torch.tensor([i % 50, (7 * i) % 50])).sum().backward()
        opt.step()


def test_restore_into_fresh_module_and_optimizer_then_delta(store_path):
    model, opt = model_and_opt(0)
    train(model, opt, 3)
    state = {"model": model, "optim": opt, "epoch": 1, "rng": torch.get_rng_state()}
    with Checkpointer(store_path) as ckpt:
        ckpt.save(3, state)
        train(model, opt, 2)
        ckpt.save(5, state)
    model2, opt2 = model_and_opt(1)
    state2 = {"model": model2, "optim": opt2, "epoch": 0, "rng": torch.zeros_like(state["rng"])}
    with Checkpointer(store_path) as ckpt:
        assert ckpt.restore(state2) == 5
        assert state2["epoch"] == 1
        assert_same_state(model2.state_dict(), model.state_dict())
        assert_same_state(opt2.state_dict(), opt.state_dict())
        train(model2, opt2, 1)
        train(model, opt, 1)
        info = ckpt.save(6, state2)
        assert info.kind == "delta"  # a restarted job is not forced into a full base
        assert info.rows_changed < 10
    with Checkpointer(store_path) as ckpt:
        assert_same_state(ckpt.load(6), {"model": model.state_dict(), "optim": opt.state_dict(),
                                         "epoch": 1, "rng": state["rng"]})


def test_key_mismatch_names_both_sides(store_path):
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, {"a": torch.zeros(3), "b": {"c": torch.zeros(2)}})
        target = {"a": torch.ones(3), "b": {"d": torch.zeros(2)}, "e": 1}
        with pytest.raises(KeyMismatchError) as err:
            ckpt.restore(target)
        assert err.value.missing == ["b/c"] and sorted(err.value.unexpected) == ["b/d", "e"]
        assert "b/c" in str(err.value) and "b/d" in str(err.value)
        assert target["a"].eq(1).all()  # nothing changed


def test_dtype_and_shape_mismatch(store_path):
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, {"w": torch.zeros(4, 2)})
        with pytest.raises(DtypeMismatchError, match=r"w: target dtype torch.bfloat16 != saved torch.float32"):
            ckpt.restore({"w": torch.zeros(4, 2, dtype=torch.bfloat16)})
        with pytest.raises(ShapeMismatchError, match=r"w: target shape \(4, 3\) != saved \(4, 2\)"):
            ckpt.restore({"w": torch.zeros(4, 3)})
        with pytest.raises(StateError, match="the target is a dict"):
            ckpt.restore({"w": {"x": torch.zeros(1)}})


def test_module_key_mismatch(store_path):
    model, _ = model_and_opt(0)
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, {"model": model})
        with pytest.raises(KeyMismatchError, match="model/2.weight"):
            ckpt.restore({"model": nn.Sequential(nn.Embedding(50, 4), nn.Linear(4, 2), nn.Linear(2, 2))})


def test_an_optimizer_of_other_parameter_groups_is_refused_before_anything_changes(store_path):
    model, opt = model_and_opt(0)
    train(model, opt, 2)
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, {"model": model, "optim": opt})
    model2, _ = model_and_opt(1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    split = torch.optim.Adagrad([{"params": model2[0].parameters()}, {"params": model2[1].parameters()}])
    with Checkpointer(store_path) as ckpt:
        with pytest.raises(StateError, match=r"optim: the optimizer's parameter groups hold \[1, 2\] "
                                             r"parameters, the checkpoint's \[3\]"):
            ckpt.restore({"model": model2, "optim": split})
    assert_same_state(model2.state_dict(), before)


def test_a_saved_optimizer_state_torch_refuses_is_a_state_error(store_path):
    """A record whose optimizer skeleton lacks 'state' (a key renamed in its tree) is refused by
    name, not by torch's KeyError from deep inside load_state_dict; and whatever an object's
    load_state_dict refuses is a StateError naming it."""
    model, opt = model_and_opt(0)
    train(model, opt, 1)
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, {"model": model, "optim": opt})
    doc = read_record(store_path, 0)
    fields = dict(doc["tree"]["dict"])["optim"]["dict"]
    assert fields[0][0] == "state"
    fields[0][0] = "stbte"
    write_record(store_path, 0, doc)
    with Checkpointer(store_path, create=False) as ckpt:
        model2, opt2 = model_and_opt(1)
        with pytest.raises(StateError, match="optim: the target is an optimizer, the checkpoint holds no"):
            ckpt.restore({"model": model2, "optim": opt2})

    class Picky:
        def state_dict(self):
            return {"n": 1}

        def load_state_dict(self, state):
            raise ValueError(f"n must be 2, got {state['n']}")

    with Checkpointer(store_path) as ckpt:
        ckpt.save(1, {"picky": Picky()})
        refused = r"picky: Picky.load_state_dict refused the saved state \(ValueError: n must be 2, got 1\)"
        with pytest.raises(StateError, match=refused):
            ckpt.restore({"picky": Picky()}, 1)


def test_saving_a_committed_step_fails_and_changes_nothing(store_path):
    w = torch.arange(6.0).reshape(3, 2)
    with Checkpointer(store_path) as ckpt:
        ckpt.save(1, {"w": w})
        ckpt.save(2, {"w": w + 1})
        with pytest.raises(StepExistsError, match="step 2 is committed already"):
            ckpt.save(2, {"w": w * 0})
        with pytest.raises(StepExistsError, match="not after the latest committed step 2"):
            ckpt.save(0, {"w": w * 0})
        assert ckpt.steps() == [1, 2]
        assert same_bits(ckpt.load(2)["w"], w + 1)
        assert ckpt.save(3, {"w": w + 1}).kind == "delta"


def test_unknown_step(store_path):
    with Checkpointer(store_path) as ckpt:
        with pytest.raises(StepNotFoundError, match="committed steps: none"):
            ckpt.load()
        ckpt.save(4, {"x": torch.zeros(1)})
        with pytest.raises(StepNotFoundError, match="step 9 is not committed; committed steps: 4"):
            ckpt.load(9)


@pytest.mark.parametrize("bad", [object(), {1.5: 2}, torch.zeros(3).to_sparse()])
def test_unsupported_values(store_path, bad):
    with Checkpointer(store_path) as ckpt, pytest.raises(StateError):
        ckpt.save(0, {"x": bad})


def test_constructor_validation(store_path):
    with pytest.raises(SettingError, match="chunk_bytes must be a positive int, got 0"):
        Checkpointer(store_path, chunk_bytes=0)
    with pytest.raises(SettingError, match="memory_budget"):
        Checkpointer(store_path, chunk_bytes=1 << 20, memory_budget=1 << 20)
    with pytest.raises(SettingError, match=r"coordinator_rank must be in \[0, 1\), got 1"):
        Checkpointer(store_path, coordinator_rank=1)


def test_a_restore_that_fails_part_way_makes_the_next_save_a_base(store_path, monkeypatch):
    """A read that fails leaves part of the step in the state, in rows no mark names and no
    reference describes: the next save is a base, exact; a restore that succeeds later allows
    deltas again."""
    gen = torch.Generator().manual_seed(0)
    state = {"emb": torch.randn(4000, 16, generator=gen), "dense": torch.randn(300, 64, generator=gen)}
    with Checkpointer(store_path, chunk_bytes=16 << 10, memory_budget=128 << 10, base_every=1000) as ckpt:
        ckpt.save(1, state)
        state["emb"][::7] += 1
        ckpt.mark("emb", torch.arange(0, 4000, 7))
        assert ckpt.save(2, state).kind == "delta"
        at_step_2 = {k: v.clone() for k, v in state.items()}
        real, calls = reader_module.ChainReader.fetch, []

        def failing_part_way(self, *args, **kwargs):
            calls.append(None)
            if len(calls) > 10:  # of the 21 chunks
                raise RuntimeError("the read failed")
            return real(self, *args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(reader_module.ChainReader, "fetch", failing_part_way)
            with pytest.raises(RuntimeError, match="the read failed"):
                ckpt.restore(state, step=1)
        assert not all(torch.equal(state[k], at_step_2[k]) for k in state)  # part of step 1 landed
        state["emb"][5] += 3
        ckpt.mark("emb", torch.tensor([5]))
        info = ckpt.save(3, state)
        assert info.kind == "base" and "restore failed" in info.reason
        assert_same_state(ckpt.load(3), state)
        ckpt.restore(state, step=2)
        state["emb"][6] += 3
        ckpt.mark("emb", torch.tensor([6]))
        assert ckpt.save(4, state).kind == "delta"
        assert_same_state(ckpt.load(4), state)


def test_a_restore_flattens_the_state_again_only_where_a_load_replaced_its_tensors(tmp_path, monkeypatch):
    # A flatten of 20,000 tiny tensors took ~0.2 s: a state of tensors alone keeps its tensors
    # through the restore; an optimizer's load replaces them, so that state is flattened again.
    model, opt = model_and_opt(0)
    train(model, opt, 3)
    plain = {"t": torch.randn(4096, 64), "u": torch.randn(300)}
    states = {"plain": plain, "optimizer": {"model": model, "optim": opt}}
    for name, state in states.items():
        with Checkpointer(tmp_path / name) as ckpt:
            ckpt.save(1, state)
    saved = {"plain": {k: v.clone() for k, v in plain.items()},
             "optimizer": {"model": {k: v.clone() for k, v in model.state_dict().items()}}}
    real, calls = statetree.flatten, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(statetree, "flatten", counted)
    flattened = {}
    for name, state in states.items():
        (plain["t"] if name == "plain" else model[0].weight.data).add_(1)  # undone by the restore
        with Checkpointer(tmp_path / name) as ckpt:
            calls.clear()
            ckpt.restore(state)
            flattened[name] = len(calls)
            info = ckpt.save(2, state)
        assert info.kind == "delta" and info.bytes_written == 0  # the tracker holds the restored values
    assert flattened["optimizer"] == flattened["plain"] + 1
    assert all(same_bits(plain[k], v) for k, v in saved["plain"].items())
    assert all(same_bits(model.state_dict()[k], v) for k, v in saved["optimizer"]["model"].items())
