"""A store on disk is untrusted input: hostile records and layouts, built here from the format
documentation, must never make a read, verify or gc touch anything outside the store, allocate
beyond what the store's real files justify, or hang; each fails with a typed one-line error."""

from __future__ import annotations

import errno
import json
import os
import shutil

import numpy as np
import pytest
import torch
from hostile import (chunk_file, cli, exit_code, one_line_error, python, read_record, record_path,
                     set_chunk, set_packed_chunk, snapshot, write_record)
from numcodecs import Blosc

from deltackpt import (Checkpointer, DeltackptError, IntegrityError, LocalStorage, ManifestError,
                       Retention, StateError, StoreError)

ROWS = 64


def state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {
        "table": torch.randn(ROWS, 8, generator=gen),  # raw float chunks, 4 rows (128 B) each
        "ids": torch.arange(ROWS * 4, dtype=torch.int64) * (step + 1),  # blosc-coded chunks
        "dense": torch.randn(100, generator=gen),
        "step": step,
    }


@pytest.fixture
def store(tmp_path):
    """A store with a base at step 0 and a delta at step 1, and a sibling folder outside it."""
    root = tmp_path / "store"
    with Checkpointer(root, chunk_bytes=128, memory_budget=1 << 16) as ckpt:
        ckpt.save(0, state(0))
        s = state(0)
        s["table"][3] += 1
        ckpt.save(1, s)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("must survive")
    return root


def outside_of(root):
    return root.parent / "outside"


# -- 1. paths outside the store ----------------------------------------------------------------


@pytest.mark.parametrize("bad", ["..", ".", "", "a\x00b", "zarr.json", "x" * 300])
@pytest.mark.parametrize("nested", [False, True])
def test_save_refuses_keys_that_are_no_file_name(tmp_path, bad, nested):
    root = tmp_path / "store"
    t = torch.ones(4)
    st = {"m": {bad: t}} if nested else {bad: t, "ok": t.clone()}
    with Checkpointer(root) as ckpt:
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(StateError, match="key"):
            ckpt.save(0, st)
        assert ckpt.steps() == []
    assert sorted(os.listdir(tmp_path)) == before
    assert not list(root.glob("commits/*.json"))


@pytest.mark.parametrize("bad", ["pack.0", "parts.0", "parts.17", "hashes.0"])
def test_save_refuses_top_level_keys_that_name_a_ranks_own_files(tmp_path, bad):
    """A save attempt's folder holds each rank's pack, part table and row hashes beside the tensors'
    folders: a large top-level tensor of that name would collide with them. Nested, the name is
    an ordinary one."""
    root = tmp_path / "store"
    big = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB: a folder of its own, not packed
    with Checkpointer(root) as ckpt:
        with pytest.raises(StateError, match=f"{bad}.*reserved"):
            ckpt.save(0, {bad: big, "ok": torch.ones(4)})
        assert ckpt.steps() == []
        ckpt.save(1, {"m": {bad: big}, "ok": torch.ones(4)})
        out = {"m": {bad: torch.zeros_like(big)}, "ok": torch.zeros(4)}
        ckpt.restore(out, 1)
        assert torch.equal(out["m"][bad], big)


def _rename_tensor(doc: dict, old: str, new: str) -> None:
    doc["tensors"][new] = doc["tensors"].pop(old)
    text = json.dumps(doc["tree"]).replace(json.dumps({"tensor": old}), json.dumps({"tensor": new}))
    doc["tree"] = json.loads(text)


@pytest.mark.parametrize("tree", ["twice", "unnamed"])
def test_a_record_tree_names_each_tensor_once(store, tree):
    # A tree naming "table" in the place of "dense" loaded one tensor object in two places, and
    # the saved "dense" nowhere; verify passed it.
    doc = read_record(store, 0)
    text = json.dumps(doc["tree"]).replace(json.dumps({"tensor": "dense"}), json.dumps({"tensor": "table"}))
    doc["tree"] = json.loads(text)
    if tree == "unnamed":  # "dense" left out of the tree
        doc["tree"]["dict"] = [item for item in doc["tree"]["dict"] if item[0] != "dense"]
    write_record(store, 0, doc)
    why = "tensor 'table' is named twice" if tree == "twice" else "does not name tensor 'dense'"
    with Checkpointer(store, create=False) as ckpt:
        with pytest.raises(ManifestError, match=why):
            ckpt.load(0)
        assert [p.kind for p in ckpt.verify(0).problems] == ["record"]


