"""TorchRec DistributedModelParallel models (table-, row- and column-wise tables, fused row-wise
Adagrad, dense layers under DDP) checkpointed as deltas on 2 gloo ranks and restored under other
plans on 1, 2 and 3 ranks. The model and its plans: ``tests/trec_model.py``."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec is not installed (pip install deltackpt[torchrec], "
                    "then pip install --no-deps torchrec==1.9.2)")

import trec_model as tm  # noqa: E402
from dist_harness import check_ok, run_ranks  # noqa: E402

SAVE_EVERY, SAVED, MORE = 3, 9, 20


def local_values(dmp) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    """Every local shard of the DMP's tables and fused optimizer state, read from TorchRec's own
    state dicts: (global offsets, a copy) by key, the optimizer's under ``optim/<fqn>/<name>``."""
    out = {}
    for key, st in dmp.state_dict().items():
        shards = st.local_shards() if hasattr(st, "local_shards") else []
        out[f"model/{key}"] = [(tuple(s.metadata.shard_offsets), s.tensor.clone()) for s in shards] \
            if hasattr(st, "local_shards") else [((0,) * st.dim(), st.clone())]
    for fqn, entries in dmp.fused_optimizer.state_dict()["state"].items():
        for name, st in entries.items():
            out[f"optim/{fqn}/{name}"] = [(tuple(s.metadata.shard_offsets), s.tensor.clone())
                                          for s in st.local_shards()]
    return out


def check_against(loaded: dict, values: dict) -> int:
    """Asserts every local value equals the saved global state (TorchRec's momentum layout:
    column shard j of a table at ``[j * rows, (j+1) * rows)``); returns the values compared."""
    n = 0
    for key, parts in values.items():
        if key.startswith("model/"):
            saved = loaded["model"][key.removeprefix("model/")]
            for offset, t in parts:
                box = tuple(slice(o, o + s) for o, s in zip(offset, t.shape))
                assert torch.equal(saved[box], t), key
                n += t.numel()
            continue
        _, fqn, name = key.split("/")
        saved = loaded["optim"]["state"][fqn][name]  # (rows, column shards)
        rows = saved.shape[0]
        for (o,), t in parts:
            want = saved[o:o + t.numel(), 0] if saved.shape[1] == 1 else saved[:, o // rows]
            assert torch.equal(want, t), (key, o)
            n += t.numel()
    return n


def save_run(rank, world, path, tracker, track):
    """Plan A2 on 2 ranks: SAVED steps with saves every SAVE_EVERY, then MORE uninterrupted steps."""
    import deltackpt
    import trec_model as tm

    dmp, opt = tm.build("A2", tracker=tracker)
    kinds, losses = [], []
    with deltackpt.Checkpointer(path) as ckpt:
        if track:
            ckpt.track(dmp, optimizer=dmp.fused_optimizer)
        for step in range(1, SAVED + 1):
            tm.train_step(dmp, opt, step, rank)
            if step % SAVE_EVERY == 0:
                kinds.append(ckpt.save(step, tm.state(dmp, opt, step)).kind)
        compared = check_against(ckpt.load(SAVED), local_values(dmp))
    for step in range(SAVED + 1, SAVED + MORE + 1):
        losses.append(tm.train_step(dmp, opt, step, rank))
    with deltackpt.Checkpointer(f"{path}-final") as ckpt:
        ckpt.save(SAVED + MORE, tm.state(dmp, opt, SAVED + MORE))
    return kinds, compared, losses


def resume_run(rank, world, path, plan):
    """Restores SAVED under ``plan``; checks every local value; trains MORE steps, saving."""
    import deltackpt
    import trec_model as tm

    dmp, opt = tm.build(plan, seed=1 + rank)
    with deltackpt.Checkpointer(path) as ckpt:
        st = tm.state(dmp, opt, 0)
        assert ckpt.restore(st, SAVED) == SAVED and st["step"] == SAVED
        compared = check_against(ckpt.load(SAVED), local_values(dmp))
        ckpt.track(dmp, optimizer=dmp.fused_optimizer)
        losses, kinds = [], []
        for step in range(SAVED + 1, SAVED + MORE + 1):
            losses.append(tm.train_step(dmp, opt, step, rank))
            if world != 2 and step % SAVE_EVERY == 0:
                kinds.append(ckpt.save(step, tm.state(dmp, opt, step)).kind)
    if world == 2:
        with deltackpt.Checkpointer(f"{path}-{plan}") as ckpt:
            ckpt.save(SAVED + MORE, tm.state(dmp, opt, SAVED + MORE))
    return compared, losses, kinds


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("trec") / "store")
    results = check_ok(run_ranks(save_run, 2, str(tmp_path_factory.mktemp("h")), path, False, True,
                                 deadline=300))
    return path, results


def assert_same_state(a: dict, b: dict, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_saved_as_deltas_and_exact(saved):
    import deltackpt

    path, results = saved
    for kinds, compared, _ in results:
        assert kinds == ["base", "delta", "delta"]
        assert compared > 0
    with deltackpt.Checkpointer(path, create=False) as ckpt:
        loaded = ckpt.load(SAVED)
    # The fused optimizer's row-wise state is one row per table row: (rows, column shards).
    for table, (rows, _) in tm.TABLES.items():
        momentum = loaded["optim"]["state"][f"sparse.embedding_bags.{table}.weight"][f"{table}.momentum1"]
        assert momentum.shape == (rows, 2 if table == "t2" else 1)
    assert loaded["optim"]["columns"]["sparse.embedding_bags.t2.weight"] == (0, 4, 8)


def test_resume_under_another_plan_is_identical(saved, tmp_path):
    import deltackpt

    path, results = saved
    resumed = check_ok(run_ranks(resume_run, 2, str(tmp_path), path, "B2", deadline=300))
    for (_, _, losses), (compared, again, _) in zip(results, resumed):
        assert compared > 0
        assert again == losses
    with deltackpt.Checkpointer(f"{path}-final", create=False) as a, \
            deltackpt.Checkpointer(f"{path}-B2", create=False) as b:
        assert_same_state(a.load(), b.load())


@pytest.mark.parametrize("world,plan", [(1, "C1"), (3, "D3")])
def test_restore_on_other_world_sizes(saved, tmp_path, world, plan):
    path = str(tmp_path / "store")
    shutil.copytree(saved[0], path)  # each world size saves its own steps after SAVED
    resumed = check_ok(run_ranks(resume_run, world, str(tmp_path), path, plan, deadline=300))
    assert sum(compared for compared, _, _ in resumed) >= sum(
        rows * dim + rows * (2 if t == "t2" else 1)
        for t, (rows, dim) in tm.TABLES.items())
    for _, losses, kinds in resumed:
        assert len(losses) == MORE and all(torch.isfinite(torch.tensor(losses)))
        assert kinds[0] == "delta"
