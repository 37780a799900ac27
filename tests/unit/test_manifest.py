"""Commit records: a damaged root record or part table raises ManifestError naming the record
or the table and the field, never another exception, and a damaged record of one step leaves
the others readable."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltackpt import Checkpointer, DeltackptError, ManifestError, statetree
from deltackpt.format.layout import commit_key
from deltackpt.format.part_tables import COLUMNS, HEADER
from deltackpt.format.record_checks import parse_manifest
from deltackpt.format.record_io import encode_record
from hostile import parse_doc


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """Step 1's root record (as a document) and part tables, by rank."""
    path = tmp_path_factory.mktemp("store")
    with Checkpointer(path) as ckpt:
        w = torch.zeros(40, 3)
        ckpt.save(0, {"w": w, "v": torch.zeros(5), "step": 0})
        w[3] = 1
        assert ckpt.save(1, {"w": w, "v": torch.ones(5), "step": 1}).kind == "delta"
        root, tables = encode_record(ckpt.store.manifest(1))
        return unsealed(root), tables


@pytest.fixture
def record(stored):
    return stored[0]


def unsealed(root: bytes) -> dict:
    """A root's document without its ``checksum``, after checking it: a root written before
    checksums, which the tests below change at will."""
    doc = json.loads(root)
    assert doc.pop("checksum") == xxhash.xxh3_64_hexdigest(root[: root.rindex(b',"checksum"')] + b"}")
    return doc


def parse(doc: dict, tables: dict[int, bytes], where: str = "r"):
    """Parses a root with these tables, every tensor's parts read."""
    def read(key, size, digest):
        data = tables[int(key.rsplit(".", 1)[1])]
        if len(data) != size or xxhash.xxh3_64_hexdigest(data) != digest:
            raise ManifestError(f"{key}: does not match its checksum")
        return data
    m = parse_manifest(json.dumps(doc).encode(), where, read)
    for rec in m.tensors.values():
        tuple(rec.parts)
    return m


def test_round_trip(stored):
    m = parse(*stored)
    root, tables = encode_record(m)
    assert (unsealed(root), tables) == stored
    assert parse_doc(m.to_doc()).to_doc() == m.to_doc()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths(v, (*prefix, i))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_records_raise_manifest_error(stored, data):
    record, tables = stored
    doc = json.loads(json.dumps(record))
    where = data.draw(st.sampled_from(list(paths(doc))[1:]))
    parent = doc
    for k in where[:-1]:
        parent = parent[k]
    if data.draw(st.booleans()):
        parent[where[-1]] = data.draw(json_values)
    elif isinstance(parent, dict):
        del parent[where[-1]]
    try:
        m = parse(doc, tables)
    except ManifestError as e:
        assert str(e).startswith(("r: ", "steps/")), e
    else:
        statetree.build(m.tree, {k: k for k in m.tensors})  # an accepted record is usable


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), junk=st.binary(max_size=40))
def test_truncated_or_garbage_bytes(stored, cut, junk):
    record, tables = stored
    raw = json.dumps(record).encode()
    for data in (raw[: cut % len(raw)], junk, raw[: cut % len(raw)] + junk):
        try:
            parse_manifest(data, "r", lambda *a: b"")
        except ManifestError:
            pass
    # A table cut short or grown, its checksum in the root made to agree: refused by its length.
    table = tables[0]
    for data in (table[: cut % len(table)], junk, table[: cut % len(table)] + junk, table + junk):
        doc = json.loads(json.dumps(record))
        doc["tables"][0][1:] = [len(data), xxhash.xxh3_64_hexdigest(data)]
        if data != table:
            with pytest.raises(ManifestError, match=r"steps/\S+/parts\.0: "):
                parse(doc, {0: data})


def column(table: bytes, name: str) -> tuple[int, int]:
    """Where column ``name`` lies in a table: its first byte and its dtype's size."""
    parts, dims, chunks = struct.unpack_from("<3Q", table, 8)
    counts = {"parts": parts, "dims": dims, "chunks": chunks}
    at = HEADER
    for n, dtype, count in COLUMNS:
        if n == name:
            return at, np.dtype(dtype).itemsize
        at += np.dtype(dtype).itemsize * counts[count]
    raise KeyError(name)


