"""Saves that return once the state is staged: what training does next never reaches the step,
failures surface at the next call, and at most one save is in flight."""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from deltackpt import Checkpointer, ClosedError, LocalStorage, ReentrantCallError, StoreError, kernels
from deltackpt.save.pending import SaveHandle
from deltackpt.storage import FaultInjection
from faults import HeldWrites
from helpers import assert_same_state, checkpointer_threads

ROWS, DIM = 500, 8


def model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True), nn.Linear(DIM, 1))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer, ids: list[int]) -> None:
    opt.zero_grad()
    model(torch.tensor([ids])).sum().backward()
    opt.step()


def snapshot(state: dict) -> dict:
    return {k: copy.deepcopy(v.state_dict()) if hasattr(v, "state_dict") else v
            for k, v in state.items()}


@pytest.mark.parametrize("tracked", [True, False], ids=["marks", "hashing"])
def test_training_right_after_the_call_does_not_reach_the_step(tmp_path, tracked):
    model, opt = model_and_optimizer()
    state = {"model": model, "optim": opt, "step": 0}
    saved = {}
    with Checkpointer(tmp_path, base_every=3, chunk_bytes=1024, memory_budget=4096) as ckpt:
        if tracked:
            ckpt.track(model, prefix="model", optimizer=opt)
        for s in range(1, 8):
            step(model, opt, [s, 3 * s % ROWS, 100 + s])
            state["step"] = s
            handle = ckpt.save(s, state, blocking=False)
            assert isinstance(handle, SaveHandle) and handle.step == s and handle.blocked_seconds > 0
            saved[s] = snapshot(state)
            with torch.no_grad():  # training goes on at once
                model[1].weight.add_(1.0)
            step(model, opt, list(range(0, ROWS, 7)))
        info = ckpt.wait()
        assert info is not None and info.step == 7 and info.blocked_seconds <= info.seconds
        kinds = [ckpt.store.manifest(s).kind for s in range(1, 8)]
    assert kinds[0] == "base" and "delta" in kinds
    with Checkpointer(tmp_path, create=False) as ckpt:
        for s in range(1, 8):
            fresh_model, fresh_opt = model_and_optimizer(seed=1)
            fresh = {"model": fresh_model, "optim": fresh_opt, "step": 0}
            step(fresh_model, fresh_opt, [0])  # the optimizer holds state to load into
            ckpt.restore(fresh, s)
            assert_same_state(snapshot(fresh), saved[s])


def test_async_and_sync_runs_store_the_same_bits(tmp_path):
    stores = {}
    for blocking in (True, False):
        model, opt = model_and_optimizer()
        state = {"model": model, "optim": opt}
        path = tmp_path / str(blocking)
        with Checkpointer(path, base_every=4, chunk_bytes=1024, memory_budget=4096) as ckpt:
            ckpt.track(model, prefix="model", optimizer=opt)
            for s in range(1, 10):
                step(model, opt, [s, 2 * s, 200 + s])
                ckpt.save(s, state, blocking=blocking)
        stores[blocking] = path
    with Checkpointer(stores[True], create=False) as a, Checkpointer(stores[False], create=False) as b:
        assert a.steps() == b.steps() == list(range(1, 10))
        for s in a.steps():
            assert_same_state(a.load(s), b.load(s))
            restored = []
            for ckpt in (a, b):
                model, opt = model_and_optimizer(seed=1)
                step(model, opt, [0])  # the optimizer holds state to load into
                ckpt.restore({"model": model, "optim": opt}, s)
                restored.append(snapshot({"model": model, "optim": opt}))
            assert_same_state(*restored)


