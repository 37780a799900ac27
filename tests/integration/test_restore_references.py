"""After a restore, the next delta finds exactly the rows that changed since: the restore's reads
hash the rows they write (no second pass over the restored tensors but over the small ones,
hashed together in one call), or take the hashes a base stored beside its large tables' rows,
for bases, chains, chains after compaction, N -> M restores and partial (column-wise,
table-wise) restores; a store whose bytes do not match its record is refused, never hashed, and
stored hashes that are wrong make the next delta write those rows again."""

from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import xxhash

import deltackpt
from deltackpt import Checkpointer, IntegrityError, MemoryStorage, Shard, kernels
from deltackpt.format.hash_files import HASHED_ROW_BYTES, decode_hashes, encode_hashes
from deltackpt.io.reader import ChainReader
from deltackpt.io.row_hashes import RowHashes
from deltackpt.io.staging import StagingPool
from deltackpt.tracking.changes import ChangeTracker
from deltackpt.tracking.references import SMALL_TENSOR_BYTES
from dist_harness import check_ok, run_ranks
from helpers import same_bits
from hostile import read_record, write_record

ROWS = 300


class NeverBase:
    """Deltas after the first base, whatever they cost."""

    name = "never_base"

    def decide(self, chain, delta_bytes, full_bytes):
        return deltackpt.Decision("delta", "test policy: always a delta")


def make_state(g: torch.Generator) -> dict:
    return {"emb": torch.randn(ROWS, 8, generator=g),
            "half": torch.randn(ROWS, 5, generator=g).to(torch.bfloat16),
            "ints": torch.arange(ROWS * 3).view(ROWS, 3),
            "cube": torch.randn(ROWS, 2, 3, generator=g),
            "acc": torch.randn(ROWS, generator=g),
            "scalar": torch.tensor(0.5)}


def update(s: dict, step: int, g: torch.Generator) -> None:
    ids = torch.cat([torch.tensor([0, 1, 299]), torch.randint(0, ROWS, (20,), generator=g)])
    s["emb"][ids] += 1.0
    s["half"][ids[:5]] += 1
    s["ints"][ids[::2]] += step
    s["cube"][ids[:3]] -= 1.0
    s["acc"][ids[:4]] += 1.0
    s["scalar"] += 1


def changed_rows(ckpt: Checkpointer, step: int) -> dict[str, list[int]]:
    """The rows (elements) step ``step``'s delta holds, by key, read from its record alone."""
    m = ckpt.store.manifest(step)
    assert m.kind == "delta"
    out: dict[str, list[int]] = {}
    with ThreadPoolExecutor(1) as executor:
        reader = ChainReader(ckpt.store.storage, [m], StagingPool(4, 1 << 16, pin=False), executor)
        for key, rec in m.tensors.items():
            for part in rec.parts:
                if part.changed:
                    ids, _ = rec.encoding.changes(reader, m, key, rec, part)
                    out.setdefault(key, []).extend(ids.tolist())
    return {k: sorted(v) for k, v in out.items()}


def saved_chain(storage, steps: int) -> dict[int, dict]:
    g = torch.Generator().manual_seed(3)
    s = make_state(g)
    saved = {}
    with Checkpointer(storage, policy=NeverBase(), chunk_bytes=512, dense_chunk_bytes=64,
                      memory_budget=8192) as ckpt:
        for step in range(steps):
            if step:
                update(s, step, g)
            ckpt.save(step, s)
            saved[step] = {k: v.clone() for k, v in s.items()}
    return saved


@pytest.mark.parametrize("source", ["base", "chain", "compacted", "same-checkpointer"])
def test_the_delta_after_a_restore_holds_exactly_the_rows_touched(source):
    storage = MemoryStorage()
    saved = saved_chain(storage, 6)
    step = 0 if source == "base" else 5
    with Checkpointer(storage, policy=NeverBase(), chunk_bytes=512, dense_chunk_bytes=64,
                      memory_budget=8192) as ckpt:
        if source == "compacted":
            ckpt.compact(step)
        got = {k: torch.full_like(v, 7) for k, v in saved[step].items()}
        if source == "same-checkpointer":
            ckpt.restore(got, 0)  # references of another step first
        assert ckpt.restore(got, step) == step
        for k, v in saved[step].items():
            assert same_bits(got[k], v), k
        touched = [3, 17, 150, 298]
        got["emb"][touched] += 2.0
        got["cube"][touched[:2]] += 2.0
        got["ints"][[5]] += 1
        info = ckpt.save(10, got)
        assert info.kind == "delta"
        assert changed_rows(ckpt, 10) == {"emb": touched, "cube": touched[:2], "ints": [5]}
        assert info.rows_changed == len(touched) + 2 + 1


