"""The encoding registry: each encoding round-trips what a save stores with it (restore, a
partial load, the delta stream) and ``verify`` checks it; registering a new class is all it takes
for the save, the record parser, restore, verify and the stream to use it."""

from __future__ import annotations

import os

import pytest
import torch

import deltackpt
from deltackpt import Checkpointer, ManifestError, Rowwise, StateError
from deltackpt.format import encodings
from deltackpt.format.encodings import base
from helpers import same_bits


class NeverBase:
    """Deltas after the first base, whatever they cost, so small tensors still get deltas."""

    name = "never_base"

    def decide(self, chain, delta_bytes, full_bytes):
        return deltackpt.Decision("delta", "test policy: always a delta")


def states(dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    """Three steps of a table (changed rows), a vector and a scalar (changed elements)."""
    gen = torch.Generator().manual_seed(0)
    table = (torch.randn(300, 8, generator=gen) * 100).to(dtype)
    vec, scalar = torch.randn(5000, generator=gen), torch.tensor(3.0)
    out = []
    for step in range(3):
        if step:
            table[[7, 150 + step, 299]] += 1
            vec[4000 + step] += 1
            scalar += 1
        out.append({"table": table.clone(), "vec": vec.clone(), "scalar": scalar.clone()})
    return out


def save_all(path, steps, **kwargs) -> None:
    with Checkpointer(path, policy=NeverBase(), chunk_bytes=512, dense_chunk_bytes=1024, **kwargs) as ckpt:
        for step, state in enumerate(steps):
            ckpt.save(step, state)


def corrupt_first_chunk(path, step: int, key: str, prefix: str) -> str:
    """Flips a byte of the first chunk of ``key`` whose name starts with ``prefix``."""
    with Checkpointer(path, create=False) as ckpt:
        m = ckpt.store.manifest(step)
    part = m.tensors[key].parts[0]
    name = next(n for n in sorted(part.chunks) if n.startswith(prefix) and n != "zarr.json")
    entry = part.chunks[name]
    if part.pack is None:
        f, at = os.path.join(path, "steps", m.attempt, key, *name.split("/")), 0
    else:
        f, at = os.path.join(path, "steps", m.attempt, part.pack, "c.0"), entry[2]
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))
    return name


def test_the_built_in_encodings_are_registered_and_chosen_by_kind_and_shape():
    assert list(base.REGISTRY) == ["full", "rows", "qrows", "chunks"]
    assert [encodings.choose("base", s, False).name for s in [(), (4,), (4, 2)]] == ["full"] * 3
    assert [encodings.choose("delta", s, False).name for s in [(), (4,), (4, 2)]] == ["chunks", "chunks", "rows"]
    assert encodings.choose("delta", (4, 2), True).name == "qrows"
    with pytest.raises(ManifestError, match="'encoding' must be one of .* got 'nope'"):
        encodings.get("nope")
    with pytest.raises(StateError, match="'rows' is registered already"):
        encodings.register(type("Again", (encodings.Rows,), {"name": "rows"}))


@pytest.mark.parametrize("key, name", [("table", "full"), ("vec", "full"), ("scalar", "full"),
                                       ("table", "rows"), ("vec", "chunks"), ("scalar", "chunks")])
def test_each_encoding_round_trips_and_verifies(store_path, key, name):
    steps = states()
    save_all(store_path, steps)
    step = 0 if name == "full" else 2
    with Checkpointer(store_path, create=False) as ckpt:
        assert ckpt.store.manifest(step).tensors[key].encoding.name == name
        for s, want in enumerate(steps):
            assert same_bits(ckpt.load(s)[key], want[key])
        if steps[step][key].dim():
            rows = [299, 7, 151, 0, 7]
            assert same_bits(ckpt.load(step, key=key, rows=rows), steps[step][key][rows])
        if step:
            (delta,) = [d for d in ckpt.deltas(since=step - 1) if d.step == step]
            (change,) = [c for c in delta.changes if c.key == key]
            flat = steps[step][key].reshape(-1) if steps[step][key].dim() < 2 else steps[step][key]
            assert same_bits(change.values, flat[change.ids])
        assert ckpt.verify().ok
    corrupt_first_chunk(store_path, step, key, "rows/" if name == "rows" else "")
    with Checkpointer(store_path, create=False) as ckpt:
        problems = ckpt.verify().problems
    corrupt = [p for p in problems if p.kind == "corrupt"]  # the chunk, and its pack's file if packed
    assert {p.step for p in corrupt} == {step} and [p.key for p in corrupt if f"/{key}/" in p.key]
    assert {p.kind for p in problems} - {"corrupt"} <= {"chain"}  # the steps built on it


def test_qrows_round_trips_within_its_bound_and_verifies(store_path):
    steps = states()
    save_all(store_path, steps, quantize={"table": Rowwise(bits=8)})
    with Checkpointer(store_path, create=False) as ckpt:
        rec = ckpt.store.manifest(2).tensors["table"]
        assert rec.encoding.name == "qrows" and rec.lossy is not None and rec.lossy.bound > 0
        got = ckpt.load(2)["table"]
        assert float((got - steps[2]["table"]).abs().max()) <= rec.lossy.chain_bound
        assert same_bits(ckpt.load(2, key="table", rows=[152, 7]), got[[152, 7]])
        (delta,) = [d for d in ckpt.deltas(since=1) if d.step == 2]
        (change,) = [c for c in delta.changes if c.key == "table"]
        assert change.ids.tolist() == [7, 152, 299] and same_bits(change.values, got[change.ids])
        assert ckpt.verify().ok
    corrupt_first_chunk(store_path, 2, "table", "qrows/")
    with Checkpointer(store_path, create=False) as ckpt:
        problems = ckpt.verify().problems
    assert {(p.step, p.kind) for p in problems} == {(2, "corrupt")}
    assert [p.key for p in problems if "/table/qrows/" in p.key]


class RawRows(encodings.Rows):
    """A new encoding for the test: changed rows as ``rows`` stores them, never blosc coded."""

    name = "rawrows"

    def chosen(self, kind, shape, quantized, aligned):
        return kind == "delta" and not quantized and len(shape) >= 2

    def coded(self, dtype):
        return False


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test."""
    monkeypatch.setattr(base, "REGISTRY", dict(base.REGISTRY))


def test_registering_a_new_encoding_is_all_it_takes(store_path, registry):
    steps = states(torch.int32)  # integers: ``rows`` would code their chunks
    encodings.register(RawRows)
    save_all(store_path, steps)
    with Checkpointer(store_path, create=False) as ckpt:
        rec = ckpt.store.manifest(2).tensors["table"]
        assert rec.encoding.name == "rawrows"
        part = rec.parts[0]
        rows = {n: e for n, e in part.chunks.items() if n.startswith("rows/")}
        assert rows and all(e[0] == part.chunk_shape[0] * 8 * 4 for e in rows.values())  # raw
        for s, want in enumerate(steps):
            assert same_bits(ckpt.load(s)["table"], want["table"])
        assert same_bits(ckpt.load(2, key="table", rows=[152, 8]), steps[2]["table"][[152, 8]])
        (delta,) = [d for d in ckpt.deltas(since=1) if d.step == 2]
        (change,) = [c for c in delta.changes if c.key == "table"]
        assert same_bits(change.values, steps[2]["table"][change.ids])
        assert ckpt.verify().ok
    del base.REGISTRY["rawrows"]
    with Checkpointer(store_path, create=False) as ckpt, pytest.raises(ManifestError, match="rawrows"):
        ckpt.load(2)
