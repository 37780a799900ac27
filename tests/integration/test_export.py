"""Export to DCP, safetensors and torch.save, and import back: bit-exact round trips at a base, a
delta and a compacted step, with nested state."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import deltackpt
from deltackpt import Checkpointer, ConvertError, KeyMismatchError, OutputExistsError
from deltackpt.cli import main
from deltackpt.statetree import flatten
from helpers import assert_same_state, same_bits

FORMATS = [("torch", "out.pt"), ("safetensors", "st"), ("dcp", "dcp")]


def build_chain(path):
    """Steps 1 (base), 2 and 3 (deltas), then a compacted base of step 3; nested state with a
    model, its optimizer, a bf16 table, NaN and -0.0 bits and plain values."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Embedding(200, 6), torch.nn.Linear(6, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    table = torch.randn(64, 5).bfloat16()
    table[0, 0] = float("nan")
    table[1, 1] = -0.0
    with Checkpointer(path, chunk_bytes=1 << 12, memory_budget=1 << 16) as ckpt:
        for step in (1, 2, 3):
            opt.zero_grad()
            model(torch.tensor([step, 3 * step])).sum().backward()
            opt.step()
            table[step] += 1
            info = ckpt.save(step, {"model": model, "optim": opt, "extra": {"table": table, "ints": torch.arange(5)},
                                    "step": step, "lr": [0.01, 1e-3], "name": "run"})
            assert info.kind == ("base" if step == 1 else "delta")
        ckpt.compact(3)
        return {step: ckpt.load(step) for step in (1, 2, 3)}


def flat_equal(got, want):
    """Same tensors bit for bit under the same flat keys (DCP and flat exports keep dict keys as str)."""
    a, b = flatten(got).tensors, flatten(want).tensors
    assert set(a) == set(b)
    for k in b:
        assert same_bits(a[k].local, b[k].local), k


