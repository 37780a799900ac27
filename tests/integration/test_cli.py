"""The command line: every command, --json, --help and one-line errors without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_same_state

from deltackpt import Checkpointer
from deltackpt.cli import main
from deltackpt.format.layout import commit_key


@pytest.fixture
def store(store_path):
    table = torch.arange(400, dtype=torch.float32).reshape(100, 4)
    with Checkpointer(store_path) as ckpt:
        ckpt.save(10, {"model": {"table": table}, "step": 10})
        table[7] = -1
        ckpt.save(20, {"model": {"table": table}, "step": 20})
    return str(store_path)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls(store, capsys):
    code, out, _ = run(capsys, "ls", store)
    assert code == 0 and "base" in out and "delta" in out
    code, out, _ = run(capsys, "ls", store, "--json")
    rows = json.loads(out)
    assert [(r["step"], r["kind"], r["parent"]) for r in rows] == [(10, "base", None), (20, "delta", 10)]


def test_show(store, capsys):
    code, out, _ = run(capsys, "show", store, "20", "--chunks")
    assert code == 0 and "10 -> 20" in out and "model/table" in out and "xxh3:" in out
    code, out, _ = run(capsys, "show", store, "20", "--json")
    doc = json.loads(out)
    assert doc["chain"] == [10, 20] and doc["tensors"]["model/table"]["parts"][0]["changed"] == 1


def test_restore_writes_a_weights_only_file(store, tmp_path, capsys):
    out_file = tmp_path / "s20.pt"
    code, out, _ = run(capsys, "restore", store, "--step", "20", "--out", str(out_file))
    assert code == 0 and str(out_file) in out
    got = torch.load(out_file, weights_only=True)
    with Checkpointer(store, create=False) as ckpt:
        assert_same_state(got, ckpt.load(20))
    assert got["model"]["table"][7].eq(-1).all()


def test_verify_ok_and_json(store, capsys):
    code, out, _ = run(capsys, "verify", store)
    assert code == 0 and "ok" in out
    code, out, _ = run(capsys, "verify", store, "--step", "20", "--json")
    doc = json.loads(out)
    assert doc["ok"] and doc["steps"] == [20]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ls", "{missing}"], "no deltackpt store"),
        (["show", "{store}", "15"], "step 15 is not committed; committed steps: 10, 20"),
        (["restore", "{store}", "--step", "99", "--out", "{tmp}/x.pt"], "step 99 is not committed"),
        (["verify", "{store}", "--step", "5"], "step 5 is not committed"),
        (["show", "{store}", "20"], "not valid JSON"),
        (["gc", "{store}", "--grace", "nan"], "--grace must be a finite number >= 0, got nan"),
        (["gc", "{store}", "--grace=-1"], "--grace must be a finite number >= 0, got -1.0"),
        (["compact", "{store}", "--grace", "inf"], "--grace must be a finite number >= 0, got inf"),
        (["gc", "{store}", "--keep-last", "0"], "--keep-last must be a positive integer, got 0"),
        (["compact", "{store}", "--keep-last", "2", "--keep-every=-5"],
         "--keep-every must be a positive integer, got -5"),
        (["ls", "{file}"], "{file} is a file, where a folder of the store must be"),
        (["verify", "{file}/inner"], "{file} is a file, where a folder of the store must be"),
    ],
)
def test_bad_input_is_one_line(store, tmp_path, capsys, argv, message):
    if message == "not valid JSON":
        with open(os.path.join(store, *commit_key(10).split("/")), "w") as f:
            f.write("{not json")
    names = {"store": store, "missing": tmp_path / "nope", "tmp": tmp_path, "file": tmp_path / "a-file"}
    (tmp_path / "a-file").write_text("not a store")
    code, out, err = run(capsys, *[a.format(**names) for a in argv])
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("deltackpt: error: ") and message.format(**names) in err


def test_corrupt_record_is_listed_as_corrupt(store, capsys):
    with open(os.path.join(store, *commit_key(20).split("/")), "w") as f:
        f.write('{"format": 4}')
    code, out, _ = run(capsys, "ls", store)
    assert code == 0 and "corrupt" in out and "'kind' is missing" in out


def test_ls_reads_the_records_own_fields_alone(store, capsys, monkeypatch):
    """A listing of hundreds of steps of a large job reads each record's step, kind, parent and
    sizes: parsing its tensors' entries was ~94% of parsing such a root."""
    from deltackpt.format import record_checks

    def no_tensor(*_):
        raise AssertionError("ls parsed a tensor entry")

    monkeypatch.setattr(record_checks, "_parse_tensor", no_tensor)
    code, out, _ = run(capsys, "ls", store, "--json")
    assert code == 0
    rows = json.loads(out)
    assert [(r["step"], r["kind"], r["restore_chain"]) for r in rows] == [(10, "base", [10]), (20, "delta", [10, 20])]


