"""A restore of some shards reads only the part tables of the ranks that wrote the parts meeting
them, found from the tensors' layouts in the root record; a layout that its tables contradict is
refused, naming the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash

from deltackpt import Checkpointer, Shard
from deltackpt.errors import ManifestError
from deltackpt.format.record_checks import parse_manifest
from deltackpt.sharding import Box
from dist_harness import check_ok, run_ranks

WORLD = 3


def full(step: int) -> dict[str, torch.Tensor]:
    """The global state at ``step``: from step 2 on, a row of ``emb`` in each part and a column
    of ``wide`` changed."""
    gen = torch.Generator().manual_seed(0)
    values = {"emb": torch.randn(30, 4, generator=gen), "wide": torch.randn(6, 9, generator=gen)}
    if step >= 2:
        values["emb"][[3, 14, 25]] += step
        values["wide"][:, 4] += step
    return values


def shards(values: dict[str, torch.Tensor], rows: tuple[int, int], cols: tuple[int, int]) -> dict[str, Shard]:
    """``emb``'s rows and ``wide``'s columns, as shards (copies)."""
    emb, wide = values["emb"], values["wide"]
    return {"emb": Shard(emb[rows[0]:rows[1]].clone(), global_shape=emb.shape, global_offset=(rows[0], 0)),
            "wide": Shard(wide[:, cols[0]:cols[1]].clone(), global_shape=wide.shape, global_offset=(0, cols[0]))}


def save_job(rank: int, world: int, root: str) -> None:
    """Rank ``rank`` saves its tenth of ``emb``'s rows and third of ``wide``'s columns: a base
    at step 1, a delta at step 2."""
    with Checkpointer(root, chunk_bytes=64, dense_chunk_bytes=32) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"t": shards(full(step), (10 * rank, 10 * rank + 10), (3 * rank, 3 * rank + 3))})


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("store")
    check_ok(run_ranks(save_job, WORLD, str(root), str(root), deadline=300))
    return root


def tables_read(ckpt: Checkpointer) -> list[str]:
    """The keys of the part tables ``ckpt`` reads from now on, in order."""
    read: list[str] = []
    plain = ckpt.store.storage.read

    def spy(key: str, *args, **kwargs):
        if "/parts." in key:
            read.append(key)
        return plain(key, *args, **kwargs)

    ckpt.store.storage.read = spy
    return read


@pytest.mark.parametrize("rows, cols, ranks", [
    ((0, 10), (0, 3), {0}),  # rank 0's own shards
    ((20, 30), (6, 9), {2}),
    ((12, 18), (3, 6), {1}),  # rows inside rank 1's part
    ((5, 25), (2, 4), {0, 1, 2}),  # resharded: rows of every part, columns of two
])
def test_a_restore_reads_only_the_tables_of_the_parts_its_shards_meet(store, rows, cols, ranks):
    with Checkpointer(store) as ckpt:
        read = tables_read(ckpt)
        target = {"t": shards({k: torch.zeros_like(v) for k, v in full(0).items()}, rows, cols)}
        assert ckpt.restore(target) == 2
    assert [m.kind for m in ckpt.store.chain(2)] == ["base", "delta"]
    want = shards(full(2), rows, cols)
    for key in want:
        assert torch.equal(target["t"][key].local, want[key].local)
    attempts = {json.loads((store / f"commits/{s:020d}.json").read_bytes())["attempt"] for s in (1, 2)}
    assert sorted(read) == sorted(f"steps/{a}/parts.{r}" for a in attempts for r in ranks)


@pytest.mark.parametrize("rows, ranks", [([14, 11, 14], {1}), ([25, 2], {0, 1, 2}), ([29], {2})])
def test_a_load_of_some_rows_reads_only_the_tables_of_the_parts_that_hold_them(store, rows, ranks):
    with Checkpointer(store) as ckpt:
        read = tables_read(ckpt)
        assert torch.equal(ckpt.load(2, key="t/emb", rows=rows), full(2)["emb"][rows])
    assert {key.rsplit(".", 1)[1] for key in read} == {str(r) for r in ranks}


def tampered(store: Path, change) -> tuple[bytes, dict[str, bytes]]:
    """Step 1's root with ``change`` applied to its document, and its tables by key."""
    doc = json.loads((store / f"commits/{1:020d}.json").read_bytes())
    del doc["checksum"]  # a root without one (as written before roots had one) is read unchecked
    change(doc["tensors"])
    tables = {f"steps/{doc['attempt']}/parts.{r}": (store / "steps" / doc["attempt"] / f"parts.{r}").read_bytes()
              for r, _, _ in doc["tables"]}
    return json.dumps(doc).encode(), tables


