"""Saves of a state of many small tensors: one batched hash finds a single changed element, a
plan kept from the last save still sees every change of layout, values and skeleton, and a
delta of thousands of tensors writes one pack."""

from __future__ import annotations

import math
import os

import torch

from deltackpt import Checkpointer, EveryK, statetree
from helpers import assert_same_state, same_bits


def tiny_state(n: int) -> dict:
    """``n`` tiny tensors of a few shapes and dtypes (2-D rows, 1-D, 0-d)."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(4, 4), (9,), (), (3, 5)]
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16]
    return {f"t{i}": (torch.randn(shapes[i % 4], generator=gen) * 100).to(dtypes[i % 3 if i % 4 != 2 else 0])
            for i in range(n)}


def test_one_element_of_tensor_17345_of_20000_is_found(store_path):
    state = tiny_state(20_000)
    with Checkpointer(store_path, policy=EveryK(100)) as ckpt:
        ckpt.save(1, state)
        target = state["t17345"]  # a 1-D tensor: 17345 % 4 == 1
        target.view(torch.uint8)[7 * target.element_size()] ^= 1  # one bit of one element
        info = ckpt.save(2, state)
        assert info.kind == "delta"
        m = ckpt.store.manifest(2)
        assert [k for k, r in m.tensors.items() if r.changed] == ["t17345"]
        assert list(m.packs) == ["pack.0"]  # one pack for the whole delta
        files = [f for d, _, fs in os.walk(os.path.join(store_path, "steps", m.attempt)) for f in fs]
        assert len(files) <= 4
        unchanged = ckpt.save(3, state)
        assert unchanged.kind == "delta" and unchanged.rows_changed == 0
        assert not any(r.changed for r in ckpt.store.manifest(3).tensors.values())
        assert_same_state(ckpt.load(2), state)


def test_a_load_through_deltas_looks_only_at_what_each_changed(store_path, monkeypatch):
    # Each delta of a state of many tensors leaves most as they were: a load tells those apart
    # from the delta's part tables at once, and makes no record of them (it looked at each).
    from deltackpt.format.lazy_records import LazyTensors

    state = tiny_state(400)
    with Checkpointer(store_path, policy=EveryK(100)) as ckpt:
        for step in range(5):  # a base, then deltas changing one tensor each
            state[f"t{4 * step + 1}"][0] += 1
            ckpt.save(step, state)
    asked = set()
    made = LazyTensors.__getitem__
    monkeypatch.setattr(LazyTensors, "__getitem__", lambda self, key: asked.add((id(self), key)) or made(self, key))
    with Checkpointer(store_path) as ckpt:
        assert_same_state(ckpt.load(4), state)
    by_key = {}
    for _, key in asked:
        by_key[key] = by_key.get(key, 0) + 1
    assert by_key["t0"] == 2  # of the base's and the last step's records
    assert [by_key[f"t{4 * step + 1}"] for step in range(5)] == [2, 3, 3, 3, 2]


def test_a_kept_plan_sees_swapped_data_new_objects_and_skeleton_types(store_path):
    weight = torch.nn.Parameter(torch.ones(4, 3), requires_grad=False)
    grid = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"w": weight, "b": torch.zeros(5), "cols": grid[:, ::2], "n": 1, "z": 0.0,
             **tiny_state(200)}
    with Checkpointer(store_path, policy=EveryK(100)) as ckpt:
        ckpt.save(1, state)
        weight.data = torch.full((4, 3), 2.0)  # same object, new storage
        state["b"] = torch.ones(5)  # a new object at the same key
        grid[1, 2] = -7.0  # seen through a non-contiguous view
        state["n"], state["z"] = 1.0, -0.0  # equal under ==, not the same value
        assert ckpt.save(2, state).kind == "delta"
        got = ckpt.load(2)
        state["n"], state["z"] = 1, 0.0  # the skeleton alone changes
        assert ckpt.save(3, state).kind == "delta"
        skeleton = ckpt.load(3)
        weight.data = torch.zeros(2, 3)  # a new shape under the same object: a base
        assert ckpt.save(4, state).kind == "base"
        got4 = ckpt.load(4)
    assert same_bits(got["w"], torch.full((4, 3), 2.0)) and same_bits(got["b"], torch.ones(5))
    assert same_bits(got["cols"], grid[:, ::2].contiguous()) and got["cols"][1, 1] == -7.0
    assert type(got["n"]) is float and math.copysign(1.0, got["z"]) == -1.0
    assert type(skeleton["n"]) is int and math.copysign(1.0, skeleton["z"]) == 1.0
    assert same_bits(got4["w"], torch.zeros(2, 3))


def test_flatten_reuses_the_shards_of_unchanged_tensors_only():
    a, b = torch.zeros(3), torch.ones(2, 2)
    first = statetree.flatten({"a": a, "m": {"b": b}})
    again = statetree.flatten({"a": a, "m": {"b": b}}, reuse=first)
    assert again.reused == 2 and again.tensors["a"] is first.tensors["a"]
    b.data = torch.ones(2, 2)
    moved = statetree.flatten({"a": a, "m": {"b": b}}, reuse=again)
    assert moved.reused == 1 and moved.tensors["m/b"].local.data_ptr() == b.data_ptr()
    renamed = statetree.flatten({"c": a, "m": {"b": b}}, reuse=moved)
    assert renamed.reused == 1 and set(renamed.tensors) == {"c", "m/b"}
    b.resize_(4)
    assert statetree.flatten({"a": a, "m": {"b": b}}, reuse=moved).tensors["m/b"].local.shape == (4,)


def test_roots_under_one_plan_encode_its_tensors_once(store_path, monkeypatch):
    # The root's tree and tensor entries depend on the plan, the kind and the aligned tensors:
    # deltas of thousands of tensors under one plan encode them once, not at every save.
    from deltackpt.save import commit

    encoded = []
    real = commit.tensor_entries
    monkeypatch.setattr(commit, "tensor_entries", lambda *a: encoded.append((step, len(a[0]))) or real(*a))
    state = tiny_state(300)
    with Checkpointer(store_path, policy=EveryK(3)) as ckpt:
        for step in range(6):  # base, delta, delta, base, delta, delta
            state["t5"].view(-1)[0] += 1
            ckpt.save(step, state)
        assert_same_state(ckpt.load(5), state)
    assert encoded == [(0, 300), (0, 300)]  # the base's, and its deltas' (made with the base)


def test_a_root_from_the_kept_encoding_is_the_one_made_afresh(store_path, monkeypatch):
    # Every root a save makes, with the plan's encoded pieces kept from earlier saves, has the
    # bytes of one made without them: bases and deltas, aligned tensors, lossy deltas and a
    # delta after a restore, a new plan.
    from deltackpt import Rowwise
    from deltackpt.save import commit

    made = []
    real = commit._root

    def both(*args, **kwargs):
        monkeypatch.setattr(commit.time, "time", lambda: 1.5)
        kept = real(*args, **kwargs)
        afresh = real(*args, **(kwargs | {"reuse": None}))
        monkeypatch.undo()
        monkeypatch.setattr(commit, "_root", both)
        made.append(kept.encode() == afresh.encode() and kept.heads == afresh.heads)
        return kept

    monkeypatch.setattr(commit, "_root", both)
    state = tiny_state(40) | {"emb": torch.randn(30, 4), "emb_sum": torch.randn(30), "step": 0}
    for quantize in (None, {"emb": Rowwise(bits=8)}):
        path = os.path.join(store_path, str(quantize is not None))
        with Checkpointer(path, policy=EveryK(3), aligned={"emb_sum": "emb"}, quantize=quantize) as ckpt:
            for step in range(5):
                state["emb"][step] += 1
                state["emb_sum"][step] += 1
                state["t3"].view(-1)[0] += 1
                if step == 3:
                    state["more"] = torch.ones(2)  # a new plan
                ckpt.save(step, state)
            ckpt.restore(state, 4)
            ckpt.save(5, state)
    assert made and all(made)


def test_a_lossless_root_is_not_parsed_by_its_maker_and_is_what_a_parse_gives(store_path, monkeypatch):
    # The coordinator makes the record of its own lossless root from what it made it of (parsing
    # a root of 20,000 tensors took longer than the rest of a one-row delta's commit); that
    # record is the one a reader parses from the root's bytes, parts included.
    from dataclasses import fields

    from deltackpt import Rowwise
    from deltackpt.store import Store

    made = []
    real = Store.commit_root

    def check(self, step, root, *, parsed=None):
        made.append(parsed is not None)
        if parsed is not None:
            want = self.parse(f"commits/{step:020d}.json", root)
            for f in fields(want):
                if f.name != "tensors":
                    assert getattr(parsed, f.name) == getattr(want, f.name), f.name
            assert list(parsed.tensors) == list(want.tensors)
            for key, rec in want.tensors.items():
                got = parsed.tensors[key]
                assert (got.dtype, got.shape, got.encoding, got.lossy) == (rec.dtype, rec.shape, rec.encoding, rec.lossy)
                assert tuple(got.parts) == tuple(rec.parts), key
        return real(self, step, root, parsed=parsed)

    monkeypatch.setattr(Store, "commit_root", check)
    state = tiny_state(40) | {"emb": torch.randn(300, 4), "emb_sum": torch.randn(300), "big": torch.randn(70_000),
                              "step": 0, "lr": [0.5, float("inf")]}
    for quantize in (None, {"emb": Rowwise(bits=8)}):
        path = os.path.join(store_path, str(quantize is not None))
        with Checkpointer(path, policy=EveryK(3), aligned={"emb_sum": "emb"}, quantize=quantize,
                          chunk_bytes=4096) as ckpt:
            for step in range(4):
                state["emb"][step] += 1
                state["emb_sum"][step] += 1
                state["big"][step * 9000] += 1
                state["t3"].view(-1)[0] += 1
                state["step"] = step
                ckpt.save(step, state)
            assert_same_state(ckpt.load(3), state)
    # Lossless saves, then lossy ones, which are parsed.
    assert made == [True] * 4 + [False] * 4


def test_a_delta_part_table_makes_entries_for_its_changed_parts_only(store_path, monkeypatch):
    # The entries of the parts a delta leaves unchanged are those of the last delta under the same
    # assignment; a delta's table makes entries for its changed parts alone, and every table
    # has the bytes of one made afresh.
    from deltackpt.save import commit, saver

    made, same, by_kept = [], [], []
    choose, real = commit.choose, commit.part_table
    monkeypatch.setattr(commit, "choose", lambda *a: made.append(a) or choose(*a))

    def both(*args, **kwargs):
        made.clear()
        kept = real(*args, **kwargs)
        by_kept.append(len(made))
        same.append(kept == real(*args, **(kwargs | {"reuse": None})))
        return kept

    monkeypatch.setattr(saver, "part_table", both)
    state = tiny_state(200) | {"emb": torch.randn(30, 4), "emb_sum": torch.randn(30)}
    with Checkpointer(store_path, policy=EveryK(4), aligned={"emb_sum": "emb"}) as ckpt:
        for step in range(7):  # base, 3 deltas, base, 2 deltas
            state["t3"].view(-1)[step] += 1
            state["emb_sum"][step] += 1
            if step == 6:
                state["t7"].view(-1)[0] += 1
            ckpt.save(step, state)
            if step in (1, 2, 3, 5, 6):  # at most one entry made for each changed part
                assert by_kept[-1] <= 2 + (step == 6), step
        assert_same_state(ckpt.load(6), state)
    assert same and all(same)


def test_a_base_settles_the_scan_of_the_first_delta_after_it():
    # A base leaves the tracker how its small tensors split and each one's change set if
    # unchanged: the first delta's scan makes objects for its changed tensors alone, and finds
    # what a tracker that makes them all afresh finds.
    from deltackpt.tracking.changes import ChangeTracker

    state = tiny_state(300) | {"emb": torch.randn(40, 4), "emb_sum": torch.randn(40), "big": torch.randn(20_000)}
    settling, afresh = (ChangeTracker(4096, aligned={"emb_sum": "emb"}) for _ in range(2))
    bases = [ct.hash_whole(state, ct.scan(state)) for ct in (settling, afresh)]
    unchanged = settling.adopt(state, bases[0], base=True)
    assert afresh.adopt(state, bases[1]) == {}  # not a base: nothing settled
    assert {"t5", "emb_sum"} <= set(unchanged) and "big" not in unchanged
    changed = ("t5", "t7", "emb", "emb_sum", "big")
    for key in changed:
        state[key].view(-1)[3] += 1
    got, want = settling.scan(state), afresh.scan(state)
    assert list(got) == list(want)
    for key, ch in want.items():
        assert torch.equal(got[key].changed, ch.changed) and torch.equal(got[key].hashes, ch.hashes), key
        assert got[key].aligned == ch.aligned, key
        assert (got[key] is unchanged.get(key)) == (key not in changed), key


def test_the_first_delta_after_a_base_makes_its_changed_tensors_part_scans_alone(store_path, monkeypatch):
    from deltackpt.save import scan
    from deltackpt.tracking import changes

    made, laid = [], []
    summarize, lay_out = scan.summarize, changes.lay_out
    monkeypatch.setattr(scan, "summarize", lambda *a: made.append(step) or summarize(*a))
    monkeypatch.setattr(changes, "lay_out", lambda *a: laid.append(step) or lay_out(*a))
    state = tiny_state(200) | {"emb": torch.randn(30, 4), "emb_sum": torch.randn(30)}
    with Checkpointer(store_path, policy=EveryK(3), aligned={"emb_sum": "emb"}) as ckpt:
        for step in range(6):  # base, delta, delta, base, delta, delta
            state["t3"].view(-1)[step] += 1
            state["emb_sum"][step] += 1
            ckpt.save(step, state)
        assert_same_state(ckpt.load(5), state)
    assert set(laid) == {0}  # laid out with the first base, kept after
    for step in (1, 2, 4, 5):  # each delta makes the part scans of t3 and emb_sum alone
        assert made.count(step) == 2, (step, made.count(step))


def test_a_base_appends_its_small_tensors_to_the_pack_in_one_call(store_path, monkeypatch):
    # Thousands of tiny tensors (ints and bfloat16 among them, coded or viewed through torch)
    # go into the base's pack together, not one queued put each; a large one still has its file.
    from deltackpt.io.writer import StepWriter

    puts, batches = [], []
    put, put_packed = StepWriter.put, StepWriter.put_packed
    monkeypatch.setattr(StepWriter, "put", lambda self, key, *a, **k: puts.append(key) or put(self, key, *a, **k))
    monkeypatch.setattr(StepWriter, "put_packed", lambda self, chunks: batches.append(len(chunks)) or put_packed(self, chunks))
    state = tiny_state(300) | {"big": torch.randn(1 << 16, 8), "empty": torch.zeros(0, 3)}
    with Checkpointer(store_path, policy=EveryK(100)) as ckpt:
        ckpt.save(1, state)
        assert batches == [300] and puts == ["big"] * len(puts)
        assert_same_state(ckpt.load(1), state)