def test_a_summary_chain_is_the_chain(store):
    with Checkpointer(store, create=False) as ckpt:
        s = ckpt.load(20)
        ckpt.restore(s, 20)
        s["model"]["table"][3] = 5
        ckpt.save(30, s)
        ckpt.compact(20)
        for step in ckpt.steps():
            chain = [(m.step, m.kind, m.attempt, m.compacts) for m in ckpt.store.chain(step)]
            assert chain == [(m.step, m.kind, m.attempt, m.compacts) for m in ckpt.store.summary_chain(step)]
        assert [m.compacts is not None for m in ckpt.store.summary_chain(30)] == [True, False]


def test_verify_failure_exits_nonzero(store, capsys):
    with Checkpointer(store, create=False) as ckpt:
        m = ckpt.store.manifest(10)
    os.remove(os.path.join(store, "steps", m.attempt, "pack.0", "c.0"))  # the small table's base
    code, out, _ = run(capsys, "verify", store)
    assert code == 1 and "missing" in out


def test_python_m_and_help():
    for argv in (["--help"], ["ls", "--help"], ["show", "--help"], ["restore", "--help"],
                 ["verify", "--help"], ["demo", "--help"]):
        r = subprocess.run([sys.executable, "-m", "deltackpt", *argv], capture_output=True, text=True)
        assert r.returncode == 0 and "usage: deltackpt" in r.stdout, argv
    r = subprocess.run([sys.executable, "-m", "deltackpt", "ls"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_demo_small(tmp_path, capsys):
    """The main job at a small size: a base and deltas, the middle delta restored bit for bit on
    two gloo ranks and on one, the resumed run equal to the uninterrupted one, and the plot."""
    code, out, err = run(capsys, "demo", "--path", str(tmp_path), "--scale", "0.001",
                         "--batch-size", "32", "--steps", "6", "--every", "2", "--base-every", "3",
                         "--json")
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["event"] for e in events] == ["start", "checkpoint", "checkpoint", "checkpoint",
                                            "trained", "restore", "resume", "done"]
    saves = [e for e in events if e["event"] == "checkpoint"]
    assert [(e["step"], e["kind"]) for e in saves] == [(2, "base"), (4, "delta"), (6, "delta")]
    # Saved in the background: training waited for the staging, the commit came after.
    assert all(0 < e["blocked_seconds"] < e["seconds"] for e in saves), saves
    rows = events[0]["rows"]
    assert saves[0]["rows_changed"] == rows and 0 < saves[1]["rows_changed"] < rows / 10
    assert saves[1]["bytes_written"] * 3 < saves[1]["full_bytes"]
    restore = events[5]
    assert (restore["step"], restore["kind"], restore["chain"]) == (4, "delta", [2, 4])
    assert restore["bit_exact"] and [r["rank"] for r in restore["per_rank"]] == [0, 1]
    assert all(r["ok"] and not r["mismatched"] for r in restore["per_rank"])
    assert sum(r["table_rows"] for r in restore["per_rank"]) == rows
    resume = events[6]
    assert resume["bit_exact"] and (resume["step"], resume["until"]) == (4, 6)
    assert resume["mismatched_at_step"] == [] and resume["mismatched"] == [] and resume["tensors"] > 100
    done = events[-1]
    assert done["bit_exact"] and os.path.dirname(os.path.dirname(done["store"])) == str(tmp_path)
    with open(done["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with Checkpointer(done["store"], create=False) as ckpt:
        assert ckpt.steps() == [2, 4, 6]
    for argv, message in [(["--every", "0"], "--every must be >= 1, got 0"),
                          (["--steps", "3", "--every", "2"], "must allow two checkpoints"),
                          (["--restore-step", "5"], "--restore-step must be a checkpoint"),
                          (["--scale", "0"], "--scale must be in (0, 1], got 0.0")]:
        code, out, err = run(capsys, "demo", "--path", str(tmp_path / "bad"), *argv)
        assert code == 1 and err.count("\n") == 1 and message in err, (argv, err)
    assert not (tmp_path / "bad").exists()


def test_demo_blocking_saves_synchronously(tmp_path, capsys):
    """With --blocking, training waits for each whole save (blocked = save time), and the run still
    restores and resumes bit for bit."""
    code, out, err = run(capsys, "demo", "--path", str(tmp_path), "--scale", "0.001", "--batch-size", "32",
                         "--steps", "4", "--every", "2", "--ranks", "1", "--blocking", "--json")
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    saves = [e for e in events if e["event"] == "checkpoint"]
    assert [(e["step"], e["kind"]) for e in saves] == [(2, "base"), (4, "delta")]
    assert all(e["blocked_seconds"] == e["seconds"] > 0 for e in saves), saves
    assert events[-1]["event"] == "done" and events[-1]["bit_exact"]


@pytest.mark.parametrize("world_size", [None, 3])
def test_restore_replaces_files_only_with_force(store, tmp_path, capsys, world_size):
    """A file to write that exists is named in a one-line error and left as it was, unless
    --force; with --world-size, before any rank's file is written."""
    out = tmp_path / "out"
    if world_size is None:
        out.write_bytes(b"keep")
        kept, ranks = out, []
    else:
        out.mkdir()
        kept = out / "rank00002-of-00003.pt"
        kept.write_bytes(b"keep")
        ranks = ["--world-size", str(world_size)]
    code, _, err = run(capsys, "restore", store, "--step", "20", "--out", str(out), *ranks)
    assert code == 1 and err == f"deltackpt: error: {kept} exists; pass --force to replace it\n"
    assert kept.read_bytes() == b"keep" and sorted(p.name for p in tmp_path.glob("out/*")) == (
        [] if world_size is None else [kept.name])
    code, _, _ = run(capsys, "restore", store, "--step", "20", "--out", str(out), *ranks, "--force")
    assert code == 0 and torch.load(kept, weights_only=True)["step"] == 20


def test_restore_per_rank_files(store, tmp_path, capsys):
    out_dir = tmp_path / "ranks"
    code, out, _ = run(capsys, "restore", store, "--step", "20", "--out", str(out_dir),
                       "--world-size", "3", "--json")
    files = json.loads(out)["files"]
    assert code == 0 and len(files) == 3
    with Checkpointer(store, create=False) as ckpt:
        full = ckpt.load(20)["model"]["table"]
    parts = []
    for rank, f in enumerate(files):
        doc = torch.load(f, weights_only=True)
        assert (doc["rank"], doc["world_size"], doc["step"]) == (rank, 3, 20)
        meta = doc["shards"]["model/table"]
        assert meta["global_shape"] == [100, 4] and meta["global_offset"] == [34 * rank, 0]
        parts.append(doc["state"]["model"]["table"])
    assert torch.equal(torch.cat(parts), full)
    code, _, err = run(capsys, "restore", store, "--step", "20", "--out", str(out_dir),
                       "--world-size", "0")
    assert code == 1 and "--world-size must be >= 1, got 0" in err


def test_restore_reports_progress_per_file(store, tmp_path):
    """What the restore command's bar counts: the tensor bytes of each file once it is written."""
    from deltackpt.restore.files import write_step

    done: list[int] = []
    with Checkpointer(store, create=False) as ckpt:
        write_step(ckpt, 20, str(tmp_path / "ranks"), world_size=3, progress=done.append)
        assert done == [34 * 16, 34 * 16, 32 * 16]  # rows of 4 float32 each
        write_step(ckpt, 20, str(tmp_path / "one.pt"), progress=done.append)
    assert done[3:] == [100 * 16]


def test_compact_and_gc(store, capsys):
    code, out, _ = run(capsys, "compact", store, "--upto", "20", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["compacted"] and doc["chain_length"] == 2 and doc["gc"] is None
    code, out, _ = run(capsys, "compact", store, "--upto", "20")
    assert code == 0 and "nothing to do" in out
    code, out, _ = run(capsys, "gc", store, "--keep-last", "1", "--grace", "0", "--dry-run")
    assert code == 0 and "would remove 1 step record(s) [10]" in out
    code, out, _ = run(capsys, "gc", store, "--keep-last", "1", "--grace", "0", "--json")
    doc = json.loads(out)
    assert doc["dropped_steps"] == [10] and len(doc["deleted"]) == 1 and doc["freed_bytes"] > 0
    code, out, _ = run(capsys, "verify", store)
    assert code == 0 and "verified 1 step(s)" in out
    code, _, err = run(capsys, "gc", store, "--keep-every", "2")
    assert code == 1 and "need --keep-last" in err
