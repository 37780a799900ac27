"""Replaying a chain newest delta first: every row and element ends as the newest step that wrote
it left it, bit for bit, whatever mix of row, dense and quantized deltas wrote it, in any box;
a delta chunk whose rows newer deltas all rewrote is not read, nor are the parts of a delta that
left a tensor as it was built."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import deltackpt
from deltackpt import Checkpointer, MemoryStorage, Rowwise
from deltackpt.format import part_tables
from deltackpt.io.reader import ChainReader
from deltackpt.io.staging import StagingPool
from deltackpt.sharding import Box
from deltackpt.store import Store
from helpers import same_bits


class NeverBase:
    """Deltas after the first base, whatever they cost."""

    name = "never_base"

    def decide(self, chain, delta_bytes, full_bytes):
        return deltackpt.Decision("delta", "test policy: always a delta")


ROWS, DIM = 300, 8
HOT = [0, 1, 2, 150, 299]  # rewritten by every delta


def state(g: torch.Generator) -> dict:
    return {"emb": torch.randn(ROWS, DIM, generator=g),
            "half": torch.randn(ROWS, 5, generator=g).to(torch.bfloat16),
            "acc": torch.randn(ROWS, generator=g),
            "scalar": torch.tensor(0.5),
            "ints": torch.arange(ROWS * 3).view(ROWS, 3)}


def step_update(s: dict, step: int, g: torch.Generator) -> None:
    """Hot rows every step, a few random rows, a run of rows now and then, dense elements."""
    ids = torch.cat([torch.tensor(HOT), torch.randint(0, ROWS, (12,), generator=g)])
    if step % 3 == 0:
        ids = torch.cat([ids, torch.arange(40 * step % ROWS, 40 * step % ROWS + 30)])
    s["emb"][ids] += torch.rand(len(ids), DIM, generator=g) + 0.1
    s["half"][ids] += 1
    s["acc"][ids[: 4 + step]] += 1.0
    s["ints"][ids] += step
    if step % 2:
        s["scalar"] += 1


def snapshot(s: dict) -> dict:
    return {k: v.clone() for k, v in s.items()}


def oracle(ckpt: Checkpointer, step: int, key: str) -> torch.Tensor:
    """``key`` at ``step`` read row by row through the partial-load reader, which replays the
    chain oldest step first."""
    return ckpt.load(step, key=key, rows=list(range(ROWS)))


def test_every_step_of_a_long_overlapping_chain_restores_bit_exact():
    storage = MemoryStorage()
    g = torch.Generator().manual_seed(1)
    s = state(g)
    saved = {}
    with Checkpointer(storage, policy=NeverBase(), chunk_bytes=256, dense_chunk_bytes=64,
                      memory_budget=4096) as ckpt:
        for step in range(25):
            if step:
                step_update(s, step, g)
            assert ckpt.save(step, s).kind == ("delta" if step else "base")
            saved[step] = snapshot(s)
        for step in (0, 1, 2, 7, 16, 24):
            got = {k: torch.full_like(v, 7) for k, v in s.items()}
            assert ckpt.restore(got, step) == step
            for k, v in saved[step].items():
                assert same_bits(got[k], v), (step, k)
            loaded = ckpt.load(step)
            for k, v in saved[step].items():
                assert same_bits(loaded[k], v), (step, k)
            for k in ("emb", "half", "ints"):
                assert same_bits(oracle(ckpt, step, k), v := saved[step][k]), (step, k)


@pytest.mark.parametrize("box", [Box((0, 0), (ROWS, DIM)), Box((1, 3), (150, 4)), Box((149, 0), (2, 8)),
                                 Box((250, 7), (50, 1)), Box((7, 2), (0, 3))])
def test_any_box_of_a_chain(box):
    storage = MemoryStorage()
    g = torch.Generator().manual_seed(2)
    s = state(g)
    with Checkpointer(storage, policy=NeverBase(), chunk_bytes=512) as ckpt:
        for step in range(9):
            if step:
                step_update(s, step, g)
            ckpt.save(step, s)
    chain = Store(storage).chain(8)
    out = torch.full(box.shape, float("nan"))
    with ThreadPoolExecutor(3) as ex:
        ChainReader(storage, chain, StagingPool(2, 512), ex).read("emb", out, box)
    assert same_bits(out, s["emb"][box.slices(Box((0, 0), (ROWS, DIM)))].contiguous())


def test_quantized_and_exact_deltas_mixed_in_one_chain():
    storage = MemoryStorage()
    g = torch.Generator().manual_seed(3)
    s = state(g)
    rules = [None, {"emb": Rowwise(bits=8)}, None, {"emb": Rowwise(bits=4)}, {"emb": Rowwise(bits=2)}]
    exact_at = {}
    step = 0
    for rule in rules:
        with Checkpointer(storage, policy=NeverBase(), chunk_bytes=256, quantize=rule,
                          create=step == 0) as ckpt:
            if step:  # a resumed job: the next save is a delta against what it restored
                ckpt.restore(s, step - 1)
            for _ in range(3):
                if step:
                    step_update(s, step, g)
                ckpt.save(step, s)
                if rule is None:
                    exact_at[step] = snapshot(s)
                step += 1
    with Checkpointer(storage, create=False) as ckpt:
        last = ckpt.latest_step()
        assert last == 14
        encodings = [m.tensors["emb"].encoding.name for m in ckpt.store.chain(last)]
        assert encodings == ["full"] + ["rows"] * 2 + ["qrows"] * 3 + ["rows"] * 3 + ["qrows"] * 6
        for target in (8, last):
            got = ckpt.load(target)
            # The newest-first replay and the oldest-first one agree bit for bit, lossy rows too.
            assert same_bits(got["emb"], oracle(ckpt, target, "emb"))
            for k in ("half", "acc", "scalar", "ints"):  # never quantized: exact
                assert same_bits(got[k], s[k] if target == last else exact_at[target][k])
        # Rows the exact deltas of steps 6-8 wrote last are exact at step 8; the hot rows, rewritten
        # by every delta, are exact there too.
        assert same_bits(ckpt.load(8)["emb"][HOT], exact_at[8]["emb"][HOT])


class CountingStorage(MemoryStorage):
    """Counts the bytes read from every key."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: dict[str, int] = {}

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> int:
        self.reads[key] = self.reads.get(key, 0) + len(out)
        return super().read_into(key, out, offset)