class GatedStorage(LocalStorage):
    """Holds every data write until ``gate`` is set, or fails them while ``failing``."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.failing = False

    def write(self, key, parts):
        if "/steps/" in f"/{key}":
            assert self.gate.wait(60)
            if self.failing:
                raise StoreError(28, f"injected full disk: {key}")
        super().write(key, parts)


def test_steps_change_only_at_commit_and_the_next_call_waits(tmp_path):
    storage = GatedStorage(tmp_path)
    t = torch.zeros(300, 4)
    with Checkpointer(storage, chunk_bytes=1024, memory_budget=64 * 1024) as ckpt:
        storage.gate.clear()
        handle = ckpt.save(1, {"t": t}, blocking=False)
        t += 5  # after the call: not in step 1
        assert not handle.done() and ckpt.steps() == [] and ckpt.latest_step() is None
        with pytest.raises(TimeoutError, match="step 1"):
            handle.result(timeout=0.05)
        storage.gate.set()
        assert ckpt.load(1)["t"].sum() == 0  # load waits for the save in flight
        assert handle.done() and ckpt.steps() == [1] and handle.result().kind == "base"
        assert ckpt.latest_step() == 1
        assert ckpt.wait() is None  # load waited for it already


def test_a_failed_background_save_raises_at_the_next_call_and_loses_nothing(tmp_path):
    storage = GatedStorage(tmp_path)
    model, opt = model_and_optimizer()
    state = {"model": model, "optim": opt}
    with Checkpointer(storage, base_every=100, chunk_bytes=1024, memory_budget=8192) as ckpt:
        ckpt.track(model, prefix="model", optimizer=opt)
        step(model, opt, [1])
        ckpt.save(1, state)
        step(model, opt, [7, 9])
        storage.failing = True
        ckpt.save(2, state, blocking=False)  # staged; its writes fail behind training
        step(model, opt, [11])
        with pytest.raises(StoreError, match="injected full disk"):
            ckpt.save(3, state, blocking=False)  # raises the failure before saving anything
        storage.failing = False
        assert ckpt.steps() == [1]
        info = ckpt.save(3, state)
        # Rows 7, 9 (of the failed save) and 11 of the table and of its Adagrad sum, and the
        # Linear layer's one row of weight and of its sum.
        assert info.kind == "delta" and info.rows_changed == 2 * 3 + 2
        want = snapshot(state)
    with Checkpointer(tmp_path, create=False) as ckpt:
        assert ckpt.steps() == [1, 3]
        assert_same_state(ckpt.load(3), want)


def test_restore_waits_for_the_save_in_flight(tmp_path):
    storage = GatedStorage(tmp_path)
    model, opt = model_and_optimizer()
    state = {"model": model, "optim": opt}
    with Checkpointer(storage, chunk_bytes=1024, memory_budget=256 * 1024) as ckpt:  # staged whole
        ckpt.track(model, prefix="model", optimizer=opt)
        step(model, opt, [1, 2])
        storage.gate.clear()
        ckpt.save(1, state, blocking=False)
        want = snapshot(state)
        step(model, opt, [3])  # after the call: not in step 1
        threading.Timer(0.2, storage.gate.set).start()
        assert ckpt.restore(state, 1) == 1  # step 1 exists only once the save in flight committed
        assert_same_state(snapshot(state), want)


def test_close_raises_a_failed_background_save_and_leaves_no_thread(tmp_path):
    storage = GatedStorage(tmp_path)
    model, opt = model_and_optimizer()
    state = {"model": model, "optim": opt}
    before = checkpointer_threads()
    ckpt = Checkpointer(storage, chunk_bytes=1024, memory_budget=8192)
    ckpt.track(model, prefix="model", optimizer=opt)
    step(model, opt, [1])
    ckpt.save(1, state)
    step(model, opt, [5])
    storage.failing = True
    ckpt.save(2, state, blocking=False)
    with pytest.raises(StoreError, match="injected full disk"):
        ckpt.close()
    assert checkpointer_threads() <= before
    with Checkpointer(tmp_path, create=False) as again:
        assert again.steps() == [1] and again.verify().ok


def test_close_finishes_the_save_in_flight(tmp_path):
    t = torch.arange(4000.0).reshape(1000, 4)
    ckpt = Checkpointer(tmp_path, chunk_bytes=1024, memory_budget=4096)
    ckpt.save(1, {"t": t}, blocking=False)
    t.zero_()
    ckpt.close()
    with Checkpointer(tmp_path, create=False) as again:
        assert again.steps() == [1] and torch.equal(again.load(1)["t"], torch.arange(4000.0).reshape(1000, 4))


def test_a_closed_checkpointer_refuses_every_call_but_close(tmp_path):
    t = torch.arange(4000.0).reshape(1000, 4)
    ckpt = Checkpointer(tmp_path, chunk_bytes=1024, memory_budget=4096)
    ckpt.save(1, {"t": t}, blocking=False)
    ckpt.close()
    ckpt.close()  # does nothing
    calls = {"save": lambda: ckpt.save(2, {"t": t}), "background save": lambda: ckpt.save(2, {"t": t}, blocking=False),
             "load": lambda: ckpt.load(1), "restore": lambda: ckpt.restore({"t": t}, 1), "wait": ckpt.wait,
             "verify": ckpt.verify, "compact": ckpt.compact, "gc": ckpt.gc, "deltas": lambda: ckpt.deltas()}
    for name, call in calls.items():
        with pytest.raises(ClosedError, match="the Checkpointer is closed"):
            call()
    assert ckpt.steps() == [1]  # a listing of the store needs none of its threads
    with Checkpointer(tmp_path, create=False) as again:
        assert torch.equal(again.load(1)["t"], t) and again.verify().ok


THREADS_SAVING = """
import random, sys, threading, torch
from deltackpt import Checkpointer, StepExistsError
ckpt = Checkpointer(sys.argv[1], chunk_bytes=4096, memory_budget=1 << 16, base_every=1000)
base = torch.randn(2000, 16)
ckpt.save(0, {"t": base.clone()})
states, refused = {}, []
def save(step):
    t = base.clone()
    t[step * 10 : step * 10 + 5] += step
    states[step] = t
    try:
        ckpt.save(step, {"t": t}, blocking=step % 2 == 0)
    except StepExistsError:  # another thread's later step committed first
        refused.append(step)
    if step % 3 == 0:
        ckpt.restore({"t": torch.zeros(2000, 16)})
