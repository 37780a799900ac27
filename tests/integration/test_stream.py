"""The delta stream: a replica applying deltas() equals load(step) at every step, through bases,
compactions and GC; a consumer behind GC gets StreamGapError; `deltackpt tail` prints it."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from deltackpt import Checkpointer, SettingError, StreamGapError
from deltackpt.cli import main
from deltackpt.ops.gc import Retention
from deltackpt.policy import Differential, EveryK
from deltackpt.statetree import flatten
from helpers import assert_same_state, same_bits


def make_state():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    return model, opt


def train(model, opt, step):
    opt.zero_grad()
    ids = torch.randint(0, 300, (6,))
    model(ids).sum().backward()
    opt.step()


class Replica:
    """A consumer that holds flat tensors and follows the stream."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.step = None
        self.kinds = []

    def follow(self, ckpt):
        for delta in ckpt.deltas(since=self.step):
            delta.apply(self.tensors)
            self.step = delta.step
            self.kinds.append(delta.kind)
            assert_same_state(delta.state(self.tensors), ckpt.load(delta.step))


@pytest.mark.parametrize("policy", [EveryK(4), EveryK(3), Differential(EveryK(5))],
                         ids=["every4", "every3", "differential"])
def test_replica_equals_load_at_every_step_through_compaction_and_gc(tmp_path, policy):
    model, opt = make_state()
    live, late = Replica(), Replica()
    with Checkpointer(tmp_path / "s", policy=policy, chunk_bytes=1 << 12, memory_budget=1 << 16,
                      dense_chunk_bytes=64) as ckpt:
        ckpt.track(model, optimizer=opt)
        for step in range(1, 19):
            train(model, opt, step)
            ckpt.save(step, {"model": model, "optim": opt, "step": step, "lr": [0.1, step / 7]})
            live.follow(ckpt)
            if step == 3:
                late.follow(ckpt)
            if step in (7, 13):
                ckpt.compact(step - 1)
                ckpt.gc(Retention(keep_last=2), grace_seconds=0)
        assert live.step == 18 and "delta" in live.kinds and "full" in live.kinds
        # The consumer left at step 3 finds the steps after it collected: the first one left is
        # a delta of a dropped parent (a gap), or a base, which it can take whole.
        first = ckpt.store.manifest(min(s for s in ckpt.steps() if s > 3))
        if first.kind == "delta":
            assert first.parent not in ckpt.steps()
            with pytest.raises(StreamGapError, match="start again from a base"):
                late.follow(ckpt)
        else:
            late.follow(ckpt)
            assert late.step == 18
        # Starting again from a base it follows.
        restart = Replica()
        restart.tensors = flatten(ckpt.load(17)).tensors
        restart.tensors = {k: s.local for k, s in restart.tensors.items()}
        restart.step = 17
        restart.follow(ckpt)
        assert restart.step == 18


def test_a_job_resumed_from_a_compacted_step_streams_deltas(tmp_path):
    """A job restores the step compaction just folded (from its new base) and saves on: its
    first delta applies to that step, and comes as a delta."""
    model, opt = make_state()
    with Checkpointer(tmp_path / "s") as ckpt:
        ckpt.track(model, optimizer=opt)
        for step in (1, 2):
            train(model, opt, step)
            ckpt.save(step, {"model": model, "optim": opt, "step": step})
        assert ckpt.compact().step == 2
    replica = Replica()
    with Checkpointer(tmp_path / "s", create=False) as ckpt:
        ckpt.track(model, optimizer=opt)
        state = {"model": model, "optim": opt, "step": 0}
        assert ckpt.restore(state) == 2
        for step in (3, 4):
            train(model, opt, step)
            assert ckpt.save(step, {**state, "step": step}).kind == "delta"
        replica.follow(ckpt)
    assert replica.kinds == ["full", "delta", "delta", "delta"]


def test_tail_prints_json_lines_and_safetensors(tmp_path, capsys):
    t = torch.zeros(50, 4)
    bias = torch.zeros(10)
    with Checkpointer(tmp_path / "s") as ckpt:
        ckpt.save(1, {"t": t, "b": bias, "n": 1})
        t[7] = float("nan")
        t[9] = -0.0
        bias[3] = 2.5
        ckpt.save(2, {"t": t, "b": bias, "n": 2})
    assert main(["tail", str(tmp_path / "s"), "--from", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (doc,) = [json.loads(line) for line in lines]
    assert doc["step"] == 2 and doc["kind"] == "delta" and doc["parent"] == 1
    by_key = {c["key"]: c for c in doc["changes"]}
    assert by_key["t"]["ids"] == [7, 9]
    rows = torch.frombuffer(bytearray(base64.b64decode(by_key["t"]["data"])), dtype=torch.float32).view(2, 4)
    assert same_bits(rows, t[[7, 9]])
    assert 3 in by_key["b"]["ids"]
    assert main(["tail", str(tmp_path / "s"), "--out", str(tmp_path / "d")]) == 0
    from safetensors import safe_open

    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[0]["kind"] == "full"
    with safe_open(lines[1]["file"], framework="pt") as f:
        changes = json.loads(f.metadata()["deltackpt.changes"])
        i = [c["key"] for c in changes].index("t")
        assert f.get_tensor(f"changes.{i}.ids").tolist() == [7, 9]
        assert same_bits(f.get_tensor(f"changes.{i}.values"), t[[7, 9]])


def test_tail_out_refuses_a_dtype_safetensors_cannot_hold_in_one_line(tmp_path, capsys):
    with Checkpointer(tmp_path / "s") as ckpt:
        ckpt.save(1, {"c": torch.zeros(5, 2, dtype=torch.complex128)})
    assert main(["tail", str(tmp_path / "s"), "--out", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert err == "deltackpt: error: c: safetensors cannot hold torch.complex128; follow the stream as JSON lines instead\n"
    assert main(["tail", str(tmp_path / "s")]) == 0  # as JSON lines, every dtype
    assert json.loads(capsys.readouterr().out)["changes"][0]["dtype"] == "complex128"


def test_a_stream_from_a_step_that_is_no_int_is_refused(tmp_path):
    with Checkpointer(tmp_path / "s") as ckpt:
        ckpt.save(1, {"t": torch.zeros(5)})
        for since in ("1", 1.0, True):  # "1" failed with a ValueError formatting the step
            with pytest.raises(SettingError, match=f"a step is an int, got {since!r}"):
                list(ckpt.deltas(since=since))
        ckpt.save(2, {"t": torch.ones(5)})
        assert [d.step for d in ckpt.deltas(since=np.int64(1))] == [2]  # was refused


def test_quantized_deltas_stream_and_partial_loads_as_load_decodes_them(tmp_path):
    from deltackpt import Rowwise

    torch.manual_seed(5)
    table = torch.randn(400, 16)
    live = Replica()
    with Checkpointer(tmp_path / "s", policy=EveryK(100), quantize={"t": Rowwise(bits=4)},
                      chunk_bytes=1 << 12, memory_budget=1 << 16) as ckpt:
        for step in range(1, 5):
            table[torch.randint(0, 400, (30,))] += 0.5
            ckpt.save(step, {"t": table, "n": step})
            live.follow(ckpt)
        assert ckpt.store.manifest(4).tensors["t"].encoding.name == "qrows"
        ids = torch.tensor([399, 3, 3, 250])
        assert same_bits(ckpt.load(4, key="t", rows=ids), ckpt.load(4)["t"][ids])
    assert live.kinds == ["full", "delta", "delta", "delta"]
