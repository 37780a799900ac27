"""statetree: the one walk from a nested live state to flat keyed tensors and a JSON skeleton, and
back."""

from __future__ import annotations

import json

import pytest
import torch

from deltackpt import Shard, StateError
from deltackpt.statetree import build, flatten, key_part, merge, tensor_keys


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
