"""Format-5 records: a quantized step's record round-trips, and damage to its lossy fields
raises ManifestError naming the record, never another exception."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltackpt import Checkpointer, ManifestError, Rowwise
from deltackpt.format.manifest import LOSSY_FORMAT
from hostile import parse_doc


class _Deltas:
    name = "deltas"

    def decide(self, chain, delta_bytes, full_bytes):
        from deltackpt import Decision

        return Decision("delta", "always")


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    with Checkpointer(path, policy=_Deltas(), quantize={"w": Rowwise(bits=4, adaptive=True)}) as ckpt:
        w = torch.randn(40, 3)
        ckpt.save(0, {"w": w, "v": torch.zeros(5)})
        w[3] += 1
        assert ckpt.save(1, {"w": w, "v": torch.ones(5)}).kind == "delta"
        return ckpt.store.manifest(1).to_doc()


def test_round_trip(record):
    assert record["format"] == LOSSY_FORMAT and record["lossy"] is True
    assert record["tensors"]["w"]["encoding"] == "qrows"
    m = parse_doc(record)
    assert m.to_doc() == record
    assert m.tensors["w"].lossy.scheme == "rowwise4a" and m.tensors["v"].lossy is None


@pytest.mark.parametrize("patch, message", [
    (lambda d: d["tensors"]["w"].pop("lossy"), "needs a 'lossy' record"),
    (lambda d: d["tensors"]["w"]["lossy"].update(scheme="rowwise16"), "unknown quantization scheme"),
    (lambda d: d["tensors"]["w"]["lossy"].update(scheme=None), "disagree"),
    (lambda d: d["tensors"]["w"]["lossy"].update(bound=-1.0), "'bound' has a bad value"),
    (lambda d: d["tensors"]["w"]["lossy"].update(chain_bound=0.0), "disagree"),
    (lambda d: d["tensors"]["v"].update(lossy={"scheme": "rowwise8", "bound": 0, "chain_bound": 0}),
     "disagree"),
    (lambda d: d.update(lossy=False), "'lossy' disagrees"),
    (lambda d: d["quantize"].update(restores=-2), "'restores' is out of range"),
    (lambda d: d["quantize"]["tensors"].update(nope={"pattern": "*", "scheme": "x", "reason": ""}),
     "bad entry for 'nope'"),
    (lambda d: d["tensors"]["w"]["parts"][0].update(changed=41), "does not fit"),  # of 40 rows
    (lambda d: d.update(format=4), "needs a 'lossy' record"),  # format 4 holds no loss
    (lambda d: d.update(format=3), "format 3 is not supported"),
])
def test_named_fields(record, patch, message):
    doc = json.loads(json.dumps(record))
    patch(doc)
    with pytest.raises(ManifestError, match=message):
        parse_doc(doc)


json_values = st.none() | st.booleans() | st.integers(-5, 2**70) | st.floats() | st.text(max_size=8)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["scheme", "bound", "chain_bound"]), value=json_values)
def test_any_lossy_value_parses_or_raises_manifest_error(record, field, value):
    doc = json.loads(json.dumps(record))
    doc["tensors"]["w"]["lossy"][field] = value
    try:
        parse_doc(doc)  # NaN and infinities go into the root as JSON cannot hold them
    except ManifestError:
        pass