def with_value(stored, name: str, value: int, row: int = 0) -> tuple[dict, dict[int, bytes]]:
    """The record with row ``row`` of column ``name`` of rank 0's table set to ``value``, the
    table's size and checksum in the root made to agree (only the column is hostile)."""
    record, tables = stored
    at, size = column(tables[0], name)
    dtype = dict((n, d) for n, d, _ in COLUMNS)[name]
    data = bytearray(tables[0])
    data[at + row * size: at + (row + 1) * size] = np.array([value], dtype=dtype).tobytes()
    doc = json.loads(json.dumps(record))
    doc["tables"][0][1:] = [len(data), xxhash.xxh3_64_hexdigest(bytes(data))]
    return doc, {0: bytes(data)}


@pytest.mark.parametrize("name, value, message", [
    ("tensor", 7, "names tensor 7 of 2"),
    ("path", -2, "path index is out of range"),
    ("changed", -1, "changed count is out of range"),
    ("nchunks", 1 << 40, "do not add up"),
    ("nchunks", -1, "do not add up"),
    ("dims", -1, "a dims value is out of range"),
    ("dims", 1 << 62, "a dims value is out of range"),
    ("dims", 1 << 40, "is outside"),  # the first part's offset, far outside its tensor
    ("size", 1 << 62, "a size value is out of range"),
    ("at", 1 << 40, "outside pack.0"),
    ("at", -1, "disagrees with its part being packed"),
    ("array", 9, "chunk 0 of array 9 is not one of the part.s grid"),
    ("array", -2, "array index is out of range"),
    ("index", 1 << 40, "is not one of the part's grid"),
    ("packed", 2, "is packed"),
    ("cdims", 9, "boxes need"),
])
def test_a_hostile_table_is_refused_naming_it(stored, name, value, message):
    doc, tables = with_value(stored, name, value)
    with pytest.raises(ManifestError, match=rf"^steps/\S+/parts\.0: .*{message}|^r: tensor '\w' .*\(table parts\.0\): .*{message}"):
        parse(doc, tables)


def test_a_huge_shape_in_a_table_is_refused_before_any_allocation(stored):
    doc, tables = with_value(stored, "dims", 1 << 61, row=3)  # the first part's shape[1]: [40, 3]
    with pytest.raises(ManifestError, match="is outside|does not fit"):
        parse(doc, tables)


def bare(doc: dict) -> dict:
    """``w``'s root fields, without its layout (as a record written before layouts has them)."""
    del doc["tensors"]["w"]["layout"]
    return doc["tensors"]["w"]


@pytest.mark.parametrize("patch, message", [
    (lambda d: d["tables"][0].__setitem__(2, "0" * 16), "does not match its checksum"),
    (lambda d: d["tables"].clear(), "is not in 'tables'"),
    (lambda d: bare(d).update(parts=2), "field 'parts' says 2"),
    (lambda d: d["tensors"]["w"].update(parts=2), "field 'layout' makes 1 parts listed by 1 writers, the tensor has 2"),
    (lambda d: d["tensors"]["w"].update(ranks=[[0, 0], [0, 1]]), "bad run"),
    (lambda d: d["tensors"]["w"].update(ranks=[]), "0 ranks"),
    (lambda d: bare(d).update(ranks=[[1, 1]]), "does not list rank 0"),
    (lambda d: d["tensors"]["w"].update(ranks=[[1, 1]]), "field 'layout' names other ranks than 'ranks'"),
    (lambda d: d["tables"].append([0, 1, "0" * 16]), "bad entry"),
])
def test_a_root_and_tables_that_disagree_are_refused(stored, patch, message):
    record, tables = stored
    doc = json.loads(json.dumps(record))
    patch(doc)
    with pytest.raises(ManifestError, match=message):
        parse(doc, tables)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_column_value_parses_or_raises_manifest_error(stored, data):
    name = data.draw(st.sampled_from([n for n, _, _ in COLUMNS]))
    value = data.draw(st.integers(-(2**15), 2**15) | st.integers(0, 2**62))
    dtype = np.dtype(dict((n, d) for n, d, _ in COLUMNS)[name])
    info = np.iinfo(dtype)
    doc, bad = with_value(stored, name, min(max(value, info.min), info.max))
    try:
        parse(doc, bad)
    except ManifestError:
        pass


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"format": 1}, "format 1 is not supported"),
        ({"format": 2}, "format 2 is not supported .*every part in the record"),
        ({"step": -1}, "'step' is out of range"),
        ({"kind": "full"}, "'kind' must be one of"),
        ({"parent": None}, "disagrees with parent"),
        ({"attempt": "../x"}, "'attempt' has a bad value"),
        ({"bytes_written": 2**64}, "out of range"),
        ({"tensors": {"w": {"dtype": "float32"}}}, "tensor 'w': field 'shape' is missing"),
    ],
)
def test_named_fields(stored, patch, message):
    record, tables = stored
    with pytest.raises(ManifestError, match=message):
        parse({**record, **patch}, tables, "commits/x.json")


