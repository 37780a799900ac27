"""TorchRec DistributedModelParallel models (table-, row- and column-wise tables, fused row-wise
Adagrad, dense layers under DDP) checkpointed as deltas on 2 gloo ranks and restored under other
plans on 1, 2 and 3 ranks. The model and its plans: ``tests/trec_model.py``."""

from __future__ import annotations

import shutil

import pytest
import torch

import trec_model as tm
from dist_harness import check_ok, run_ranks

# torchrec is imported in the ranks only (see trec_model.torchrec_missing).
if tm.torchrec_missing():
    pytest.skip(tm.torchrec_missing(), allow_module_level=True)

SAVE_EVERY, SAVED, MORE = 3, 9, 20


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
        compared = tm.check_against(ckpt.load(SAVED), tm.local_values(dmp))
    for step in range(SAVED + 1, SAVED + MORE + 1):
        losses.append(tm.train_step(dmp, opt, step, rank))
    with deltackpt.Checkpointer(f"{path}-final") as ckpt:
        ckpt.save(SAVED + MORE, tm.state(dmp, opt, SAVED + MORE))
    return kinds, compared, losses


def resume_run(rank, world, path, plan, dtensor=False):
    """Restores SAVED under ``plan``; checks every local value; trains MORE steps, saving."""
    import deltackpt
    import trec_model as tm

    dmp, opt = tm.build(plan, seed=1 + rank, dtensor=dtensor)
    with deltackpt.Checkpointer(path) as ckpt:
        st = tm.state(dmp, opt, 0)
        assert ckpt.restore(st, SAVED) == SAVED and st["step"] == SAVED
        compared = tm.check_against(ckpt.load(SAVED), tm.local_values(dmp))
        ckpt.track(dmp, optimizer=dmp.fused_optimizer)
        losses, kinds = [], []
        for step in range(SAVED + 1, SAVED + MORE + 1):
            losses.append(tm.train_step(dmp, opt, step, rank))
            if world != 2 and step % SAVE_EVERY == 0:
                kinds.append(ckpt.save(step, tm.state(dmp, opt, step)).kind)
    if world == 2:
        with deltackpt.Checkpointer(f"{path}-{plan}{'-dtensor' if dtensor else ''}") as ckpt:
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


@pytest.mark.parametrize("dtensor", [False, True], ids=["sharded_tensor", "dtensor"])
def test_resume_under_another_plan_is_identical(saved, tmp_path, dtensor):
    """Restored, trained with marks and saved again under plan B2: with ShardedTensor state
    dicts, and with DTensor ones (``output_dtensor=True``) restoring what ShardedTensors saved."""
    import deltackpt

    path, results = saved
    resumed = check_ok(run_ranks(resume_run, 2, str(tmp_path), path, "B2", dtensor, deadline=300))
    for (_, _, losses), (compared, again, _) in zip(results, resumed):
        assert compared > 0
        assert again == losses
    suffix = "-dtensor" if dtensor else ""
    with deltackpt.Checkpointer(f"{path}-final", create=False) as a, \
            deltackpt.Checkpointer(f"{path}-B2{suffix}", create=False) as b:
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


def convert_run(rank, world, path, convert):
    """Restores SAVED (t2 in 2 column shards) under plan T2 (t2 in one piece)."""
    import deltackpt
    import trec_model as tm
    from deltackpt.integrations.torchrec import Convert

    dmp, opt = tm.build("T2", seed=1 + rank)
    optim = Convert(dmp.fused_optimizer) if convert else dmp.fused_optimizer
    with deltackpt.Checkpointer(path, create=False) as ckpt:
        try:
            ckpt.restore({"model": dmp, "optim": optim, "dense_optim": opt, "step": 0}, SAVED)
        except deltackpt.DeltackptError as e:
            return type(e).__name__, str(e)
        loaded = ckpt.load(SAVED)
    values = tm.local_values(dmp)
    momentum = values.pop("optim/sparse.embedding_bags.t2.weight/t2.momentum1", [])
    compared = tm.check_against(loaded, values)
    saved = loaded["optim"]["state"]["sparse.embedding_bags.t2.weight"]["t2.momentum1"].double()
    for (o,), t in momentum:
        want = ((saved[:, 0] * 4 + saved[:, 1] * 4) / 8).float()[o:o + t.numel()]
        assert torch.equal(t, want)
        compared += t.numel()
    return "ok", compared


def test_column_split_change_needs_a_conversion(saved, tmp_path):
    path, _ = saved
    refused = check_ok(run_ranks(convert_run, 2, str(tmp_path), path, False, deadline=300))
    for kind, message in refused:
        assert kind in ("MomentumLayoutError", "CheckpointAborted"), message
        assert "table 't2'" in message and "2 column shards" in message and "column_mean" in message
        assert "MomentumLayoutError" in message  # raised on rank 0, which holds t2 under plan T2
    converted = check_ok(run_ranks(convert_run, 2, str(tmp_path), path, True, deadline=300))
    assert all(kind == "ok" for kind, _ in converted)
    assert sum(n for _, n in converted) >= sum(r * d + r for r, d in tm.TABLES.values())


def test_cli_restores_a_torchrec_store_without_torchrec(saved, tmp_path):
    import subprocess
    import sys

    import deltackpt
    from deltackpt import statetree

    path, _ = saved
    out = tmp_path / "state.pt"
    code = ("import sys; sys.modules['torchrec'] = None; from deltackpt.cli import main; "
            f"rc = main(['restore', {path!r}, '--step', '{SAVED}', '--out', {str(out)!r}]); "
            "assert not any(m.startswith('torchrec') and sys.modules[m] is not None for m in sys.modules); "
            "sys.exit(rc)")
    subprocess.run([sys.executable, "-c", code], check=True)
    restored = torch.load(out, weights_only=True)
    with deltackpt.Checkpointer(path, create=False) as ckpt:
        want = statetree.flatten(ckpt.load(SAVED)).tensors
    got = statetree.flatten(restored).tensors
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key].local, want[key].local), key
