"""GC never deletes what a retained step needs: random histories, compactions and retention."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pytest

from deltackpt import Checkpointer, SettingError
from deltackpt.ops.gc import Retention
from helpers import assert_same_state

events = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.integers(0, 5)),  # rows changed
        st.tuples(st.just("compact"), st.integers(0, 100)),  # which step, as a fraction
        st.tuples(st.just("orphan"), st.just(0)),  # a save that died before its commit
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=events, keep_last=st.integers(1, 4), keep_every=st.none() | st.integers(2, 4),
       every=st.integers(1, 5), seed=st.integers(0, 1000))
def test_gc_keeps_every_retained_step(tmp_path_factory, history, keep_last, keep_every, every, seed):
    path = tmp_path_factory.mktemp("store")
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(50, 4, generator=gen)
    saved: dict[int, torch.Tensor] = {}
    with Checkpointer(path, base_every=every) as ckpt:
        for kind, n in history:
            if kind == "save":
                table[torch.randint(0, 50, (n,), generator=gen)] += 1
                step = len(saved)
                ckpt.save(step, {"t": table})
                saved[step] = table.clone()
            elif kind == "compact" and saved:
                steps = sorted(saved)
                ckpt.compact(steps[n * (len(steps) - 1) // 100])
            elif kind == "orphan":
                os.makedirs(os.path.join(path, "steps", f"999-dead{len(os.listdir(path / 'steps'))}", "t"))
        retention = Retention(keep_last=keep_last, keep_every=keep_every)
        report = ckpt.gc(retention, grace_seconds=0)
        retained = retention.retained(sorted(saved))
        assert set(ckpt.steps()) >= retained
        assert not set(report.dropped_steps) & retained
    with Checkpointer(path, create=False) as fresh:
        for step in retained:
            assert_same_state(fresh.load(step), {"t": saved[step]})
        assert fresh.verify().ok
        # What is left is exactly what the remaining records refer to.
        referenced = {fresh.store.manifest(s).attempt for s in fresh.steps()}
        referenced |= {fresh.store.compacted(s).attempt for s in fresh.store.compacted_steps()}
        on_disk = set(os.listdir(path / "steps")) - {"zarr.json"}
        assert on_disk <= referenced
        # and every record left is needed by a retained step
        needed = {(m.compacts is not None, m.step) for s in retained for m in fresh.store.chain(s)}
        left = {(False, s) for s in fresh.steps()} | {(True, s) for s in fresh.store.compacted_steps()}
        assert left <= needed | {(False, s) for s in retained}


@pytest.mark.parametrize("grace", [-1, -0.5, float("nan"), float("inf"), float("-inf"), "10", True])
def test_grace_must_be_a_finite_non_negative_number(store_path, grace):
    with Checkpointer(store_path) as ckpt:
        ckpt.save(1, {"t": torch.zeros(3)})
        with pytest.raises(SettingError, match=f"grace_seconds must be a finite number >= 0, got {grace!r}"):
            ckpt.gc(Retention(keep_last=1), grace_seconds=grace)
        assert ckpt.steps() == [1]