def test_record_keys_that_leave_the_store_are_refused(store):
    doc = read_record(store, 0)
    outside = outside_of(store)
    # Make the escape work on a reader that trusts the key: the tensor's folder, copied outside.
    shutil.copytree(store / "steps" / doc["attempt"] / "table", outside / "table")
    _rename_tensor(doc, "table", "../../../outside/table")
    write_record(store, 0, doc)
    before = snapshot(outside)
    with Checkpointer(store, create=False) as ckpt:
        with pytest.raises(ManifestError, match="outside/table"):
            ckpt.load(0)
        report = ckpt.verify(0)
        assert [p.kind for p in report.problems] == ["record"]
    one_line_error(cli("restore", str(store), "--step", "0", "--out", str(store.parent / "o.pt")))
    one_line_error(cli("compact", str(store), "--upto", "0"))
    assert snapshot(outside) == before


@pytest.mark.parametrize("name", ["c.99.0", None])
def test_record_chunk_names_outside_the_grid_are_refused(store, name):
    """A part table names a chunk by its array and grid index, so a name can only be a chunk
    key of the part's arrays (no ``..``, NUL or other folder); one past the grid, or a grid left
    incomplete (None: a chunk dropped), is refused. Array indexes past the part's arrays are
    ``tests/unit/test_manifest.py::test_a_hostile_table_is_refused_naming_it``."""
    doc = read_record(store, 0)
    chunks = doc["tensors"]["table"]["parts"][0]["chunks"]
    entry = chunks.pop("c.1.0")
    if name is not None:
        chunks[name] = entry
    write_record(store, 0, doc)
    with Checkpointer(store, create=False) as ckpt, pytest.raises(ManifestError):
        ckpt.load(0)


def test_storage_keeps_every_key_under_its_root(tmp_path):
    storage = LocalStorage(tmp_path / "store")
    for key in ("../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "a\x00b", ""):
        with pytest.raises(StoreError):
            storage.read(key)
        with pytest.raises(StoreError):
            storage.write(key, [memoryview(b"x")])
        with pytest.raises(StoreError):
            storage.delete_tree(key)
    assert os.listdir(tmp_path) in ([], ["store"])
    assert not (tmp_path / "x").exists()


# -- 2. links -------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["steps", "commits", "bases"])
def test_gc_refuses_a_store_whose_layout_folder_is_a_link(store, folder):
    outside = outside_of(store)
    (store / "bases").mkdir(exist_ok=True)
    target = outside / folder
    shutil.copytree(store / folder, target)
    (target / "stray.tmp").write_text("victim")
    (target / ".tmp-victim").write_text("victim")
    shutil.rmtree(store / folder)
    os.symlink(target, store / folder)
    before = snapshot(outside)
    with Checkpointer(store, create=False) as ckpt, pytest.raises(StoreError, match=folder):
        ckpt.gc(Retention(keep_last=1), grace_seconds=0)
    one_line_error(cli("gc", str(store), "--keep-last", "1", "--grace", "0"))
    assert snapshot(outside) == before


def test_gc_removes_a_linked_entry_without_following_it(store):
    outside = outside_of(store)
    (outside / "victim").mkdir()
    (outside / "victim" / "data").write_text("victim")
    os.symlink(outside / "victim", store / "steps" / "9-aaaaaaaaaaaa")
    os.symlink(outside / "keep.txt", store / "commits" / ".00000000000000000009.json.x.tmp")
    before = snapshot(outside)
    with Checkpointer(store, create=False) as ckpt:
        report = ckpt.gc(Retention(keep_last=2), grace_seconds=0)
    assert "steps/9-aaaaaaaaaaaa" in report.deleted
    assert not os.path.lexists(store / "steps" / "9-aaaaaaaaaaaa")
    assert snapshot(outside) == before


def test_linked_records_and_chunks_are_not_read(store):
    outside = outside_of(store)
    doc = read_record(store, 0)
    # A record that is a link to a valid record outside the store.
    shutil.copy(record_path(store, 1), outside / "record.json")
    record_path(store, 1).unlink()
    os.symlink(outside / "record.json", record_path(store, 1))
    # A chunk that is a link to a copy of itself outside.
    chunk = chunk_file(store, doc, "table", "c.2.0")
    shutil.copy(chunk, outside / "c.2.0")
    chunk.unlink()
    os.symlink(outside / "c.2.0", chunk)
    with Checkpointer(store, create=False) as ckpt:
        assert 1 not in ckpt.steps()
        with pytest.raises(DeltackptError, match="c.2.0"):
            ckpt.load(0)
        report = ckpt.verify(0)
        assert any("c.2.0" in p.key for p in report.problems)


# -- 5. memory and time from numbers in a record ----------------------------------------------


def test_huge_shape_with_tiny_chunks_is_refused_quickly(store):
    doc = read_record(store, 0)
    rec = doc["tensors"]["table"]
    rec["shape"] = [1 << 40, 8]
    rec["parts"][0]["shape"] = [1 << 40, 8]
    rec["parts"][0]["chunk_shape"] = [1, 8]
    write_record(store, 0, doc)
    assert len(record_path(store, 0).read_bytes()) < 8000
    line = one_line_error(cli("restore", str(store), "--step", "0", "--out", str(store.parent / "o.pt")))
    assert "table" in line


def test_huge_shape_with_few_chunks_allocates_nothing(store):
    doc = read_record(store, 0)
    rec = doc["tensors"]["table"]
    rec["shape"] = [1 << 38, 8]  # 8 TiB of float32, in chunks of 1 << 36 rows
    rec["parts"][0]["shape"] = [1 << 38, 8]
    rec["parts"][0]["chunk_shape"] = [1 << 36, 8]
    chunks = rec["parts"][0]["chunks"]
    for i in range(4):
        chunks[f"c.{i}.0"] = chunks.get(f"c.{i}.0", chunks["c.0.0"])
    write_record(store, 0, doc)
    one_line_error(cli("restore", str(store), "--step", "0", "--out", str(store.parent / "o.pt")))


def _bomb(nbytes: int) -> bytes:
    codec = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE, typesize=8, blocksize=0)
    return bytes(codec.encode(np.zeros(nbytes, np.uint8)))