threads = [threading.Thread(target=save, args=(step,)) for step in range(1, 25)]
for t in threads:
    t.start()
for t in threads:
    t.join()
ckpt.wait()
committed = ckpt.steps()[1:]
assert sorted(committed + refused) == list(range(1, 25)), (committed, refused)
assert all(torch.equal(ckpt.load(s)["t"], states[s]) for s in committed)
assert ckpt.verify().ok
ckpt.close()
print(len(committed))
"""


def test_saves_and_restores_from_several_threads_take_turns(tmp_path):
    # At once, several threads' saves each held an I/O thread for its pack and all hung.
    out = subprocess.run([sys.executable, "-c", THREADS_SAVING, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) >= 1


def test_a_save_restore_or_close_inside_a_save_on_its_thread_is_refused(tmp_path, monkeypatch):
    # As a signal handler's runs, on the thread whose save it interrupted: such a save waited
    # for itself on a lock the interrupted one held (the lease's, a pool's) or ran on.
    from deltackpt.save import saver

    t = torch.arange(4000.0).reshape(1000, 4)
    refused: list[str] = []
    scan = saver.scan

    def inside(*args, **kwargs):  # the save's change scan, on the saving thread
        if not refused:
            for what, call in (("save", lambda: ckpt.save(3, {"t": t})), ("restore", lambda: ckpt.restore({"t": t})),
                               ("close", ckpt.close)):
                with pytest.raises(ReentrantCallError, match=f"{what} was called inside this thread's save"):
                    call()
                refused.append(what)
        return scan(*args, **kwargs)

    monkeypatch.setattr(saver, "scan", inside)
    ckpt = Checkpointer(tmp_path, chunk_bytes=1024, memory_budget=8192)
    assert ckpt.save(1, {"t": t}).kind == "base"  # the save they were called in goes on
    assert refused == ["save", "restore", "close"]
    t[5] += 1
    assert ckpt.save(2, {"t": t}, blocking=False).result().kind == "delta"
    ckpt.close()
    with Checkpointer(tmp_path, create=False) as again:
        assert again.steps() == [1, 2] and torch.equal(again.load(2)["t"], t)


def test_close_on_another_thread_waits_for_a_save_under_way(tmp_path):
    # It shut the I/O threads down under the save, which failed with a bare RuntimeError.
    storage = GatedStorage(tmp_path)
    t = torch.arange(4000.0).reshape(1000, 4)
    ckpt = Checkpointer(storage, chunk_bytes=1024, memory_budget=8192)
    storage.gate.clear()
    saved: list[object] = []
    saving = threading.Thread(target=lambda: saved.append(ckpt.save(1, {"t": t})))
    saving.start()
    closing = threading.Thread(target=ckpt.close)
    closing.start()
    closing.join(0.5)
    assert closing.is_alive() and not saved  # the save holds its turn while its writes wait
    storage.gate.set()
    saving.join(60)
    closing.join(60)
    assert not closing.is_alive() and saved[0].kind == "base"
    with Checkpointer(tmp_path, create=False) as again:
        assert again.steps() == [1] and torch.equal(again.load(1)["t"], t)


def test_interpreter_exit_finishes_the_save_in_flight(tmp_path):
    code = ("import sys, torch, deltackpt\n"
            "ckpt = deltackpt.Checkpointer(sys.argv[1], chunk_bytes=4096, memory_budget=16384)\n"
            "t = torch.arange(200000.0)\n"
            "ckpt.save(1, {'t': t}, blocking=False)\n"
            "t.zero_()\n")  # and exit, without close() or wait()
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=300)
    with Checkpointer(tmp_path, create=False) as ckpt:
        assert ckpt.steps() == [1] and torch.equal(ckpt.load(1)["t"], torch.arange(200000.0))
        assert ckpt.verify().ok


def test_the_background_thread_leaves_the_writes_and_checks_to_the_io_threads(tmp_path, monkeypatch):
    # Beside the I/O threads, the background thread would be a third thread hashing and writing
    # while training takes a core of its own.
    threads: dict[str, set[str]] = {"write": set(), "check": set()}
    real = kernels.hash_rows

    def hash_rows(t, **kw):
        threads["check"].add(threading.current_thread().name)
        return real(t, **kw)

    def slow_writes(phase: str, key: str) -> None:  # so that queued jobs wait for a thread
        if phase == "write_chunk" and "/table/" in key:
            threads["write"].add(threading.current_thread().name)
            time.sleep(0.005)

    monkeypatch.setattr(kernels, "hash_rows", hash_rows)  # a base's row hashes: its checks'
    table = torch.randn(16 << 14, 64)  # 16 chunks of 1 MiB, each written and checked apart
    with Checkpointer(FaultInjection(LocalStorage(tmp_path), slow_writes), chunk_bytes=1 << 20,
                      memory_budget=32 << 20, threads=2) as ckpt:
        handle = ckpt.save(1, {"table": table}, blocking=False)
        assert handle.result().kind == "base"
    assert threads["write"] and threads["check"]
    assert all(name.startswith("deltackpt-io") for name in threads["write"] | threads["check"]), threads
    with Checkpointer(tmp_path, create=False) as ckpt:
        assert torch.equal(ckpt.load(1)["table"], table)


def test_a_base_over_the_budget_returns_once_its_last_pieces_are_staged(tmp_path):
    # 16 chunks of 4 rows through 4 staging buffers: the call writes 12 chunks to make room and
    # returns with the last 4 staged, their writes held until the training has changed the table.
    storage = HeldWrites(tmp_path, key="table", passing=12)
    table = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    want = table.clone()
    with Checkpointer(storage, chunk_bytes=256, memory_budget=1024, io_threads=4, threads=4) as ckpt:
        handle = ckpt.save(1, {"table": table, "step": 1}, blocking=False)
        assert storage.passed == 12 and not handle.done() and handle.blocked_seconds > 0
        table.fill_(-1.0)
        storage.open()
        info = handle.result()
        assert info.kind == "base" and info.blocked_seconds <= info.seconds
        assert storage.passed + storage.held == 16 and storage.held <= 4
    with Checkpointer(tmp_path, create=False) as ckpt:
        assert torch.equal(ckpt.load(1)["table"], want) and ckpt.verify().ok
