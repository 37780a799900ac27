"""Bit-exact round trips over random sequences of sparse, dense and empty updates."""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_same_state, same_bits
from deltackpt import Checkpointer, EveryK

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]


def make_state(gen: torch.Generator) -> dict:
    state = {"step": 0, "lr": 0.1, "tables": {}, "dense": {}}
    for dt in DTYPES:
        name = str(dt).removeprefix("torch.")
        table = torch.randint(-100, 100, (37, 5), generator=gen).to(dt)
        dense = torch.randint(-100, 100, (301,), generator=gen).to(dt)
        if dt.is_floating_point:
            table = torch.randn(37, 5, generator=gen).to(dt)
            table[3, 1] = float("nan")
            table[4, 2] = -0.0
            dense = torch.randn(301, generator=gen).to(dt)
        state["tables"][name] = table
        state["dense"][name] = dense
    state["scalar"] = torch.tensor(1.5)
    return state


def apply(state: dict, op: tuple, gen: torch.Generator) -> None:
    kind, which, n = op
    name = str(DTYPES[which]).removeprefix("torch.")
    if kind == "rows":
        t = state["tables"][name]
        ids = torch.randint(0, t.shape[0], (n,), generator=gen)
        if t.dtype == torch.bool:
            t[ids] = ~t[ids]
        elif t.dtype.is_floating_point:
            new = torch.randn(n, t.shape[1], generator=gen).to(t.dtype)
            new[0, 0] = float("nan") if n % 2 else -0.0  # NaN payloads and signed zeros
            t[ids] = new
        else:
            t[ids] += 1
    elif kind == "dense":
        t = state["dense"][name]
        lo = int(torch.randint(0, t.numel(), (1,), generator=gen))
        if t.dtype == torch.bool:
            t[lo : lo + n] = ~t[lo : lo + n]
        else:
            t[lo : lo + n] = (t[lo : lo + n].double() * 2 + 1).to(t.dtype)
    elif kind == "scalar":
        state["scalar"] += 1
        state["lr"] = state["lr"] / 2
    # kind "none": nothing changes


ops = st.tuples(
    st.sampled_from(["rows", "dense", "scalar", "none"]),
    st.integers(0, len(DTYPES) - 1),
    st.integers(1, 12),
)
policies = st.sampled_from(
    [EveryK(every=1), EveryK(every=2), EveryK(every=5), EveryK(every=1000, max_delta_fraction=1.0),
     EveryK(every=1000, max_delta_fraction=0.05)]
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=st.lists(st.lists(ops, max_size=4), min_size=1, max_size=8), policy=policies,
       seed=st.integers(0, 2**31))
def test_every_step_restores_bit_exact(tmp_path_factory, seq, policy, seed):
    path = tmp_path_factory.mktemp("store")
    gen = torch.Generator().manual_seed(seed)
    state = make_state(gen)
    snapshots = {}
    # Small dense chunks, so dense deltas have several chunks to choose from.
    with Checkpointer(path, policy=policy, dense_chunk_bytes=64, chunk_bytes=256,
                      memory_budget=4096) as ckpt:
        for step, step_ops in enumerate(seq):
            for op in step_ops:
                apply(state, op, gen)
            state["step"] = step
            ckpt.save(step, state)
            snapshots[step] = copy.deepcopy(state)
    with Checkpointer(path) as fresh:
        assert fresh.steps() == sorted(snapshots)
        for step, want in snapshots.items():
            assert_same_state(fresh.load(step), want)
        target = make_state(torch.Generator().manual_seed(seed + 1))
        fresh.restore(target, step=len(seq) - 1)
        assert_same_state(target, snapshots[len(seq) - 1])


def test_unchanged_nan_row_is_not_dirty(store_path):
    t = torch.zeros(10, 4)
    t[2] = float("nan")
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, {"t": t})
        info = ckpt.save(1, {"t": t})
        assert (info.kind, info.rows_changed) == ("delta", 0)
        t[5, 0] = -0.0  # different bits from 0.0
        info = ckpt.save(2, {"t": t})
        assert info.rows_changed == 1
        assert same_bits(ckpt.load(2)["t"], t)