@pytest.mark.parametrize("decoded", [1 << 30, 2048], ids=["1GiB", "2KiB"])
def test_blosc_bomb_with_a_matching_checksum_is_not_decompressed(store, decoded):
    """A chunk of ``ids`` holds 16 int64 (128 B). A bomb larger than that place can hold is
    refused with the record; one small enough to fit is refused from its header, unread."""
    bomb = _bomb(decoded)
    assert len(bomb) < decoded // 14
    set_chunk(store, 0, "ids", "c.0", bomb)
    code = (
        "import resource\n"
        "from deltackpt import Checkpointer, DeltackptError\n"
        f"ckpt = Checkpointer({str(store)!r}, create=False)\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    ckpt.load(0)\n"
        "except DeltackptError as e:\n"
        "    print(type(e).__name__, e)\n"
        "print('grew_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)\n"
        "print('verify', [p.kind for p in ckpt.verify(0).problems])\n"
    )
    proc = python(code)
    assert exit_code(proc) == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    small = decoded < 1 << 20
    assert out[0].startswith("IntegrityError" if small else "ManifestError") and "ids" in out[0], out
    assert int(out[1].split()[1]) < 64 * 1024, out  # far less than 1 GiB
    assert out[2] == ("verify ['corrupt']" if small else "verify ['record']"), out


def test_coded_chunk_whose_body_does_not_decode_is_corrupt(store):
    """A blosc chunk of ``ids`` with a sound header and a damaged body (its checksum matching)
    fails as corrupt, on every path that reads it, not with the codec's own error."""
    codec = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE, typesize=8, blocksize=0)
    coded = bytearray(codec.encode(np.arange(16, dtype=np.int64).view(np.uint8)))
    coded[16] ^= 0xFF  # the first byte after the 16-byte header
    with pytest.raises(RuntimeError):
        codec.decode(bytes(coded))
    set_chunk(store, 0, "ids", "c.0", bytes(coded))
    with Checkpointer(store, create=False) as ckpt:
        with pytest.raises(IntegrityError, match="ids/c.0 is corrupt: does not decode"):
            ckpt.load(0)
        with pytest.raises(IntegrityError, match="does not decode"):
            ckpt.restore(state(0), 0)
        assert [p.kind for p in ckpt.verify(0).problems] == ["corrupt"]