def test_a_damaged_record_leaves_other_steps_readable(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, {"w": torch.zeros(2, 2)})
        ckpt.save(1, {"w": torch.ones(2, 2)})
        ckpt.save(2, {"w": torch.ones(2, 2) * 2})
    with open(os.path.join(tmp_path, *commit_key(2).split("/")), "w") as f:
        f.write('{"format": 2, "step": 99999999999999999999999}')
    with Checkpointer(tmp_path, create=False) as ckpt:
        assert ckpt.steps() == [0, 1, 2]
        assert ckpt.load(1)["w"].eq(1).all()
        with pytest.raises(DeltackptError, match="00000000000000000002.json"):
            ckpt.load(2)


def test_tensors_with_the_same_root_fields_are_checked_once(tmp_path, monkeypatch):
    # A state of thousands of small tensors holds a few distinct root entries: each is checked
    # once per record, and every tensor still gets its own parts.
    from deltackpt.format import record_checks

    state = {f"t{i}": torch.full((2, 3) if i % 2 else (4,), float(i)) for i in range(40)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, state)
        data = ckpt.store.storage.read(commit_key(0))
        checked = []
        real = record_checks._parse_tensor
        monkeypatch.setattr(record_checks, "_parse_tensor", lambda *a: checked.append(a[2]) or real(*a))
        m = ckpt.store.parse(commit_key(0), data)
    assert len(checked) == 2
    assert [p.path for p in m.tensors["t3"].parts] == [""] and m.tensors["t3"].shape == (2, 3)
    assert {k: (r.shape, len(r.parts)) for k, r in m.tensors.items()} == {
        k: (tuple(t.shape), 1) for k, t in state.items()}


@pytest.mark.parametrize("value", ["[40, 3]", [40.0, 3], [True, 3], [40, 3, None]])
def test_an_entry_like_a_valid_one_is_checked_on_its_own(stored, value):
    # Only equal entries share a check: one that differs in a type alone is refused.
    record, tables = stored
    doc = json.loads(json.dumps(record))
    doc["tensors"]["w2"] = dict(doc["tensors"]["w"], shape=value)
    with pytest.raises(ManifestError, match="tensor 'w2'"):
        parse(doc, tables)


def test_a_bad_node_deep_in_the_tree_is_named_by_its_path(stored):
    record, tables = stored
    doc = json.loads(json.dumps(record))
    doc["tree"] = {"dict": [["a", {"list": [{"value": 1}, {"dict": [[7, {"tensor": "nope"}]]}]}]]}
    with pytest.raises(ManifestError, match=r"r: field 'tree'/a/1/7: tensor 'nope' is not in 'tensors'"):
        parse(doc, tables)


