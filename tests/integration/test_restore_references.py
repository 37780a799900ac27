"""After a restore, the next delta finds exactly the rows that changed since: the restore's reads
hash the rows they write (no second pass over the restored tensors but over the small ones,
hashed together in one call), for bases, chains, chains after compaction, N -> M restores and
partial (column-wise, table-wise) restores; a store whose bytes do not match its record is
refused, never hashed."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import deltackpt
from deltackpt import Checkpointer, IntegrityError, MemoryStorage, Shard
from deltackpt.io.reader import ChainReader
from deltackpt.io.staging import StagingPool
from deltackpt.tracking.changes import ChangeTracker
from deltackpt.tracking.references import SMALL_TENSOR_BYTES
from dist_harness import check_ok, run_ranks
from helpers import same_bits

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


# -- on several ranks ---------------------------------------------------------------------------

TABLES = {"t0": (101, 8), "t1": (64, 5)}


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