def test_verify_refuses_the_row_ids_restore_refuses(store):
    """A delta's id past its part's last row, checksums matching (the part of ``table`` at step
    1 holds one changed row): restore refuses it, and so does verify, naming the ids."""
    codec = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE, typesize=8, blocksize=0)
    set_packed_chunk(store, 1, "table", "ids/c.0", bytes(codec.encode(np.array([ROWS], np.int64))))
    with Checkpointer(store, create=False) as ckpt:
        with pytest.raises(IntegrityError, match="row ids outside the part"):
            ckpt.load(1)
        problems = ckpt.verify(1).problems
    assert [(p.kind, p.key.rsplit("/", 2)[-2:]) for p in problems] == [("corrupt", ["table", "ids"])]


def test_verify_refuses_a_delta_whose_tensor_shape_differs_from_its_base(store):
    doc = read_record(store, 1)
    doc["tensors"]["table"]["shape"] = [ROWS, 16]  # its base's is [ROWS, 8]
    write_record(store, 1, doc)
    with Checkpointer(store, create=False) as ckpt:
        with pytest.raises(IntegrityError, match="shape differs along the chain"):
            ckpt.load(1)
        problems = ckpt.verify(1).problems
    assert [(p.kind, p.key) for p in problems] == [("record", "table")], problems
    assert "[64, 16] at step 1, float32 [64, 8] in its base, step 0" in problems[0].detail


def test_a_delta_that_left_a_tensor_as_it_was_cannot_give_it_another_shape(tmp_path):
    """Step 1 leaves ``dense`` as it was, and a load through it to step 2 skips its record of
    ``dense`` unread: skipped only once it gives the shape of the step read."""
    with Checkpointer(tmp_path, chunk_bytes=128, memory_budget=1 << 16) as ckpt:
        s = state(0)
        for step in range(3):
            s["table"][step] += 1
            ckpt.save(step, s)
    doc = read_record(tmp_path, 1)
    assert not any(p["changed"] or p["chunks"] for p in doc["tensors"]["dense"]["parts"])
    doc["tensors"]["dense"]["shape"] = [50]
    doc["tensors"]["dense"]["parts"][0]["shape"] = [50]
    write_record(tmp_path, 1, doc)
    with Checkpointer(tmp_path, create=False) as ckpt:
        with pytest.raises(IntegrityError, match="shape differs along the chain"):
            ckpt.load(2)


@pytest.mark.parametrize("where", ["record", "chunk"])
def test_fifo_instead_of_a_file_does_not_hang(store, where):
    doc = read_record(store, 0)
    path = record_path(store, 1) if where == "record" else chunk_file(store, doc, "table", "c.1.0")
    path.unlink()
    os.mkfifo(path)
    proc = cli("ls", str(store), "--json")
    assert exit_code(proc) == 0, proc.stderr
    rows = {r["step"]: r for r in json.loads(proc.stdout)}
    assert rows[0]["kind"] == "base"
    if where == "record":
        assert 1 not in rows  # no regular file: no record
    else:
        one_line_error(cli("restore", str(store), "--step", "0", "--out", str(store.parent / "o.pt")))
        proc = cli("verify", str(store), "--json")
        assert exit_code(proc) == 1
        assert any("c.1" in p["key"] for p in json.loads(proc.stdout)["problems"])


def test_endless_device_as_record_or_chunk_is_refused(store):
    doc = read_record(store, 0)
    chunk = chunk_file(store, doc, "table", "c.1.0")
    chunk.unlink()
    os.symlink("/dev/zero", chunk)
    record_path(store, 1).unlink()
    os.symlink("/dev/zero", record_path(store, 1))
    proc = cli("ls", str(store), "--json")
    assert exit_code(proc) == 0, proc.stderr[-2000:]
    one_line_error(cli("restore", str(store), "--step", "0", "--out", str(store.parent / "o.pt")))


def test_records_larger_than_the_cap_are_refused_unread(store):
    from deltackpt.format.limits import MAX_RECORD_BYTES

    path = record_path(store, 1)
    with open(path, "r+b") as f:
        f.truncate(MAX_RECORD_BYTES + 1)  # sparse: no disk space, no memory
    proc = cli("ls", str(store), "--json")
    assert exit_code(proc) == 0, proc.stderr[-2000:]
    rows = {r["step"]: r for r in json.loads(proc.stdout)}
    assert rows[1]["kind"] == "unreadable" and "too large" in rows[1]["error"]


