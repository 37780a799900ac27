"""Quantization rules: patterns, the restore-count rule and its reasons, and bad input."""

from __future__ import annotations

import pytest
import torch

import deltackpt
from deltackpt.quantization import (ByRestores, QuantizationError, QuantizePlan, Rowwise,
                                    quantizable)


def test_exact_by_default_and_first_match_wins():
    assert not QuantizePlan(None)
    q = QuantizePlan({"model/emb.0*": Rowwise(bits=4), "model/emb*": Rowwise(bits=8)})
    assert q.choose("model/emb.0.weight", restores=0).rule == Rowwise(4)
    assert q.choose("model/emb.1.weight", restores=0).rule == Rowwise(8)
    assert q.choose("model/mlp.weight", restores=0) is None
    # Optimizer state is exact unless a pattern names it.
    assert q.choose("optim/state/0/momentum_buffer", restores=0) is None
    assert QuantizePlan({"optim/*": Rowwise()}).choose("optim/state/0/m", restores=0).pattern == "optim/*"


def test_public_names():
    assert deltackpt.Rowwise is Rowwise
    assert deltackpt.ByRestores is ByRestores
    assert issubclass(deltackpt.QuantizationError, deltackpt.DeltackptError)


@pytest.mark.parametrize("bits, adaptive, scheme", [(8, False, "rowwise8"), (4, False, "rowwise4"),
                                                    (4, True, "rowwise4a"), (2, True, "rowwise2a")])
def test_scheme_names_round_trip(bits, adaptive, scheme):
    assert Rowwise(bits, adaptive).scheme == scheme
    assert Rowwise.from_scheme(scheme) == Rowwise(bits, adaptive)


@pytest.mark.parametrize("kwargs, match", [({"bits": 3}, "bits must be one of"),
                                           ({"bits": 8, "adaptive": True}, "4 bits or fewer"),
                                           ({"adaptive": 1}, "must be a bool")])
def test_bad_rowwise(kwargs, match):
    with pytest.raises(QuantizationError, match=match):
        Rowwise(**kwargs)


def test_bad_plans():
    with pytest.raises(QuantizationError, match="non-empty strings"):
        QuantizePlan({"": Rowwise()})
    with pytest.raises(QuantizationError, match="must be deltackpt.Rowwise"):
        QuantizePlan({"a*": 8})
    with pytest.raises(QuantizationError, match="unknown quantization scheme"):
        Rowwise.from_scheme("rowwise16")
    with pytest.raises(QuantizationError, match="expected must be an int"):
        ByRestores(expected=-1)


@pytest.mark.parametrize("expected, restores, bits", [(0, 0, 2), (1, 0, 2), (3, 0, 4), (20, 5, 4),
                                                      (21, 0, 8), (1, 1, 4), (1, 2, 4),
                                                      (20, 20, 8)])
def test_by_restores_tiers_and_raising(expected, restores, bits):
    rule, reason = ByRestores(expected=expected).decide(restores)
    assert rule.bits == bits
    assert rule.adaptive == (bits < 8)
    assert ("use up" in reason) == (restores >= expected)


def test_choice_records_reason():
    q = QuantizePlan({"*emb*": ByRestores(expected=1)})
    doc = q.choose("model/emb.weight", restores=1).to_doc()
    assert doc["scheme"] == "rowwise4a" and doc["pattern"] == "*emb*"
    assert "1 restores so far use up the 1 expected" in doc["reason"]


def test_quantizable():
    quantizable("t", torch.bfloat16, (4, 3))
    with pytest.raises(QuantizationError, match="'t', a torch.int64 tensor"):
        quantizable("t", torch.int64, (4, 3))
    with pytest.raises(QuantizationError, match="two or more dimensions"):
        quantizable("t", torch.float32, (4,))