def test_a_restore_hashes_no_large_row_sparse_tensor_after_reading_it(monkeypatch):
    """The reads hash the rows of a row-sparse tensor above SMALL_TENSOR_BYTES as they write them;
    the small tensors are hashed after the reads, all in one call."""
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(3000, 8, generator=g), **make_state(g)}
    assert state["big"].nbytes > SMALL_TENSOR_BYTES >= max(t.nbytes for k, t in state.items() if k != "big")
    storage = MemoryStorage()
    with Checkpointer(storage, policy=NeverBase(), chunk_bytes=4096, memory_budget=1 << 16) as ckpt:
        ckpt.save(0, state)
        update(state, 1, g)
        state["big"][[5, 2999]] += 1.0
        ckpt.save(1, state)
    hashed: list[list[str]] = []
    real = ChangeTracker.hash_many

    def counting(self, tensors):
        hashed.append(sorted(tensors))
        return real(self, tensors)

    with Checkpointer(storage, policy=NeverBase(), chunk_bytes=4096, memory_budget=1 << 16) as ckpt:
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        monkeypatch.setattr(ChangeTracker, "hash_many", counting)
        ckpt.restore(got, 1)
        monkeypatch.undo()
        assert hashed == [sorted(k for k in state if k != "big")]
        assert ckpt.save(2, got).rows_changed == 0


def test_a_chunk_that_does_not_match_its_record_is_refused(tmp_path):
    saved = saved_chain(str(tmp_path), 3)
    victim = max((os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                  if "/steps/" in os.path.join(d, f) and not f.endswith(".json")
                  and not f.startswith("parts.")), key=os.path.getsize)  # a data chunk, not a part table
    with open(victim, "r+b") as f:
        f.seek(4)
        byte = f.read(1)
        f.seek(4)
        f.write(bytes([byte[0] ^ 0x40]))
    with Checkpointer(str(tmp_path), policy=NeverBase()) as ckpt:
        with pytest.raises(IntegrityError):
            ckpt.restore({k: torch.zeros_like(v) for k, v in saved[2].items()}, 2)


# -- hashes stored by a base -----------------------------------------------------------------------