def parse(root: bytes, tables: dict[str, bytes]):
    def read(key: str, size: int, digest: str) -> bytes:
        data = tables[key]
        assert len(data) == size and xxhash.xxh3_64_hexdigest(data) == digest
        return data
    return parse_manifest(root, "r", read)


def test_each_tensor_of_a_sharded_save_has_its_layout(store):
    doc = json.loads((store / f"commits/{1:020d}.json").read_bytes())
    assert doc["tensors"]["t/emb"]["layout"] == {"grid": [10, 4], "writers": [[0, 3]]}
    assert doc["tensors"]["t/wide"]["layout"] == {"grid": [6, 3], "writers": [[0, 3]]}


@pytest.mark.parametrize("change, box, message", [
    # Each table holds its own part, but the root says other boxes: the reader of a box learns it
    # from the one table it reads.
    (lambda t: t["t/emb"]["layout"].update(grid=[[9, 20], 4]), Box((0, 0), (5, 4)),
     r"tensor 't/emb' \(table steps/.*/parts.0\): part 'p0' at \[0, 0\] of \[10, 4\], its layout says at \[0, 0\] of \[9, 4\]"),
    (lambda t: t["t/wide"]["layout"].update(writers=[[1, 1], [0, 1], [2, 1]]), Box((0, 0), (6, 1)),
     r"tensor 't/wide' \(table steps/.*/parts.1\): holds parts \['p1'\] of the tensor, its layout says \['p0'\]"),
])
def test_a_layout_its_tables_contradict_is_refused_naming_the_table(store, change, box, message):
    root, tables = tampered(store, change)
    key = "t/emb" if "t/emb" in message else "t/wide"
    with pytest.raises(ManifestError, match=message):
        parse(root, tables).tensors[key].parts_meeting(box)
    with pytest.raises(ManifestError, match=f"tensor '{key}': "):
        tuple(parse(root, tables).tensors[key].parts)  # a reader of every part


@pytest.mark.parametrize("layout, message", [
    ({"grid": [10, 4]}, "must be an object of 'grid' and 'writers'"),
    ({"grid": [10], "writers": [[0, 3]]}, "has a grid"),
    ({"grid": [0, 4], "writers": [[0, 3]]}, "has a bad axis 0"),
    ({"grid": [[20, 10], 4], "writers": [[0, 3]]}, "has a bad axis"),
    ({"grid": [10, 4], "writers": [[0, 0], [0, 3]]}, "has bad writers"),
    ({"grid": [10, 4], "writers": [[0, 2]]}, "makes 3 parts listed by 2 writers"),
    ({"grid": [15, 4], "writers": [[0, 2]]}, "makes 2 parts listed by 2 writers, the tensor has 3"),
    ({"grid": [10, 4], "writers": [[1, 3]]}, "names other ranks than 'ranks'"),
])
def test_a_bad_layout_is_refused_with_the_root(store, layout, message):
    root, tables = tampered(store, lambda t: t["t/emb"].update(layout=layout))
    with pytest.raises(ManifestError, match=f"tensor 't/emb': field 'layout' {message}"):
        parse(root, tables)
