"""Copies of a training state to check a restore against, bit for bit."""

from __future__ import annotations

import json
from typing import Any

import torch

from .. import statetree

Snapshot = tuple[dict[str, torch.Tensor], dict[str, Any]]
"""Copies of a state's tensors by flat key, and its JSON skeleton (step, learning rates...)."""


def snapshot(state: Any, *, copy: bool = True) -> Snapshot:
    """The state's tensors by flat key (copies, or views of the live tensors) and skeleton."""
    flat = statetree.flatten(state)
    tensors = {k: s.local.clone() if copy else s.local for k, s in flat.tensors.items()}
    return tensors, plain(flat.tree)


def plain(tree: Any) -> Any:
    """``tree`` as JSON reads it back (tuples as lists, keys as str)."""
    return json.loads(json.dumps(tree))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (NaN payloads and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def differences(got: Snapshot, want: Snapshot) -> list[str]:
    """Flat keys whose bits differ, keys on one side only, and ``<skeleton>`` if plain values
    (step, hyper-parameters) differ."""
    keys = sorted(set(got[0]) | set(want[0]))
    bad = [k for k in keys
           if k not in got[0] or k not in want[0] or not same_bits(got[0][k], want[0][k])]
    return bad + (["<skeleton>"] if got[1] != want[1] else [])