# -- 8. listing and verify ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["\u0669" * 20 + ".json", "99999999999999999999.json",
                                  "09223372036854775807.json"])
def test_stray_entries_in_commits_are_no_steps(store, name):
    stray = store / "commits" / name
    if name.startswith("0"):
        stray.mkdir()  # a folder named as a record
    else:
        stray.write_text("{}")
    with Checkpointer(store, create=False) as ckpt:
        assert ckpt.steps() == [0, 1]
        ckpt.restore(s := state(1), 1)
        ckpt.save(2, s)
        assert ckpt.latest_step() == 2


def test_ls_goes_on_past_an_unreadable_record(store):
    record_path(store, 1).unlink()
    record_path(store, 1).mkdir()  # reading it fails with EISDIR
    with Checkpointer(store, create=False) as ckpt:
        ckpt.restore(s := state(0), 0)
        s["table"][0] += 1
        ckpt.save(2, s)
    proc = cli("ls", str(store), "--json")
    assert exit_code(proc) == 0, proc.stderr
    assert [r["step"] for r in json.loads(proc.stdout) if r["kind"] != "unreadable"] == [0, 2]


def test_duplicate_json_keys_are_refused(store):
    text = record_path(store, 1).read_text()
    assert text.endswith("}")
    write_record(store, 1, text[:-1] + ',"step":1}')
    with Checkpointer(store, create=False) as ckpt, pytest.raises(ManifestError, match="step"):
        ckpt.load(1)


@pytest.mark.parametrize("data", [b"", b"\x00" * 64], ids=["zero-size", "short"])
def test_verify_fails_what_restore_rejects(store, data):
    set_chunk(store, 0, "table", "c.1.0", data)
    with Checkpointer(store, create=False) as ckpt:
        with pytest.raises(DeltackptError):
            ckpt.load(0)
        assert not ckpt.verify(0).ok


class _FailingReads(LocalStorage):
    """Reading any file whose key ends with one of ``bad`` fails with EIO."""

    def __init__(self, root, bad):
        super().__init__(root)
        self.bad = bad

    def read_into(self, key, out, offset=0):
        if key.endswith(self.bad):
            raise StoreError(errno.EIO, f"injected I/O error: {key}")
        return super().read_into(key, out, offset)


def test_verify_lists_every_unreadable_file(store):
    with Checkpointer(_FailingReads(store, ("c.1.0", "c.2.0")), create=False) as ckpt:
        report = ckpt.verify()
    keys = sorted(p.key for p in report.problems if p.kind == "unreadable")
    assert [p.kind for p in report.problems if p.step == 1] == ["chain"]  # its base is damaged
    assert len(keys) == 2 and keys[0].endswith("table/c.1.0") and keys[1].endswith("table/c.2.0"), keys


# -- 9. restore --out --------------------------------------------------------------------------


def test_restore_into_an_existing_folder_leaves_nothing_behind(store, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    one_line_error(cli("restore", str(store), "--step", "1", "--out", str(out)))
    assert os.listdir(out) == []
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_restore_into_a_missing_folder_is_one_line(store, tmp_path):
    line = one_line_error(cli("restore", str(store), "--step", "1", "--out", str(tmp_path / "no" / "x.pt")))
    assert "no" in line
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:-8], r"lists a part table of \d+ bytes, it has \d+"),
    (lambda data: data[:40] + bytes([data[40] ^ 1]) + data[41:], "does not match its checksum"),
])
def test_a_damaged_part_table_is_refused_naming_it_while_ls_and_other_steps_go_on(store, damage, message):
    attempt = json.loads(record_path(store, 1).read_bytes())["attempt"]
    table = store / "steps" / attempt / "parts.0"
    data = damage(table.read_bytes())
    table.unlink()
    table.write_bytes(data)
    with Checkpointer(store, create=False) as ckpt:
        with pytest.raises(ManifestError, match=rf"steps/{attempt}/parts\.0: .*{message}"):
            ckpt.load(1)
        assert torch.equal(ckpt.load(0)["table"], state(0)["table"])
        problems = ckpt.verify(1).problems
        assert [p.kind for p in problems] == ["record"] and "parts.0" in problems[0].detail
    proc = cli("ls", str(store), "--json")  # roots only: both steps listed as saved
    assert exit_code(proc) == 0 and [r["kind"] for r in json.loads(proc.stdout)] == ["base", "delta"]