@pytest.mark.parametrize("fmt,name", FORMATS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_round_trip_through_each_format(tmp_path, fmt, name, step):
    saved = build_chain(tmp_path / "s")
    out = tmp_path / name
    info = deltackpt.export(tmp_path / "s", step, fmt, out, shard_bytes=600)
    assert info.step == step and info.tensors == len(flatten(saved[step]).tensors)
    if fmt == "torch":
        assert_same_state(torch.load(out, weights_only=True), saved[step])
    if fmt == "safetensors":
        files = os.listdir(out)
        assert "model.safetensors.index.json" in files and len(files) > 2  # split above 600 B
        index = json.loads((out / "model.safetensors.index.json").read_text())
        from safetensors.torch import load_file

        loaded = {}
        for f in set(index["weight_map"].values()):
            loaded.update(load_file(out / f))
        assert same_bits(loaded["model.0.weight"], saved[step]["model"]["0.weight"])
        assert same_bits(loaded["extra.table"], saved[step]["extra"]["table"])
    if fmt == "dcp":
        template = {"model": {k: torch.zeros_like(v) for k, v in saved[step]["model"].items()},
                    "extra": {"table": torch.zeros(64, 5, dtype=torch.bfloat16)}, "step": 0}
        dcp.load(template, checkpoint_id=str(out))
        assert template["step"] == step
        assert_same_state(template["model"], saved[step]["model"])
        assert same_bits(template["extra"]["table"], saved[step]["extra"]["table"])
    # Import it back as a base of a new store: the same state at that step.
    assert deltackpt.import_checkpoint(out, tmp_path / "back", 10 * step).kind == "base"
    with Checkpointer(tmp_path / "back", create=False) as ckpt:
        back = ckpt.load(10 * step)
    if fmt == "dcp":
        flat_equal(back, saved[step])  # DCP keeps dict keys as str ("0", not 0)
    else:
        assert_same_state(back, saved[step])


def test_import_continues_with_deltas(tmp_path):
    torch.save({"emb": torch.randn(1000, 8), "step": 7}, tmp_path / "m.pt")
    assert main(["import", str(tmp_path / "m.pt"), str(tmp_path / "s"), "--step", "7"]) == 0
    with Checkpointer(tmp_path / "s") as ckpt:
        state = {"emb": torch.zeros(1000, 8), "step": 0}
        assert ckpt.restore(state) == 7 and state["step"] == 7
        state["emb"][5] += 1
        info = ckpt.save(8, state)
    assert info.kind == "delta" and info.rows_changed == 1


def test_keys_prefix_dtype_and_overwrite(tmp_path):
    saved = build_chain(tmp_path / "s")
    out = tmp_path / "st"
    deltackpt.export(tmp_path / "s", 2, "safetensors", out, prefix="model")
    from safetensors.torch import load_file

    got = load_file(out / "model.safetensors")
    assert sorted(got) == ["0.weight", "1.bias", "1.weight"]
    with pytest.raises(OutputExistsError, match="exists"):
        deltackpt.export(tmp_path / "s", 2, "safetensors", out)
    deltackpt.export(tmp_path / "s", 2, "safetensors", out, keys=["extra/*"], dtype="float16", overwrite=True)
    got = load_file(out / "model.safetensors")
    assert sorted(got) == ["extra.ints", "extra.table"]
    assert got["extra.table"].dtype == torch.float16 and got["extra.ints"].dtype == torch.int64
    assert same_bits(got["extra.table"], saved[2]["extra"]["table"].to(torch.float16))
    with pytest.raises(KeyMismatchError, match="nothing/here"):
        deltackpt.export(tmp_path / "s", 2, "torch", tmp_path / "x.pt", keys=["nothing/here"])
    with pytest.raises(ConvertError, match="format"):
        deltackpt.export(tmp_path / "s", 2, "onnx", tmp_path / "x")
    # Floats convert to floats alone: to integers they would change value, to packed float4
    # torch does not convert (it raised NotImplementedError from the copy).
    for dtype in ("int64", "bool", torch.complex64, "float4_e2m1fn_x2"):
        with pytest.raises(ConvertError, match="dtype must be a floating-point dtype torch converts floats to"):
            deltackpt.export(tmp_path / "s", 2, "torch", tmp_path / "x.pt", dtype=dtype)
    assert not os.path.exists(tmp_path / "x.pt")
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no temp left behind


def test_cli_export_and_restore_keys(tmp_path, capsys):
    saved = build_chain(tmp_path / "s")
    s = str(tmp_path / "s")
    assert main(["export", s, "--step", "3", "--to", "torch", str(tmp_path / "a.pt"), "--keys", "model"]) == 0
    got = torch.load(tmp_path / "a.pt", weights_only=True)
    assert sorted(got) == ["model.0.weight", "model.1.bias", "model.1.weight"]
    assert main(["export", s, "--to", "torch", str(tmp_path / "a.pt")]) == 1
    assert "exists" in capsys.readouterr().err
    assert main(["restore", s, "--step", "2", "--out", str(tmp_path / "r.pt"), "--keys", "extra/table"]) == 0
    got = torch.load(tmp_path / "r.pt", weights_only=True)
    assert list(got) == ["extra/table"] and same_bits(got["extra/table"], saved[2]["extra"]["table"])
    assert main(["import", str(tmp_path / "nope"), str(tmp_path / "t"), "--step", "1"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_gpt_example_safetensors_export_loads_into_the_model(tmp_path):
    from deltackpt.examples.gpt_moe import GPTMoE, GPTMoEConfig, gpt_optimizers
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = GPTMoEConfig()
    model = GPTMoE(config)
    opts = gpt_optimizers(model)
    with Checkpointer(tmp_path / "s") as ckpt:
        ckpt.save(1, {"model": model, "optim": opts, "step": 1})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        ckpt.save(2, {"model": model, "optim": opts, "step": 2})
    deltackpt.export(tmp_path / "s", 2, "safetensors", tmp_path / "hf", prefix="model")
    fresh = GPTMoE(config)
    fresh.load_state_dict(load_file(tmp_path / "hf" / "model.safetensors"))
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert same_bits(a, b), name


def dcp_two_rank_job(rank, world, out, want_path):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    want = torch.load(want_path, weights_only=True)
    template = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) if v.dim() else torch.zeros_like(v)
                          for k, v in want["model"].items()},
                "extra": {"table": distribute_tensor(torch.zeros(64, 5, dtype=torch.bfloat16), mesh, [Shard(1)])},
                "step": 0}
    dcp.load(template, checkpoint_id=out)
    assert template["step"] == want["step"]
    for k, v in want["model"].items():
        got = template["model"][k]
        assert same_bits(got.full_tensor() if hasattr(got, "full_tensor") else got, v), k
    assert same_bits(template["extra"]["table"].full_tensor(), want["extra"]["table"])
    return rank


