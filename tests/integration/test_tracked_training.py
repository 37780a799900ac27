"""Training with tracked embeddings: every step saved with marks restores bit-exactly (optimizer
state included), writes what a hash-only checkpointer writes, survives weight decay through the
canary, and carries a failed save's rows into the next save."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from deltackpt import Canary, Checkpointer, EveryK, LocalStorage, StoreError
from helpers import assert_same_state

ROWS = 400
DIM = 8


class Model(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=sparse)
        self.emb = nn.Embedding(ROWS, DIM, sparse=sparse)
        self.top = nn.Linear(2 * DIM, 1)

    def forward(self, flat, offsets, tokens):
        return self.top(torch.cat([self.bag(flat, offsets), self.emb(tokens).sum(1)], 1)).sum()


def build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = Model(sparse=kind != "adamw")
    tables = [model.bag.weight, model.emb.weight]
    opt = {
        "sgd": lambda: torch.optim.SGD(tables, lr=0.5),
        "adagrad": lambda: torch.optim.Adagrad(tables, lr=0.5),
        "sparse_adam": lambda: torch.optim.SparseAdam(tables, lr=0.05),
        "adamw": lambda: torch.optim.AdamW(tables, lr=0.01, weight_decay=0.05),
    }[kind]()
    dense = torch.optim.Adam(model.top.parameters(), lr=0.01)
    return model, opt, dense


def step(model, opts, gen) -> None:
    lengths = torch.randint(1, 4, (8,), generator=gen)
    flat = (torch.rand(int(lengths.sum()), generator=gen) ** 3 * ROWS).long()
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    tokens = (torch.rand(8, 2, generator=gen) ** 3 * ROWS).long()
    for o in opts:
        o.zero_grad()
    model(flat, offsets, tokens).backward()
    for o in opts:
        o.step()


def snapshot(state: dict) -> dict:
    return {k: copy.deepcopy(v.state_dict()) if hasattr(v, "state_dict") else v
            for k, v in state.items()}


def check_every_step(path, snapshots: dict, kind: str) -> None:
    with Checkpointer(path, create=False) as fresh:
        assert fresh.steps() == sorted(snapshots)
        for s, want in snapshots.items():
            assert_same_state(fresh.load(s), want)
        model, opt, dense = build(kind, seed=99)
        target = {"model": model, "optim": opt, "dense": dense, "step": -1}
        last = max(snapshots)
        fresh.restore(target, last)
        assert_same_state(snapshot(target), snapshots[last])


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "sparse_adam"])
def test_tracked_saves_restore_bit_exact(tmp_path, kind):
    model, opt, dense = build(kind)
    state = {"model": model, "optim": opt, "dense": dense, "step": 0}
    gen = torch.Generator().manual_seed(1)
    snapshots = {}
    policy = EveryK(every=5, max_delta_fraction=1.0)
    with Checkpointer(tmp_path / "tracked", policy=policy, chunk_bytes=4096,
                      memory_budget=1 << 16) as ckpt, \
         Checkpointer(tmp_path / "hashed", policy=policy, chunk_bytes=4096,
                      memory_budget=1 << 16) as oracle:
        ckpt.track(model, prefix="model", optimizer=opt, optimizer_prefix="optim")
        for s in range(9):
            if s:
                step(model, (opt, dense), gen)
            state["step"] = s
            got, want = ckpt.save(s, state), oracle.save(s, state)
            # The same rows and chunks, so the same bytes: marks found exactly what hashing found.
            assert (got.kind, got.rows_changed, got.bytes_written) == (
                want.kind, want.rows_changed, want.bytes_written), s
            snapshots[s] = snapshot(state)
    check_every_step(tmp_path / "tracked", snapshots, kind)


def test_a_model_tracked_again_under_another_path_still_marks_its_tables(tmp_path):
    # Its lookups mark one table holding the keys of both paths: the second track() took the
    # hook over, and the first path's tables got no marks, while a canary this small all but
    # never notices (the saves' deltas missed the rows).
    model, opt, dense = build("adagrad")
    state = {"model": model, "optim": opt, "dense": dense, "step": 0}
    gen = torch.Generator().manual_seed(1)
    blind = Canary(fraction=0, min_rows=1, audit_every=None, seed=0)
    step(model, (opt, dense), gen)  # Adam's state exists from the first save on
    snapshots = {}
    with Checkpointer(tmp_path, policy=EveryK(every=10, max_delta_fraction=1.0), chunk_bytes=4096,
                      memory_budget=1 << 16) as ckpt:
        ckpt.track(model, prefix="model", optimizer=opt, canary=blind)
        ckpt.track(model, prefix="mirror", canary=blind)  # a second path, not in this state
        for s in range(4):
            if s:
                step(model, (opt, dense), gen)
            state["step"] = s
            assert ckpt.save(s, state).kind == ("base" if s == 0 else "delta")
            snapshots[s] = snapshot(state)
    check_every_step(tmp_path, snapshots, "adagrad")


def test_weight_decay_trips_the_canary_and_stays_exact(tmp_path, caplog):
    model, opt, dense = build("adamw")
    state = {"model": model, "optim": opt, "dense": dense, "step": 0}
    gen = torch.Generator().manual_seed(2)
    snapshots = {}
    with caplog.at_level(logging.WARNING, logger="deltackpt"), \
         Checkpointer(tmp_path, policy=EveryK(every=100, max_delta_fraction=1.0)) as ckpt:
        ckpt.track(model, optimizer=opt)
        for s in range(6):
            if s:
                step(model, (opt, dense), gen)
            state["step"] = s
            ckpt.save(s, state)
            snapshots[s] = snapshot(state)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2
    assert any("'model/bag.weight'" in w for w in warned)
    assert any("'model/emb.weight'" in w for w in warned)
    check_every_step(tmp_path, snapshots, "adamw")


class FailingStorage(LocalStorage):
    """Raises in write() while ``failing`` is set, as a full or broken disk would."""

    failing = False

    def write(self, key, parts):
        if self.failing and "/steps/" in f"/{key}":
            raise StoreError(5, f"injected write failure: {key}")
        super().write(key, parts)


def test_marks_survive_a_failed_save(tmp_path):
    table = nn.Embedding(ROWS, DIM, sparse=True)
    model = nn.Sequential(table)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.5)
    state = {"model": model, "optim": opt}
    storage = FailingStorage(tmp_path)
    with Checkpointer(storage, base_every=100) as ckpt:
        ckpt.track(model, optimizer=opt)

        def train(ids: list[int]) -> None:
            opt.zero_grad()
            model(torch.tensor(ids)).sum().backward()
            opt.step()

        train([0])  # the optimizer state exists before the base
        ckpt.save(0, state)
        train([3, 17])
        storage.failing = True
        with pytest.raises(StoreError, match="injected"):
            ckpt.save(1, state)
        storage.failing = False
        train([42])
        info = ckpt.save(2, state)
        assert info.kind == "delta"
        # Rows 3, 17 (from the failed save) and 42, in the table and in Adagrad's sum.
        assert info.rows_changed == 2 * 3
        want = snapshot(state)
        assert ckpt.steps() == [0, 2]
    with Checkpointer(tmp_path, create=False) as fresh:
        assert_same_state(fresh.load(2), want)
