"""Edge-case states: what can be saved exactly round-trips; the rest is refused at ``save`` or
``mark`` with a typed error naming the key and the value, before anything is written."""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch
from helpers import assert_same_state, same_bits

from deltackpt import Checkpointer, SettingError, StateError, StepExistsError, StepNotFoundError
from deltackpt.format import dtypes


@pytest.mark.parametrize("shape", [(0,), (0, 4), (0, 3, 2), (5, 0), (2, 0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
def test_empty_tensors_round_trip_as_base_and_delta(store_path, shape, dtype):
    empty = torch.zeros(shape, dtype=dtype)
    other = torch.arange(1000, dtype=dtype)
    with Checkpointer(store_path, chunk_bytes=64, dense_chunk_bytes=64, memory_budget=1024) as ckpt:
        assert ckpt.save(0, {"e": empty, "o": other}).kind == "base"
        other[3] = 7
        assert ckpt.save(1, {"e": empty, "o": other}).kind == "delta"
        assert_same_state(ckpt.load(0), {"e": empty, "o": torch.arange(1000, dtype=dtype)})
        assert_same_state(ckpt.load(1), {"e": empty, "o": other})
        target = {"e": torch.ones(shape, dtype=dtype), "o": torch.zeros(1000, dtype=dtype)}
        ckpt.restore(target, 1)
        assert_same_state(target, {"e": empty, "o": other})
        assert ckpt.verify().ok


def test_largest_step_round_trips(store_path):
    with Checkpointer(store_path) as ckpt:
        ckpt.save(2**63 - 1, {"w": torch.ones(3)})
        assert ckpt.steps() == [2**63 - 1]
        assert ckpt.load(2**63 - 1)["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("step", [2**63, 10**20, -1])
def test_steps_past_the_format_are_refused(store_path, step):
    with Checkpointer(store_path) as ckpt:
        with pytest.raises(StepExistsError, match=str(step)):
            ckpt.save(step, {"w": torch.ones(3)})
        assert ckpt.steps() == []
    assert not list(store_path.glob("steps/*/zarr.json"))


def _nested(depth: int) -> dict:
    node: dict = {"w": torch.arange(3.0)}
    for i in range(depth - 1):
        node = {f"k{i}": node}
    return node


def test_a_step_is_any_int_numpys_too_and_nothing_else(store_path):
    # save refused numpy ints with a StepExistsError and verify took True for step 1; the
    # bad steps are SettingErrors, as load's, and a numpy step is an int in what comes back.
    with Checkpointer(store_path) as ckpt:
        info = ckpt.save(np.int64(1), {"w": torch.ones(3)})
        handle = ckpt.save(np.int32(2), {"w": torch.zeros(3)}, blocking=False)
        assert type(handle.step) is int and handle.result().step == 2
        assert type(info.step) is int and ckpt.steps() == [1, 2]
        for bad in (True, 3.0, "3"):
            with pytest.raises(SettingError, match=f"a step is an int, got {bad!r}"):
                ckpt.save(bad, {"w": torch.ones(3)})
            with pytest.raises(SettingError, match=f"a step is an int, got {bad!r}"):
                ckpt.verify(bad)
        assert ckpt.steps() == [1, 2]
        assert ckpt.verify(np.int64(1)).ok and ckpt.verify(1).steps == [1]
        with pytest.raises(StepNotFoundError, match="step 5 is not committed"):
            ckpt.verify(5)


def test_deepest_nesting_that_saves_also_loads(store_path):
    from deltackpt.format.limits import MAX_DEPTH

    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, _nested(MAX_DEPTH))
        assert_same_state(ckpt.load(0), _nested(MAX_DEPTH))
        with pytest.raises(StateError, match="nested"):
            ckpt.save(1, _nested(MAX_DEPTH + 1))
        with pytest.raises(StateError, match="nested"):
            ckpt.save(1, _nested(1000))
        assert ckpt.steps() == [0]


def test_meta_tensors_are_refused(store_path):
    with Checkpointer(store_path) as ckpt, pytest.raises(StateError, match="opt/m.*meta"):
        ckpt.save(0, {"opt": {"m": torch.empty(3, device="meta")}})


def test_nested_tensors_are_refused(store_path):
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with Checkpointer(store_path) as ckpt, pytest.raises(StateError, match="nt.*nested"):
        ckpt.save(0, {"nt": nt})


@pytest.mark.parametrize("key", ["\ud800", "a\udfffb"])
def test_lone_surrogate_keys_are_refused(store_path, key):
    with Checkpointer(store_path) as ckpt:
        with pytest.raises(StateError, match="surrogate"):
            ckpt.save(0, {key: torch.ones(2)})
        with pytest.raises(StateError, match="surrogate"):
            ckpt.save(0, {"m": {key: 3}})
        assert ckpt.steps() == []


@pytest.mark.parametrize("bad", [[-1], [100], [3, 2**40], [-(2**62)]])
def test_mark_refuses_ids_outside_the_table(store_path, bad):
    table = torch.zeros(100, 4)
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, {"table": table})
        table[7] = 1.0
        ckpt.mark("table", torch.tensor([7]))
        ckpt.save(1, {"table": table})  # marks are live from here on
        table[8] = 2.0
        with pytest.raises(StateError, match=f"table.*{bad[-1]}"):
            ckpt.mark("table", torch.tensor(bad))
        ckpt.mark("table", torch.tensor([8]))
        ckpt.save(2, {"table": table})
        assert torch.equal(ckpt.load(2)["table"], table)


def test_mark_refuses_ids_past_the_table_before_its_first_save(store_path):
    table = torch.zeros(10, 4)
    with Checkpointer(store_path) as ckpt:
        ckpt.mark("table", torch.tensor([1]))
        ckpt.save(0, {"table": table})
        with pytest.raises(StateError, match="-3"):
            ckpt.mark("table", torch.tensor([-3]))


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (0 or 1 for bool): NaN payloads included."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


@pytest.mark.parametrize("name", sorted(dtypes.NAMES))
def test_every_dtype_saves_deltas_restores_reads_rows_and_streams_bit_for_bit(store_path, name):
    dtype = dtypes.from_name(name)
    gen = torch.Generator().manual_seed(0)
    state = {"rows": random_bits((40, 6), dtype, gen), "flat": random_bits((300,), dtype, gen)}
    saved = []
    with Checkpointer(store_path, dense_chunk_bytes=64) as ckpt:
        ckpt.save(0, state)
        saved.append({k: t.clone() for k, t in state.items()})
        for row in (3, 17):  # one at a time: index_put is not implemented for every dtype
            state["rows"][row] = random_bits((6,), dtype, gen)
        state["flat"][100:110] = random_bits((10,), dtype, gen)
        assert ckpt.save(1, state).kind == "delta"
        saved.append({k: t.clone() for k, t in state.items()})
        for step, want in enumerate(saved):
            got = ckpt.load(step)
            assert all(same_bits(got[k], want[k]) for k in want), (name, step)
        target = {k: torch.zeros_like(t) for k, t in state.items()}
        ckpt.restore(target, 0)
        assert all(same_bits(target[k], saved[0][k]) for k in target), name
        for key, ids in (("rows", [17, 3, 17, 39]), ("flat", [105, 0, 299])):  # rows of a tensor alone
            for step, want in enumerate(saved):
                rows = dtypes.as_bits(want[key])[ids].view(dtype)
                assert same_bits(ckpt.load(step, key=key, rows=ids), rows), (name, key, step)
        replica: dict[str, torch.Tensor] = {}  # a consumer of the delta stream
        for delta in ckpt.deltas():
            delta.apply(replica)
            assert all(same_bits(replica[k], saved[delta.step][k]) for k in state), (name, delta.step)
        assert delta.kind == "delta"


def test_conjugate_and_negative_views_save_and_restore_their_values(store_path):
    """A conjugate view's bytes are its base's, not its values (so are a negative view's, the
    imaginary part of a conjugate): saves store values, and a restore into such views writes
    values, for bases and deltas."""
    base = torch.randn(6, 3, dtype=torch.complex64)
    state = {"conj": base.conj(), "neg": torch.randn(5, 2, dtype=torch.complex64).conj().imag}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    saved = []
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, state)
        saved.append({k: t.resolve_conj().resolve_neg().clone() for k, t in state.items()})
        base[2, 1] += 1 + 2j
        assert ckpt.save(1, state).kind == "delta"
        saved.append({k: t.resolve_conj().resolve_neg().clone() for k, t in state.items()})
        for step, want in enumerate(saved):
            got = ckpt.load(step)
            assert not got["conj"].is_conj() and not got["neg"].is_neg()
            assert all(torch.equal(got[k], want[k]) for k in want), step
        target = {"conj": torch.zeros(6, 3, dtype=torch.complex64).conj(),
                  "neg": torch.zeros(5, 2, dtype=torch.complex64).conj().imag}
        ckpt.restore(target, 1)
        assert torch.equal(target["conj"], state["conj"]) and torch.equal(target["neg"], state["neg"])


def odd_strides(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A contiguous tensor of ``shape`` whose one-element (or empty) dimensions have strides a
    fresh one's lack: the transpose of a tensor of the reversed shape."""
    t = torch.randn(shape[::-1]).to(dtype).permute(*reversed(range(len(shape))))
    assert t.is_contiguous() and t.stride() != torch.empty(shape).stride()
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_contiguous_tensors_with_odd_strides_save_and_restore(store_path, dtype):
    """A dimension of one element may have any stride in a contiguous tensor: such tensors save
    (bases and deltas), load and restore bit for bit, and restore into such targets."""
    state = {"col": odd_strides((300, 1), dtype), "row": odd_strides((1, 1, 7), dtype),
             "none": odd_strides((17, 0), dtype), "big": torch.arange(4000).to(dtype)}
    saved = []
    with Checkpointer(store_path, chunk_bytes=256, dense_chunk_bytes=256, memory_budget=4096) as ckpt:
        for step in range(3):
            if step:
                state["col"][5 * step] += 1
                state["row"][0, 0, step] -= 1
            info = ckpt.save(step, state, blocking=step != 1)
            assert (info if step != 1 else info.result()).kind == ("base" if step == 0 else "delta")
            saved.append({k: t.clone() for k, t in state.items()})
        for step, want in enumerate(saved):
            assert_same_state(ckpt.load(step), want)
            target = {k: odd_strides(tuple(t.shape), dtype) if t.dim() > 1 else torch.zeros_like(t)
                      for k, t in want.items()}
            ckpt.restore(target, step)
            assert_same_state(target, want)
        halves = [ckpt.load(2, row_shard=(r, 2)) for r in range(2)]
        assert torch.equal(torch.cat([h["col"].local for h in halves]), saved[2]["col"])
        assert ckpt.verify().ok


class Color(str, enum.Enum):
    RED = "red"


class Slot(enum.IntEnum):
    FIRST = 1


def test_enum_and_str_subclass_keys_are_their_plain_values(store_path):
    """Keys that are str or int subclasses (enum members, a local subclass pickle cannot name)
    are saved as the plain str or int they equal: ``str()`` of a ``(str, Enum)`` member is its
    name, not its value, and the value is what a plain dict of the same state holds."""
    Local = type("Local", (str,), {})
    state = {Color.RED: torch.ones(2), Slot.FIRST: {Local("x"): torch.arange(3.0)}}
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, state)
        state[Color.RED] += 1
        assert ckpt.save(1, state).kind == "delta"
        got = ckpt.load(1)
        assert [type(k) for k in got] == [str, int] and [type(k) for k in got[1]] == [str]
        assert_same_state(got, {"red": torch.full((2,), 2.0), 1: {"x": torch.arange(3.0)}})
        for keys in ((Color.RED, Slot.FIRST, Local("x")), ("red", 1, "x")):
            target = {keys[0]: torch.zeros(2), keys[1]: {keys[2]: torch.zeros(3)}}
            ckpt.restore(target, 1)
            assert_same_state(target, got)