@pytest.mark.parametrize("world_size", [None, 3])
def test_exported_dcp_loads_into_a_two_rank_sharded_template(tmp_path, world_size):
    from dist_harness import check_ok, run_ranks

    saved = build_chain(tmp_path / "s")
    deltackpt.export(tmp_path / "s", 3, "dcp", tmp_path / "dcp", world_size=world_size)
    torch.save(saved[3], tmp_path / "want.pt")
    assert check_ok(run_ranks(dcp_two_rank_job, 2, str(tmp_path), str(tmp_path / "dcp"),
                              str(tmp_path / "want.pt"))) == [0, 1]


EXPORT_WITH_FEW_FILES = """
import resource, sys, deltackpt
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
deltackpt.export(sys.argv[1], 3, "dcp", sys.argv[2], world_size=10**9)
"""


def test_dcp_export_to_more_ranks_than_open_files_or_rows(tmp_path):
    """A billion ranks, in a process that may open 64 files: the ranks that hold rows (the 200
    rows of the largest tensor, a row each) get a file each, written one at a time, and the
    folder loads and imports as the step."""
    saved = build_chain(tmp_path / "s")
    subprocess.run([sys.executable, "-c", EXPORT_WITH_FEW_FILES, str(tmp_path / "s"), str(tmp_path / "dcp")],
                   check=True, timeout=300)
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) == 200
    assert deltackpt.import_checkpoint(tmp_path / "dcp", tmp_path / "back", 30).kind == "base"
    with Checkpointer(tmp_path / "back", create=False) as ckpt:
        flat_equal(ckpt.load(30), saved[3])


@pytest.mark.parametrize("damage", ["no state_dict_metadata", "item bytes", "huge length"])
def test_import_of_a_damaged_dcp_folder_is_one_convert_error(tmp_path, damage):
    """Whatever is wrong in a DCP folder (an attribute its metadata lacks, an item that is no
    torch.save blob, a pickle claiming 2^60 bytes) is a ConvertError naming the folder."""
    import pickle
    import struct

    from deltackpt.ops.dcp import read_dcp

    build_chain(tmp_path / "s")
    deltackpt.export(tmp_path / "s", 1, "dcp", tmp_path / "dcp")
    meta_path = tmp_path / "dcp" / ".metadata"
    if damage == "no state_dict_metadata":
        meta = pickle.loads(meta_path.read_bytes())
        del meta.state_dict_metadata
        meta_path.write_bytes(pickle.dumps(meta))
    elif damage == "item bytes":
        item = tmp_path / "dcp" / "__0_0.distcp"
        item.write_bytes(bytes(64) + item.read_bytes()[64:])
    else:
        meta_path.write_bytes(b"\x80\x05\x8e" + struct.pack("<Q", 1 << 60) + b"x")
    with pytest.raises(ConvertError, match="not a DCP checkpoint this reader understands") as e:
        read_dcp(str(tmp_path / "dcp"))
    assert str(tmp_path / "dcp") in str(e.value) and "\n" not in str(e.value)


def test_import_refuses_dcp_metadata_that_runs_code_or_claims_too_much(tmp_path):
    import pickle

    from deltackpt.ops.dcp import read_dcp

    build_chain(tmp_path / "s")
    deltackpt.export(tmp_path / "s", 1, "dcp", tmp_path / "dcp")
    meta_path = tmp_path / "dcp" / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())
    real = meta_path.read_bytes()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    meta_path.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ConvertError, match="does not load"):
        read_dcp(str(tmp_path / "dcp"))
    assert not (tmp_path / "pwned").exists()
    md = meta.state_dict_metadata["model.0.weight"]
    md.size = torch.Size([1 << 40, 6])
    meta_path.write_bytes(pickle.dumps(meta))
    with pytest.raises(ConvertError, match="needs"):
        read_dcp(str(tmp_path / "dcp"))
    meta_path.write_bytes(real)
    assert read_dcp(str(tmp_path / "dcp"))["step"] == 1