WIDE = (1200, HASHED_ROW_BYTES // 4)  # float32 rows of HASHED_ROW_BYTES, above SMALL_TENSOR_BYTES


def wide_state(g: torch.Generator) -> dict:
    return {"wide": torch.randn(WIDE, generator=g), **make_state(g)}


def stored(ckpt: Checkpointer, step: int, key: str) -> torch.Tensor | None:
    m = ckpt.store.manifest(step)
    with ThreadPoolExecutor(1) as executor:
        reader = ChainReader(ckpt.store.storage, [m], StagingPool(4, 1 << 16, pin=False), executor)
        return reader.stored_hashes(m, key, m.tensors[key].parts[0])


def hashes_file(root: Path, step: int) -> Path:
    doc = json.loads((root / "commits" / f"{step:020d}.json").read_bytes())
    return root / "steps" / doc["attempt"] / "hashes.0"


def test_a_base_stores_the_hash_of_every_row_of_its_wide_tables(tmp_path):
    g = torch.Generator().manual_seed(5)
    state = wide_state(g)
    with Checkpointer(str(tmp_path), policy=NeverBase()) as ckpt:
        first = ckpt.save(0, state)
        state["wide"][[4, 900]] += 1.0
        ckpt.save(1, state)
        assert torch.equal(stored(ckpt, 0, "wide"), kernels.hash_rows(ckpt.load(0)["wide"]))
        assert {k: stored(ckpt, 0, k) is None for k in state} == {k: k != "wide" for k in state}
        assert not ckpt.store.manifest(1).hashes  # a delta stores none
    size = hashes_file(tmp_path, 0).stat().st_size
    assert size == 16 + 24 + 8 * WIDE[0]
    assert first.bytes_written >= size + state["wide"].nbytes


@pytest.mark.parametrize("same", [False, True], ids=["new-checkpointer", "same-checkpointer"])
def test_a_restore_takes_a_base_s_stored_hashes_and_hashes_only_the_deltas_rows(tmp_path, monkeypatch, same):
    """Read from the store, or from the record the saving checkpointer parsed at its commit."""
    g = torch.Generator().manual_seed(5)
    state = wide_state(g)
    ckpt = Checkpointer(str(tmp_path), policy=NeverBase(), chunk_bytes=16384)
    ckpt.save(0, state)
    state["wide"][[4, 900, 901]] += 1.0
    ckpt.save(1, state)
    if not same:
        ckpt.close()
        ckpt = Checkpointer(str(tmp_path), policy=NeverBase(), chunk_bytes=16384)
    hashed: list[int] = []
    real = RowHashes.took

    def counting(self, rows, data):
        hashed.append(data.shape[0])
        return real(self, rows, data)

    monkeypatch.setattr(RowHashes, "took", counting)
    with ckpt:
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.restore(got, 1) == 1
        assert same_bits(got["wide"], state["wide"])
        assert sum(hashed) == 3  # the delta's rows; the base's 1,200 came stored
        got["wide"][[7, 1199]] -= 1.0
        assert ckpt.save(2, got).kind == "delta"
        assert changed_rows(ckpt, 2) == {"wide": [7, 1199]}


def forge_hashes(root: Path, step: int, rows: list[int], keep: slice = slice(None)) -> None:
    """Rewrites the stored hashes of ``rows`` of "wide", and keeps only ``keep`` of them (wrong,
    but with a checksum and a record to match them, as an attacker could)."""
    path = hashes_file(root, step)
    (key, values), = decode_hashes(path.read_bytes(), "f", 100).items()
    values = torch.from_numpy(values.copy())
    values[rows] += 1
    data = b"".join(encode_hashes([(*key, values[keep])]))
    path.write_bytes(data)
    doc = read_record(root, step)
    doc["hashes"] = [[0, len(data), xxhash.xxh3_64_hexdigest(data)]]
    write_record(root, step, doc)


@pytest.mark.parametrize("tracked", [False, True])
def test_wrong_stored_hashes_make_the_next_delta_write_those_rows(tmp_path, tracked):
    """Hashing finds the rows at once; marks find them by the canary (here drawing every row)."""
    torch.manual_seed(5)
    emb = torch.nn.Embedding(*WIDE)
    with Checkpointer(str(tmp_path), policy=NeverBase()) as ckpt:
        ckpt.save(0, {"model": emb})
    forge_hashes(tmp_path, 0, [10, 20])
    got = torch.nn.Embedding(*WIDE)
    with Checkpointer(str(tmp_path), policy=NeverBase()) as ckpt:
        assert ckpt.restore({"model": got}, 0) == 0
        assert same_bits(got.weight, emb.weight)
        if tracked:
            ckpt.track(got, canary=deltackpt.Canary(min_rows=WIDE[0]))
        got(torch.tensor([3]))
        with torch.no_grad():
            got.weight[3] += 1.0
        ckpt.save(1, {"model": got})
        assert changed_rows(ckpt, 1) == {"model/weight": [3, 10, 20]}
    again = torch.nn.Embedding(*WIDE)
    with Checkpointer(str(tmp_path), policy=NeverBase()) as ckpt:
        ckpt.restore({"model": again}, 1)
        assert same_bits(again.weight, got.weight)


def saved_wide_base(root: Path) -> dict:
    """Saves a base of a wide state as step 0 of a store; returns the state."""
    state = wide_state(torch.Generator().manual_seed(5))
    with Checkpointer(str(root), policy=NeverBase()) as ckpt:
        ckpt.save(0, state)
    return state


def test_a_damaged_row_hash_file_is_refused_by_restore_and_verify(tmp_path):
    state = saved_wide_base(tmp_path)
    path = hashes_file(tmp_path, 0)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with Checkpointer(str(tmp_path), policy=NeverBase()) as ckpt:
        with pytest.raises(IntegrityError, match="hashes.0"):
            ckpt.restore({k: torch.zeros_like(v) for k, v in state.items()}, 0)
        report = ckpt.verify(0)
        assert [(p.kind, p.key.rsplit("/", 1)[-1]) for p in report.problems] == [("corrupt", "hashes.0")]
        assert same_bits(ckpt.load(0)["wide"], state["wide"])  # a load needs no hashes


def test_stored_hashes_of_another_number_of_rows_are_refused(tmp_path):
    state = saved_wide_base(tmp_path)
    forge_hashes(tmp_path, 0, [], keep=slice(1, None))
    with Checkpointer(str(tmp_path), policy=NeverBase()) as ckpt:
        with pytest.raises(IntegrityError, match=f"hashes.0.*{WIDE[0] - 1} row hashes for part '' of 'wide'"):
            ckpt.restore({k: torch.zeros_like(v) for k, v in state.items()}, 0)
        assert [p.kind for p in ckpt.verify(0).problems] == ["corrupt"]


def test_a_base_without_stored_hashes_restores_by_hashing_its_rows(tmp_path):
    """As a base written before row hashes existed is read."""
    state = saved_wide_base(tmp_path)
    doc = read_record(tmp_path, 0)
    del doc["hashes"]
    write_record(tmp_path, 0, doc)
    hashes_file(tmp_path, 0).unlink()
    with Checkpointer(str(tmp_path), policy=NeverBase()) as ckpt:
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        ckpt.restore(got, 0)
        got["wide"][[0, 5]] += 1.0
        ckpt.save(1, got)
        assert changed_rows(ckpt, 1) == {"wide": [0, 5]}


def compacted_stored(ckpt: Checkpointer, step: int, key: str) -> torch.Tensor | None:
    """The row hashes that the base compaction made for ``step`` stored for ``key``."""
    m = ckpt.store.compacted(step)
    assert m is not None
    with ThreadPoolExecutor(1) as executor:
        reader = ChainReader(ckpt.store.storage, [m], StagingPool(4, 1 << 16, pin=False), executor)
        return reader.stored_hashes(m, key, m.tensors[key].parts[0])


def test_a_compacted_base_stores_row_hashes_that_a_restore_takes(tmp_path, monkeypatch):
    """Compaction on one rank writes every chunk of a table: it stores the hash of every row,
    as a base a save writes does, and a restore of the step takes them instead of hashing."""
    g = torch.Generator().manual_seed(5)
    state = wide_state(g)
    with Checkpointer(str(tmp_path), policy=NeverBase(), chunk_bytes=16384) as ckpt:
        for step in range(3):
            state["wide"][[step, 900 + step]] += 1.0
            ckpt.save(step, state)
        info = ckpt.compact(2)
        assert info.done and info.chain_length == 3
        assert torch.equal(compacted_stored(ckpt, 2, "wide"), kernels.hash_rows(state["wide"]))
        assert {k: compacted_stored(ckpt, 2, k) is None for k in state} == {k: k != "wide" for k in state}
        assert ckpt.verify(2).ok
    hashed: list[int] = []
    real = RowHashes.took
    monkeypatch.setattr(RowHashes, "took", lambda self, rows, data: (hashed.append(data.shape[0]),
                                                                     real(self, rows, data))[1])
    with Checkpointer(str(tmp_path), policy=NeverBase(), chunk_bytes=16384) as ckpt:
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.restore(got, 2) == 2
        assert all(same_bits(got[k], state[k]) for k in state)
        assert sum(hashed) == 0  # the compacted base's 1,200 rows came stored
        got["wide"][[3, 1100]] -= 1.0
        assert ckpt.save(3, got).kind == "delta"
        assert changed_rows(ckpt, 3) == {"wide": [3, 1100]}


def compact_job(rank: int, world: int, root: str) -> tuple[int, list[int], bool]:
    """Two ranks compact a chain of one rank's: "wide" (two chunks of 256 KiB) is written by
    both, "mid" (one chunk) by rank 0, whose file alone stores row hashes (those of "mid"; a
    rank past those that saved the step stores none)."""
    g = torch.Generator().manual_seed(3)
    state = {"wide": torch.randn(1024, HASHED_ROW_BYTES // 4, generator=g),
             "mid": torch.randn(300, HASHED_ROW_BYTES // 4, generator=g)}
    alone = dist.new_group([0])
    with contextlib.ExitStack() as stack:
        if rank == 0:
            ckpt = stack.enter_context(Checkpointer(root, policy=NeverBase(), chunk_bytes=1 << 18,
                                                    process_group=alone))
        for step in range(2):
            state["wide"][step] += 1.0
            state["mid"][step] += 1.0
            if rank == 0:
                ckpt.save(step, state)
    dist.barrier()
    with Checkpointer(root, policy=NeverBase(), chunk_bytes=1 << 18) as ckpt:
        assert ckpt.compact(1).done
        m = ckpt.store.compacted(1)
        assert compacted_stored(ckpt, 1, "wide") is None
        mid = compacted_stored(ckpt, 1, "mid")
        assert mid is not None and torch.equal(mid, kernels.hash_rows(state["mid"]))
        got = ckpt.load(1)
        return m.tensors["mid"].parts[0].rank, sorted(m.hashes), all(same_bits(got[k], state[k]) for k in state)


def test_a_compaction_on_two_ranks_stores_the_hashes_of_the_tables_one_rank_wrote_whole(tmp_path):
    results = check_ok(run_ranks(compact_job, 2, str(tmp_path), str(tmp_path / "store")))
    assert results == [(0, [0], True)] * 2


# -- on several ranks ---------------------------------------------------------------------------

# t2's rows are wide enough for a base to store their hashes: split by rows, a restore's boxes
# meet its parts at other offsets; split by columns, its parts store none.
TABLES = {"t0": (101, 8), "t1": (64, 5), "t2": (1200, HASHED_ROW_BYTES // 4)}


def global_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ref = {n: torch.randn(shape, generator=g) for n, shape in TABLES.items()}
    for s in range(1, step + 1):
        for n, (rows, _) in TABLES.items():
            ref[n][torch.randint(0, rows, (5,), generator=g)] += float(s)
    return ref


def local(t: torch.Tensor, scheme: str, rank: int, world: int, name: str) -> Shard | torch.Tensor | None:
    if scheme == "table":
        return t.clone() if sorted(TABLES).index(name) % world == rank else None
    dim = 0 if scheme == "row" else 1
    block = -(-t.shape[dim] // world)
    lo, hi = min(t.shape[dim], rank * block), min(t.shape[dim], (rank + 1) * block)
    offset = [0, 0]
    offset[dim] = lo
    return Shard(t.narrow(dim, lo, hi - lo).clone(), global_shape=tuple(t.shape), global_offset=tuple(offset))


def layout(ref: dict, scheme: str, rank: int, world: int) -> dict:
    return {n: x for n, t in ref.items() if (x := local(t, scheme, rank, world, n)) is not None}


def references_job(rank: int, world: int, root: str) -> int:
    groups = {n: dist.new_group(list(range(n)), backend="gloo") for n in (2, 3)}
    checked = 0
    for saved in ("row", "col"):  # by columns, a restore by rows writes its rows in parts
        store = f"{root}/{saved}"
        if rank < 2:
            state = layout(global_state(0), saved, rank, 2)
            with Checkpointer(store, process_group=groups[2], policy=NeverBase(),
                              chunk_bytes=256, memory_budget=4096) as ckpt:
                for step in range(3):
                    for n, x in state.items():
                        x.local.copy_(local(global_state(step)[n], saved, rank, 2, n).local)
                    ckpt.save(step, state)
        dist.barrier()
        for next_step, scheme in enumerate(("row", "col", "table"), start=10):
            got = layout({n: torch.zeros(shape) for n, shape in TABLES.items()}, scheme, rank, world)
            with Checkpointer(store, process_group=groups[3], policy=NeverBase(),
                              chunk_bytes=256, memory_budget=4096) as ckpt:
                assert ckpt.restore(got, 2) == 2
                want = layout(global_state(2), scheme, rank, world)
                for n, x in want.items():
                    assert same_bits(got[n].local if isinstance(x, Shard) else got[n],
                                     x.local if isinstance(x, Shard) else x), (saved, scheme, n)
                # Touch global rows 7 and 70 of t0 wherever this rank holds them.
                for n, x in got.items():
                    t, off = (x.local, x.global_offset[0]) if isinstance(x, Shard) else (x, 0)
                    for row in (7, 70):
                        if n == "t0" and off <= row < off + t.shape[0]:
                            t[row - off] += 1.0
                assert ckpt.save(next_step, got).kind == "delta"
                # Split by columns, t0 is three parts, each holding both rows.
                want_rows = {"t0": sorted([7, 70] * (3 if scheme == "col" else 1))}
                assert changed_rows(ckpt, next_step) == want_rows, (saved, scheme)
                checked += 1
        # Step 11 is a delta split by columns: restored by rows, rows 7 and 70 are written whole
        # by the base, then in part by that delta.
        got = layout({n: torch.zeros(shape) for n, shape in TABLES.items()}, "row", rank, world)
        with Checkpointer(store, process_group=groups[3], policy=NeverBase(),
                          chunk_bytes=256, memory_budget=4096) as ckpt:
            assert ckpt.restore(got, 11) == 11
            if got["t0"].global_offset[0] <= 8 < got["t0"].global_offset[0] + got["t0"].local.shape[0]:
                got["t0"].local[8 - got["t0"].global_offset[0]] -= 1.0
            assert ckpt.save(20, got).kind == "delta"
            assert changed_rows(ckpt, 20) == {"t0": [8]}, saved
            checked += 1
    return checked


def test_n_to_m_and_partial_restores_find_exactly_the_rows_touched(tmp_path):
    assert check_ok(run_ranks(references_job, 3, str(tmp_path), str(tmp_path), deadline=240)) == [8, 8, 8]