def test_a_record_after_a_sound_one_is_checked_unless_its_keys_and_tree_are_the_same(stored):
    """A chain's records list the same keys and tree, checked once; a record that differs from
    the last sound one in either is checked in full."""
    record, tables = stored
    parse(record, tables)  # sound: its keys and tree are remembered
    m = parse(json.loads(json.dumps(record)), tables)  # equal: not checked again, parsed the same
    assert m.to_doc() == parse(record, tables).to_doc()
    renamed = json.loads(json.dumps(record))
    renamed["tree"] = {"dict": [[k, {"tensor": "v" if k == "w" else "w"} if "tensor" in n else n]
                                for k, n in record["tree"]["dict"]]}  # still sound: checked, kept
    parse(renamed, tables)
    for bad, why in ((dict(record, tree={"dict": [["w", {"tensor": "w"}]]}), "does not name tensor"),
                     (dict(record, tree={"dict": [["a", {"tensor": "nope"}]]}), "is not in 'tensors'")):
        with pytest.raises(ManifestError, match=why):
            parse(json.loads(json.dumps(bad)), tables)
    parse(record, tables)
    unnamed = json.loads(json.dumps(record))  # the last sound record's tree, one key more
    unnamed["tensors"]["x"] = unnamed["tensors"]["v"]
    with pytest.raises(ManifestError, match="does not name tensor 'x'"):
        parse(unnamed, tables)
    bad_key = json.loads(json.dumps(record))
    bad_key["tensors"]["a/../b"] = bad_key["tensors"].pop("v")
    bad_key["tree"] = json.loads(json.dumps(record["tree"]).replace('"tensor": "v"', '"tensor": "a/../b"'))
    with pytest.raises(ManifestError, match="no folder name"):
        parse(bad_key, tables)


def test_tensor_entries_are_what_json_dumps_makes_of_them():
    # Entries of equal fields share their encoding; keys are encoded one by one, as json.dumps
    # encodes them (quotes, backslashes, non-ASCII), and the whole is json.dumps's bytes.
    from deltackpt.format.encodings import choose
    from deltackpt.format.manifest import TensorRecord
    from deltackpt.format.part_layout import describe
    from deltackpt.format.record_io import tensor_entries
    from deltackpt.sharding import Box

    keys = ['plain', 'quo"te', 'back\\slash', 'ünï/cødé', 'tab\t', 'emoji 🏖️', 'same', 'same2']
    recs = {k: TensorRecord("float32", (4, 2) if i % 2 else (3,), choose("delta", (4, 2) if i % 2 else (3,), False), ())
            for i, k in enumerate(keys)}
    held = {k: (1, [0], None) for k in keys}
    held["same2"] = (2, [0, 1, 2, 5], describe((4, 2), [Box((0, 0), (2, 2)), Box((2, 0), (2, 2))], [0, 1]))
    want = {k: recs[k].root_doc() | {"parts": held[k][0], "ranks": [[r[0], r[-1]] for r in ([[0, 1, 2], [5]] if k == "same2" else [[0]])]}
            for k in keys}
    want["same2"]["layout"] = held["same2"][2].to_doc()
    assert tensor_entries(recs, held) == json.dumps(want, separators=(",", ":"), allow_nan=False)


@pytest.mark.parametrize("field, digit", [(b'"value":', 3), (b'"created":', 1)])
def test_a_root_damaged_anywhere_is_refused_by_its_checksum(tmp_path, field, digit):
    """A root ends with the checksum of the rest of its text: one digit changed in a value of
    the state or in the commit time still parses, and is refused rather than restored."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, {"w": torch.zeros(4), "lr": 0.01})
    path = os.path.join(tmp_path, *commit_key(0).split("/"))
    with open(path, "rb") as f:
        data = f.read()
    at = data.index(field) + len(field) + digit  # a digit of the value, not its first
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
    with Checkpointer(tmp_path, create=False) as ckpt:
        with pytest.raises(ManifestError, match=r"commits/0+\.json: the record does not match its checksum"):
            ckpt.load(0)
        assert [p.kind for p in ckpt.verify(0).problems] == ["record"]


@pytest.mark.parametrize("checksum", ["first", "absent"])
def test_a_checksum_not_last_is_refused_and_a_root_without_one_reads(tmp_path, checksum):
    """The checksum must be the text's last field; a root with none (written before roots had
    one) is read as it is."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, {"w": torch.arange(4.0)})
    path = os.path.join(tmp_path, *commit_key(0).split("/"))
    with open(path, "rb") as f:
        doc = unsealed(f.read())
    if checksum == "first":
        doc = {"checksum": "0" * 16, **doc}
    os.unlink(path)
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    with Checkpointer(tmp_path, create=False) as ckpt:
        if checksum == "first":
            with pytest.raises(ManifestError, match="field 'checksum' must end the record"):
                ckpt.load(0)
        else:
            assert torch.equal(ckpt.load(0)["w"], torch.arange(4.0))
