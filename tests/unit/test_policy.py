"""Base-cadence policies, as the Checkpointer applies them."""

from __future__ import annotations

import tempfile

import pytest
import torch

from deltackpt import Checkpointer, QuantizationError, SettingError
from deltackpt.ops.gc import Retention
from deltackpt.policy import ChainLimit, ChainState, Differential, EveryK, Intermittent
from helpers import assert_same_state


def run(store_path, policy, saves: int = 8) -> list:
    table = torch.zeros(1000, 8)
    records = []
    with Checkpointer(store_path, policy=policy) as ckpt:
        for step in range(saves):
            table[step * 10 : step * 10 + 10] += 1
            ckpt.save(step, {"t": table})
        for step in range(saves):
            want = torch.zeros(1000, 8)
            for s in range(step + 1):
                want[s * 10 : s * 10 + 10] += 1
            assert_same_state(ckpt.load(step), {"t": want})
            records.append(ckpt.store.manifest(step))
    return records


def test_every_k(store_path):
    kinds = [m.kind for m in run(store_path, EveryK(every=3))]
    assert kinds == ["base", "delta", "delta", "base", "delta", "delta", "base", "delta"]


def test_differential_deltas_apply_to_the_base(store_path):
    records = run(store_path, Differential(EveryK(every=4)))
    assert [(m.kind, m.parent) for m in records] == [
        ("base", None), ("delta", 0), ("delta", 0), ("delta", 0),
        ("base", None), ("delta", 4), ("delta", 4), ("delta", 4)]
    # each differential delta holds every row changed since the base
    assert [m.tensors["t"].changed for m in records[1:4]] == [10, 20, 30]
    assert records[3].policy["reason"].endswith("(relative to the base)")


def test_intermittent(store_path):
    # Each delta is ~10 rows x 40 B; the base ~32 KB: a new base once deltas reach 3% of it.
    records = run(store_path, Intermittent(0.03))
    assert [m.kind for m in records] == ["base", "delta", "base", "delta", "base", "delta", "base", "delta"]
    assert "of the" in records[2].policy["reason"]


def test_chain_limit(store_path):
    records = run(store_path, ChainLimit(2))
    assert [m.chain_length for m in records] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert records[3].policy == {"name": "chain_limit", "decision": "base",
                                 "reason": "the chain holds 2 deltas, the bound is 2"}


@pytest.mark.parametrize("make", [lambda: EveryK(every=0), lambda: Intermittent(0),
                                  lambda: ChainLimit(-1), lambda: EveryK(max_delta_fraction=2),
                                  lambda: Retention(keep_last=0), lambda: Retention(keep_every=1.5),
                                  lambda: Differential(None), lambda: ChainLimit(2, inner="every_k"),
                                  lambda: Checkpointer(tempfile.mkdtemp(), policy=10),
                                  lambda: Checkpointer(tempfile.mkdtemp(), memory_budget=1e9),
                                  lambda: Checkpointer(tempfile.mkdtemp(), timeout=5.0),
                                  lambda: Checkpointer(tempfile.mkdtemp(), process_group="gloo"),
                                  lambda: Checkpointer(tempfile.mkdtemp(), quantize=["t"])])
def test_bad_settings(make):
    # Refused where they are made: a policy that is none failed at the first delta with an
    # AttributeError, a float budget at the first save with a TypeError, the others with torch's
    # or dict's ValueError.
    with pytest.raises((SettingError, QuantizationError)):
        make()


def test_decisions():
    assert EveryK(every=5).decide(ChainState(1, 0, 100), 60, 100).kind == "base"
    assert EveryK(every=5).decide(ChainState(1, 0, 100), 40, 100).kind == "delta"
