"""Row hash files and the root's ``hashes`` field, read as untrusted input: anything but what
``docs/format.md`` ("Row hashes") describes is refused with a ManifestError naming the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from deltackpt import Checkpointer, ManifestError
from deltackpt.format.hash_files import HASHED_ROW_BYTES, decode_hashes, digest, encode_hashes
from deltackpt.format.limits import key_problem
from hostile import parse_doc, read_record


def test_round_trip():
    a, b = torch.tensor([1, -2, 2**63 - 1]), torch.empty(0, dtype=torch.int64)
    pieces = encode_hashes([(3, -1, a), (0, 7, b)])
    data = b"".join(pieces)
    assert len(data) == 16 + 24 * 2 + 8 * 3
    assert digest(pieces) == (len(data), xxhash.xxh3_64_hexdigest(data))
    got = decode_hashes(data, "f", 4)
    assert got.keys() == {(3, -1), (0, 7)}
    assert got[3, -1].tolist() == a.tolist() and got[0, 7].size == 0


GOOD = b"".join(encode_hashes([(1, 0, torch.arange(4)), (1, 1, torch.arange(2))]))


@pytest.mark.parametrize("data, message", [
    (b"", "no DCKPTRH1 header"),
    (b"DCKPTRH2" + GOOD[8:], "no DCKPTRH1 header"),
    (GOOD[:-8], "bytes, where its entries make"),
    (GOOD + b"\0" * 8, "bytes, where its entries make"),
    (GOOD[:8] + np.array([2**40], "<u8").tobytes() + GOOD[16:], "entries do not fit"),
    (b"".join(encode_hashes([(2, 0, torch.arange(1))])), "names no part"),  # the root lists 2 tensors
    (b"".join(encode_hashes([(-1, 0, torch.arange(1))])), "names no part"),
    (b"".join(encode_hashes([(0, -2, torch.arange(1))])), "names no part"),
    (b"".join(encode_hashes([(0, 0, torch.arange(1)), (0, 0, torch.arange(1))])), "listed twice"),
])
def test_a_hostile_file_is_refused(data, message):
    with pytest.raises(ManifestError, match=message):
        decode_hashes(data, "steps/a/hashes.0", 2)


def test_a_file_of_huge_counts_is_refused_before_any_allocation():
    cols = np.array([[0], [0], [2**61]], "<i8").tobytes()
    with pytest.raises(ManifestError, match="bytes, where its entries make"):
        decode_hashes(b"DCKPTRH1" + np.array([1], "<u8").tobytes() + cols, "f", 1)


@pytest.fixture(scope="module")
def base_doc(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    with Checkpointer(str(root)) as ckpt:
        ckpt.save(0, {"wide": torch.zeros(1000, HASHED_ROW_BYTES // 4), "narrow": torch.zeros(1000, 4)})
    return read_record(root, 0)


def test_a_base_lists_its_writers_file(base_doc):
    (rank, size, digest), = base_doc["hashes"]
    assert (rank, size, len(digest)) == (0, 16 + 24 + 8 * 1000, 16)
    assert parse_doc(base_doc).hashes == {0: (size, digest)}


@pytest.mark.parametrize("change, message", [
    ({"hashes": {}}, "field 'hashes' has a bad value"),
    ({"hashes": [[0, 10]]}, "field 'hashes' has a bad entry"),
    ({"hashes": [[0, -1, "0" * 16]]}, "field 'hashes' has a bad entry"),
    ({"hashes": [[0, 1, "0" * 15]]}, "field 'hashes' has a bad entry"),
    ({"hashes": [[1, 1, "0" * 16]]}, "row hashes of no rank of a base"),  # world size 1
])
def test_a_hostile_hashes_field_is_refused(base_doc, change, message):
    with pytest.raises(ManifestError, match=message):
        parse_doc(base_doc | change)


def test_a_delta_lists_no_row_hashes(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        state = {"wide": torch.zeros(1000, HASHED_ROW_BYTES // 4)}
        ckpt.save(0, state)
        state["wide"][3] = 1
        ckpt.save(1, state)
    doc = read_record(tmp_path, 1)
    assert "hashes" not in doc
    with pytest.raises(ManifestError, match="row hashes of no rank of a base"):
        parse_doc(doc | {"hashes": [[0, 1, "0" * 16]]})


def test_a_rank_s_row_hash_file_name_is_reserved():
    assert "reserved" in key_problem("hashes.0/x")
    assert key_problem("model/hashes.0") is None
