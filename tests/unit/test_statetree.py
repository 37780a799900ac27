"""statetree: the one walk from a nested live state to flat keyed tensors and a JSON skeleton, and
back."""

from __future__ import annotations

import json

import pytest
import torch

from deltackpt import Shard, StateError
from deltackpt.statetree import build, flatten, held_bytes, key_part, merge, tensor_keys


def test_flatten_and_build_round_trip_every_kind_of_node():
    model = torch.nn.Linear(3, 2)
    state = {"model": model, "opt": {"lr": 0.5, "betas": (0.9, 0.99)}, "ids": [torch.arange(4), 7],
             "odd/key": torch.ones(2), "nan": float("nan")}
    flat = flatten(state)
    assert sorted(flat.tensors) == ["ids/0", "model/bias", "model/weight", "odd%2Fkey"]
    json.dumps(flat.tree, allow_nan=False)  # the skeleton is plain JSON
    assert sorted(tensor_keys(flat.tree)) == sorted(flat.tensors)
    back = build(flat.tree, {k: s.local for k, s in flat.tensors.items()})
    assert torch.equal(back["model"]["weight"], model.weight) and back["opt"]["betas"] == (0.9, 0.99)
    assert back["ids"][1] == 7 and torch.equal(back["ids"][0], torch.arange(4))
    assert back["nan"] != back["nan"]


def test_shards_keep_their_place_in_the_global_tensor():
    flat = flatten({"t": Shard(torch.zeros(2, 3), global_shape=(6, 3), global_offset=(4, 0))})
    s = flat.tensors["t"]
    assert s.global_shape == (6, 3) and s.global_offset == (4, 0)


def test_keys_escape_separators_and_collisions_are_refused():
    assert key_part("a/b%c") == "a%2Fb%25c"
    with pytest.raises(StateError):
        flatten({"x": object()})


def test_merge_takes_the_union_of_the_ranks_dicts():
    a = flatten({"t0": torch.zeros(1), "step": 1}).tree
    b = flatten({"t1": torch.zeros(1), "step": 1}).tree
    assert sorted(tensor_keys(merge([a, b]))) == ["t0", "t1"]


def test_every_walker_joins_keys_as_flatten_does(tmp_path):
    from deltackpt import Checkpointer, KeyMismatchError
    from deltackpt.hooks import _stateful
    from deltackpt.restore.files import write_step
    from deltackpt.statetree import child_key, walk

    model = torch.nn.Sequential(torch.nn.Embedding(8, 2))
    state = {"odd/a%b": {"model": model, "t": torch.zeros(4, 2)}, "runs": [{"w": torch.ones(3)}]}
    keys = sorted(flatten(state).tensors)
    assert keys == ["odd%2Fa%25b/model/0.weight", "odd%2Fa%25b/t", "runs/0/w"]
    assert child_key("odd%2Fa%25b", "model", "0.weight") == keys[0]
    paths = dict(walk(state))
    assert paths["odd%2Fa%25b/t"] is state["odd/a%b"]["t"] and paths["runs/0/w"] is state["runs"][0]["w"]
    assert [p for p, _ in _stateful(state)] == ["odd%2Fa%25b/model"]
    with Checkpointer(tmp_path / "store") as ckpt:
        ckpt.save(1, state)
        assert ckpt.track(model, prefix="odd%2Fa%25b/model").keys == (keys[0],)
        with pytest.raises(KeyMismatchError) as e:
            ckpt.restore({"odd/a%b": {"model": model}, "runs": [{"w": torch.ones(3)}]}, 1)
        assert e.value.missing == ["odd%2Fa%25b/t"]
        (out,) = write_step(ckpt, 1, str(tmp_path / "ranks"), world_size=1)
    assert sorted(torch.load(out, weights_only=True)["shards"]) == keys


def test_a_kept_node_and_shard_never_hide_a_change_of_view_dtype_key_type_or_value():
    # flatten keeps the shards and nodes of a state flattened the same; a tensor viewed anew in
    # place (transposed, retyped), a key of another type that compares equal, a new value: each
    # is seen.
    square, flat = torch.arange(9.0).reshape(3, 3), torch.zeros(4)
    state = {"sq": square, "v": flat, 1: torch.ones(2), "n": 3}
    first = flatten(state)
    same = flatten(state, reuse=first)
    assert same.tree is first.tree and same.reused == 3
    square.t_()  # the same object, storage, offset and shape: its strides change
    flat.data = flat.data.view(torch.int32)  # the same bytes as another dtype
    moved = flatten(state, reuse=same)
    assert moved.reused == 1 and moved.tree == same.tree
    assert moved.tensors["sq"].local.stride() == (1, 3) and moved.tensors["v"].local.dtype == torch.int32
    state["n"] = 4
    assert flatten(state, reuse=moved).tree != moved.tree
    with pytest.raises(StateError, match="keys must be str or int"):
        flatten({"sq": square, "v": flat, True: torch.ones(2), "n": 4}, reuse=moved)


def test_a_module_an_optimizer_and_lists_flatten_to_the_kept_state_again():
    # A module is flattened through its parameters and buffers themselves (state_dict's copies
    # are new objects at every call), an optimizer's state and param groups are kept, and a
    # list of the same values (ints past the cached ones, a float of the same bits) keeps its
    # node; a float of another sign, or an int for a float, does not.
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"model": model, "opt": opt, "ids": [1000, 2000, 0.5]}
    first = flatten(state)
    again = flatten(state, reuse=first)
    assert again.reused == len(again.tensors) == len(first.tensors) and again.tree is first.tree
    state["ids"] = [1000, 2000, -0.0]
    moved = flatten(state, reuse=again)
    assert moved.tree is not again.tree and moved.tree["dict"][0][1] is again.tree["dict"][0][1]  # the model kept
    state["ids"] = [1000, 2000.0, -0.0]
    retyped = flatten(state, reuse=moved)
    assert retyped.tree is not moved.tree and type(retyped.tree["dict"][2][1]["list"][1]["value"]) is float


def test_held_bytes_counts_each_tensor_of_a_model_and_its_optimizer_once():
    emb = torch.nn.Embedding(100, 8)
    model = torch.nn.Sequential(emb, torch.nn.BatchNorm1d(8))
    model.register_buffer("plan", torch.empty(1000, device="meta"))  # holds no memory
    tied = torch.nn.ModuleDict({"model": model, "again": emb})  # the same weight twice: counted once
    params = (100 * 8 + 2 * 8) * 4
    buffers = 2 * 8 * 4 + 8  # running mean and var, num_batches_tracked (int64)
    assert held_bytes(model) == held_bytes(tied) == params + buffers
    adam = torch.optim.Adam(model.parameters())
    assert held_bytes(model, adam) == params + buffers  # Adam makes its state at its first step
    model(torch.tensor([1, 2])).sum().backward()
    adam.step()
    assert held_bytes(model, adam) == 3 * params + buffers + 3 * 4  # two moments, a float step each
    assert held_bytes("not a module") == 0