def test_a_delta_whose_rows_newer_deltas_all_rewrote_is_not_read():
    storage = CountingStorage()
    t = torch.randn(1000, 16, generator=torch.Generator().manual_seed(4))
    with Checkpointer(storage, policy=NeverBase(), chunk_bytes=1024) as ckpt:
        ckpt.save(0, {"t": t})
        t[100:140] += 1  # step 1: rows 100..139
        ckpt.save(1, {"t": t})
        t[90:150] += 1  # step 2 rewrites every row of step 1, and more
        ckpt.save(2, {"t": t})
        chain = ckpt.store.chain(2)
        storage.reads.clear()
        got = torch.empty_like(t)
        ckpt.restore({"t": got}, 2)
    assert same_bits(got, t)

    def read_of(step: int) -> int:
        return sum(n for k, n in storage.reads.items() if k.startswith(f"steps/{chain[step].attempt}/"))

    # Step 1's row ids are read (to know which rows it holds), its 40 rows of 64 B are not.
    assert 0 < read_of(1) < 40 * 64
    assert read_of(2) >= 60 * 64


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.float16, torch.float32, torch.float64,
                                   torch.complex64, torch.complex128])
def test_rows_of_every_item_size_replay_bit_exact_into_boxes(dtype):
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(200, 4, 3, generator=g) * 50).to(dtype)
    storage = MemoryStorage()
    with Checkpointer(storage, policy=NeverBase(), chunk_bytes=300) as ckpt:
        ckpt.save(0, {"t": t})
        for step in range(1, 6):
            ids = torch.randint(0, 200, (30,), generator=g)
            t[ids] = (torch.randn(30, 4, 3, generator=g) * 50).to(dtype)
            assert ckpt.save(step, {"t": t}).kind == "delta"
    chain = Store(storage).chain(5)
    for box in (Box((0, 0, 0), (200, 4, 3)), Box((17, 1, 1), (150, 2, 2))):
        out = torch.zeros(box.shape, dtype=dtype)
        with ThreadPoolExecutor(2) as ex:
            ChainReader(storage, chain, StagingPool(2, 1024), ex).read("t", out, box)
        assert same_bits(out, t[box.slices(Box((0, 0, 0), (200, 4, 3)))].contiguous())


def test_a_replay_copies_delta_rows_on_its_io_threads_alone(monkeypatch):
    """torch's ``index_copy_`` wakes its thread pool from every I/O thread at once (about 5x slower
    on a busy node): the rows of a delta are copied by numpy on the I/O thread that read them."""
    g = torch.Generator().manual_seed(6)
    s = state(g)
    storage = MemoryStorage()
    with Checkpointer(storage, policy=NeverBase(), chunk_bytes=256) as ckpt:
        for step in range(4):
            if step:
                step_update(s, step, g)
            ckpt.save(step, s)
        got = {k: torch.full_like(v, 7) for k, v in s.items()}

        def refused(*args, **kwargs):
            raise AssertionError("a delta's rows were copied by torch's index_copy_")

        monkeypatch.setattr(torch.Tensor, "index_copy_", refused)
        ckpt.restore(got, 3)
    for k, v in s.items():
        assert same_bits(got[k], v), k


def test_a_replay_builds_no_part_of_a_delta_that_left_its_tensor_as_it_was(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(4, 3, generator=gen) for i in range(40)}
    saved = []
    with Checkpointer(str(tmp_path / "s"), policy=NeverBase()) as ckpt:
        ckpt.save(0, state)
        for step in (1, 2, 3):
            state[f"t{step}"][step % 4, 1] += 1  # one tensor a delta
            ckpt.save(step, state)
            saved.append(ckpt.store.manifest(step).attempt)
    built: list[str] = []
    real = part_tables.Table.parts

    def counted(self, index, rec, where, seen):
        built.append(self.where)
        return real(self, index, rec, where, seen)

    monkeypatch.setattr(part_tables.Table, "parts", counted)
    with Checkpointer(str(tmp_path / "s"), create=False) as ckpt:
        got = ckpt.load(3)
    assert all(same_bits(got[k], v) for k, v in state.items())
    # Each delta's parts are built for the one tensor it changed, the base's for all of them.
    assert [sum(attempt in w for w in built) for attempt in saved] == [1, 1, 1]
    assert len(built) == len(state) + 3
