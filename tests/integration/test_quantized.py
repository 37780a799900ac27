"""Quantized deltas end to end: restored rows within the recorded bound, everything else exact,
lossy steps marked in the record and by ls/show/verify, compaction, the tracker after a restore,
the restore-count rule, and a DLRM resumed from an 8-bit delta step."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltackpt
from deltackpt import ByRestores, Checkpointer, Rowwise
from deltackpt.cli import main as cli

class NeverBase:
    """Deltas after the first base, whatever they cost, so small tables still get deltas."""

    name = "never_base"

    def decide(self, chain, delta_bytes, full_bytes):
        return deltackpt.Decision("delta", "test policy: always a delta")


NEVER_BASE = NeverBase()


def record(path, step: int) -> dict:
    with open(os.path.join(path, "commits", f"{step:020d}.json")) as f:
        return json.load(f)


def bumped(t: torch.Tensor, rows: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    out[rows] += torch.randn((len(rows), *t.shape[1:]), generator=g).to(t.dtype) * 0.01
    return out


def state_of(emb: torch.Tensor, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"emb.weight": emb, "mlp.weight": torch.randn(8, 8, generator=g)},
            "optim": {"exp_avg": torch.randn(emb.shape, generator=g)}, "step": 3}


def test_restored_rows_within_bound_and_the_rest_exact(tmp_path):
    path = str(tmp_path / "s")
    emb0 = torch.randn(64, 16) * 0.02
    with Checkpointer(path, policy=NEVER_BASE, quantize={"model/emb*": Rowwise(bits=4)}) as ckpt:
        s0 = state_of(emb0)
        assert ckpt.save(0, s0).kind == "base"
        s1 = state_of(bumped(emb0, [1, 5, 40], 1), seed=1)
        assert ckpt.save(1, s1).kind == "delta"
        got = ckpt.load(1)
    rec = record(path, 1)
    lossy = rec["tensors"]["model/emb.weight"]["lossy"]
    assert lossy["scheme"] == "rowwise4"
    assert rec["lossy"] is True
    bound = lossy["chain_bound"]
    assert 0 < bound < 0.02
    err = (got["model"]["emb.weight"] - s1["model"]["emb.weight"]).abs()
    assert float(err.max()) <= bound
    assert float(err[[1, 5, 40]].max()) > 0  # quantized indeed
    assert torch.equal(got["model"]["emb.weight"][[0, 2, 3]], s1["model"]["emb.weight"][[0, 2, 3]])
    # Not named by a pattern: bit-exact, even the row-aligned optimizer state.
    assert torch.equal(got["model"]["mlp.weight"], s1["model"]["mlp.weight"])
    assert torch.equal(got["optim"]["exp_avg"], s1["optim"]["exp_avg"])
    assert "lossy" not in rec["tensors"]["optim/exp_avg"] or rec["tensors"]["optim/exp_avg"]["lossy"] is None
    # The base stays exact.
    assert record(path, 0)["lossy"] is False


def test_exact_store_never_lossy(tmp_path):
    path = str(tmp_path / "s")
    emb0 = torch.randn(32, 8)
    with Checkpointer(path, policy=NEVER_BASE) as ckpt:
        ckpt.save(0, state_of(emb0))
        s1 = state_of(bumped(emb0, [3], 2))
        ckpt.save(1, s1)
        got = ckpt.load(1)
    assert torch.equal(got["model"]["emb.weight"], s1["model"]["emb.weight"])
    for step in (0, 1):
        rec = record(path, step)  # format 4, the exact format: no lossy fields
        assert rec["format"] == 4 and "lossy" not in rec and "quantize" not in rec
        assert all("lossy" not in t for t in rec["tensors"].values())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       bits=st.sampled_from([8, 4, 2]), rows=st.integers(1, 40), width=st.integers(1, 33),
       constant=st.booleans(), seed=st.integers(0, 1000))
def test_bound_holds_over_shapes_and_dtypes(tmp_path_factory, dtype, bits, rows, width, constant, seed):
    path = str(tmp_path_factory.mktemp("q") / "s")
    g = torch.Generator().manual_seed(seed)
    t0 = (torch.randn(rows, width, generator=g) * 0.1).to(dtype)
    changed = sorted({0, rows // 2, rows - 1})
    t1 = bumped(t0, changed, seed)
    if constant:
        t1[changed[0]] = 0.25
    with Checkpointer(path, policy=NEVER_BASE,
                      quantize={"t": Rowwise(bits=bits, adaptive=bits < 8 and seed % 2 == 0)}) as ckpt:
        ckpt.save(0, {"t": t0})
        ckpt.save(1, {"t": t1})
        got = ckpt.load(1)["t"]
    assert got.dtype == dtype
    bound = record(path, 1)["tensors"]["t"]["lossy"]["chain_bound"]
    assert float((got.float() - t1.float()).abs().max()) <= bound
    if constant and dtype == torch.float32 and bits == 8:
        assert torch.equal(got[changed[0]], t1[changed[0]])


def test_non_finite_rows_refused_clearly_and_nothing_committed(tmp_path):
    path = str(tmp_path / "s")
    t0 = torch.randn(8, 4)
    with Checkpointer(path, policy=NEVER_BASE, quantize={"t": Rowwise(bits=8)}) as ckpt:
        ckpt.save(0, {"t": t0})
        t1 = t0.clone()
        t1[5, 1] = float("nan")
        with pytest.raises(deltackpt.QuantizationError, match="'t' row 5 holds inf or NaN"):
            ckpt.save(1, {"t": t1})
        assert ckpt.steps() == [0]


def test_bad_quantize_rules(tmp_path):
    with pytest.raises(deltackpt.QuantizationError):
        Checkpointer(str(tmp_path / "a"), quantize={"t": 8})
    path = str(tmp_path / "b")
    with Checkpointer(path, policy=NEVER_BASE, quantize={"t": Rowwise()}) as ckpt:
        with pytest.raises(deltackpt.QuantizationError, match="'t', a int64 tensor"):
            ckpt.save(0, {"t": torch.arange(6).reshape(3, 2)})
        assert ckpt.steps() == []


def test_tracker_reference_after_restore_is_the_restored_values(tmp_path):
    path = str(tmp_path / "s")
    emb0 = torch.randn(50, 8) * 0.05
    with Checkpointer(path, policy=NEVER_BASE, quantize={"emb": Rowwise(bits=2)}) as ckpt:
        ckpt.save(0, {"emb": emb0})
        ckpt.save(1, {"emb": bumped(emb0, [4, 9], 3)})
    live = {"emb": torch.zeros(50, 8)}
    with Checkpointer(path, policy=NEVER_BASE, quantize={"emb": Rowwise(bits=2)}) as ckpt:
        ckpt.restore(live, 1)
        info = ckpt.save(2, live)
        assert info.kind == "delta" and info.rows_changed == 0
        live["emb"][7] += 1.0
        assert ckpt.save(3, live).rows_changed == 1
        assert torch.equal(ckpt.load(2)["emb"], ckpt.load(1)["emb"])


def test_ls_show_verify_and_compaction(tmp_path, capsys):
    path = str(tmp_path / "s")
    emb0 = torch.randn(40, 8)
    with Checkpointer(path, policy=NEVER_BASE, quantize={"emb": Rowwise(bits=8)}) as ckpt:
        ckpt.save(0, {"emb": emb0, "w": torch.ones(3)})
        s1 = {"emb": bumped(emb0, [2, 30], 4), "w": torch.ones(3)}
        ckpt.save(1, s1)
        before = ckpt.load(1)
    assert cli(["ls", path, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["lossy"] for r in rows] == [False, True]
    assert cli(["ls", path]) == 0
    assert "lossy" in capsys.readouterr().out
    assert cli(["show", path, "1"]) == 0
    out = capsys.readouterr().out
    assert "rowwise8" in out and "bound" in out
    assert cli(["verify", path]) == 0
    capsys.readouterr()
    assert cli(["compact", path, "--upto", "1"]) == 0
    capsys.readouterr()
    with open(os.path.join(path, "bases", f"{1:020d}.json")) as f:
        base = json.load(f)
    assert base["kind"] == "base" and base["lossy"] is True
    assert base["tensors"]["emb"]["lossy"]["chain_bound"] == record(path, 1)["tensors"]["emb"]["lossy"]["chain_bound"]
    assert base["tensors"].get("w", {}).get("lossy") is None
    with Checkpointer(path, create=False) as ckpt:
        after = ckpt.load(1)
    assert torch.equal(after["emb"], before["emb"])
    assert cli(["verify", path]) == 0


def test_verify_catches_an_inconsistent_bound(tmp_path, capsys):
    path = str(tmp_path / "s")
    emb0 = torch.randn(40, 8)
    with Checkpointer(path, policy=NEVER_BASE, quantize={"emb": Rowwise(bits=4)}) as ckpt:
        ckpt.save(0, {"emb": emb0})
        ckpt.save(1, {"emb": bumped(emb0, [2, 30], 4)})
    commit = os.path.join(path, "commits", f"{1:020d}.json")
    with open(commit) as f:
        doc = json.load(f)
    del doc["checksum"]  # a root without one is read unchecked, so only the bound is wrong
    doc["tensors"]["emb"]["lossy"]["bound"] /= 100
    doc["tensors"]["emb"]["lossy"]["chain_bound"] /= 100
    with open(commit, "w") as f:
        json.dump(doc, f)
    assert cli(["verify", path]) != 0
    assert "needs a bound of at least" in capsys.readouterr().out


def test_by_restores_raises_bits_after_unplanned_restores(tmp_path):
    path = str(tmp_path / "s")
    emb = torch.randn(30, 8)
    rules = {"emb": ByRestores(expected=1)}
    with Checkpointer(path, policy=NEVER_BASE, quantize=rules) as ckpt:
        ckpt.save(0, {"emb": emb})
        ckpt.save(1, {"emb": bumped(emb, [1], 1)})
    assert record(path, 1)["tensors"]["emb"]["lossy"]["scheme"] == "rowwise2a"
    assert record(path, 1)["quantize"]["restores"] == 0
    for step in (2, 3):
        live = {"emb": torch.zeros(30, 8)}
        with Checkpointer(path, policy=NEVER_BASE, quantize=rules) as ckpt:
            ckpt.restore(live, step - 1)
            live["emb"][2] += 1
            ckpt.save(step, live)
        q = record(path, step)["quantize"]
        assert q["restores"] == step - 1
    assert record(path, 2)["tensors"]["emb"]["lossy"]["scheme"] == "rowwise4a"
    assert "use up the 1 expected" in record(path, 2)["quantize"]["tensors"]["emb"]["reason"]


def dlrm_eval_loss_after_resume(path: str, quantize: dict | None, *, m: int, n: int) -> float:
    """Trains a DLRM 0 -> m saving every 2 steps (a base at 0, deltas after), resumes a fresh
    model from step m, trains n more steps, and returns the mean loss of 8 held-out batches."""
    from deltackpt.datasets import CriteoConfig
    from deltackpt.examples import deterministic, dlrm_run, train

    data = CriteoConfig(scale=0.0002, batch_size=64)
    shapes = {"embedding_dim": 8, "bottom_mlp": (16, 8), "top_mlp": (16,)}
    with deterministic(0, threads=1):
        state, loss = dlrm_run(data, **shapes)
        with Checkpointer(path, policy=NEVER_BASE, quantize=quantize) as ckpt:
            for step in range(0, m + 1, 2):
                train(state, loss, step)
                ckpt.save(step, state)
    with deterministic(1, threads=1):
        state, loss = dlrm_run(data, seed=1, **shapes)
        with Checkpointer(path, create=False) as ckpt:
            assert ckpt.restore(state, m) == m
        train(state, loss, m + n)
        with torch.no_grad():
            return sum(float(loss(100_000 + i)) for i in range(8)) / 8


def test_dlrm_resumed_from_an_8bit_delta_step(tmp_path):
    m, n = 6, 10
    exact = dlrm_eval_loss_after_resume(str(tmp_path / "exact"), None, m=m, n=n)
    q8 = dlrm_eval_loss_after_resume(str(tmp_path / "q8"), {"model/emb*": Rowwise(bits=8)}, m=m, n=n)
    rec = record(str(tmp_path / "q8"), m)
    assert rec["kind"] == "delta" and rec["lossy"] is True
    assert any(t.get("lossy") for k, t in rec["tensors"].items() if k.startswith("model/emb"))
    assert exact != q8  # the 8-bit store did change the restored model ...
    assert abs(q8 - exact) <= 1e-4 * abs(exact)  # ... by under 0.01% of the evaluation loss


def test_demo_with_quantized_deltas(tmp_path, capsys):
    code = cli(["demo", "--path", str(tmp_path), "--scale", "0.0005", "--steps", "30", "--every", "10",
                "--batch-size", "64", "--ranks", "1", "--quantize", "4", "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert code == 0
    q = next(d for d in lines if d.get("event") == "quantized")
    assert q["scheme"] == "rowwise4a" and q["ok"] and q["lossy_tensors"] > 0
    assert 0 < q["worst_error"] <= q["bound"]


def test_background_save_quantizes_what_was_staged(tmp_path):
    path = str(tmp_path / "s")
    emb0 = torch.randn(30, 8)
    with Checkpointer(path, policy=NEVER_BASE, quantize={"emb": Rowwise(bits=8)}) as ckpt:
        ckpt.save(0, {"emb": emb0})
        live = bumped(emb0, [3, 17], 5)
        saved = live.clone()
        handle = ckpt.save(1, {"emb": live}, blocking=False)
        live[3] += 100.0  # after staging: must not reach the step
        assert handle.result().kind == "delta"
        got = ckpt.load(1)["emb"]
    bound = record(path, 1)["tensors"]["emb"]["lossy"]["chain_bound"]
    assert float((got - saved).abs().max()) <= bound
