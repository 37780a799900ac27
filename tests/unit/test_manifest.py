"""Commit records: a damaged record raises ManifestError naming the record and the field,
never another exception, and a damaged record of one step leaves the others readable."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltackpt import Checkpointer, DeltackptError, ManifestError, statetree
from deltackpt.format.layout import commit_key
from deltackpt.format.record_checks import parse_manifest


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    with Checkpointer(path) as ckpt:
        w = torch.zeros(40, 3)
        ckpt.save(0, {"w": w, "v": torch.zeros(5), "step": 0})
        w[3] = 1
        assert ckpt.save(1, {"w": w, "v": torch.ones(5), "step": 1}).kind == "delta"
        return json.loads(ckpt.store.manifest(1).to_json())


def test_round_trip(record):
    m = parse_manifest(json.dumps(record).encode(), "r")
    assert json.loads(m.to_json()) == record


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
def test_mutated_records_raise_manifest_error(record, data):
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
        m = parse_manifest(json.dumps(doc).encode(), "r")
    except ManifestError as e:
        assert str(e).startswith("r: ")
    else:
        statetree.build(m.tree, {k: k for k in m.tensors})  # an accepted record is usable


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), junk=st.binary(max_size=40))
def test_truncated_or_garbage_bytes(record, cut, junk):
    raw = json.dumps(record).encode()
    for data in (raw[: cut % len(raw)], junk, raw[: cut % len(raw)] + junk):
        try:
            parse_manifest(data, "r")
        except ManifestError:
            pass


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"format": 1}, "format 1 is not supported"),
        ({"step": -1}, "'step' is out of range"),
        ({"kind": "full"}, "'kind' must be one of"),
        ({"parent": None}, "disagrees with parent"),
        ({"attempt": "../x"}, "'attempt' has a bad value"),
        ({"bytes_written": 2**64}, "out of range"),
        ({"tensors": {"w": {"dtype": "float32"}}}, "tensor 'w': field 'shape' is missing"),
    ],
)
def test_named_fields(record, patch, message):
    with pytest.raises(ManifestError, match=message):
        parse_manifest(json.dumps({**record, **patch}).encode(), "commits/x.json")


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
