"""A process killed at a persist point of a save leaves earlier steps intact and the
half-written step invisible; a later save of that step succeeds."""

from __future__ import annotations

import multiprocessing as mp
import shutil

import pytest

import faults
from deltackpt import Checkpointer
from deltackpt.cli import main as cli
from helpers import assert_same_state


def run_child(path: str, crash_at: int, step: int) -> int:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numba", "deltackpt", "faults"])
    p = ctx.Process(target=faults.save_with_crash, args=(path, crash_at, step))
    p.start()
    p.join(120)
    return p.exitcode


def persist_phases(tmp_path, path: str, step: int) -> list[str]:
    """The persist points a save passes, recorded on a copy of the store."""
    copy = str(tmp_path / "probe")
    shutil.copytree(path, copy)
    storage = faults.CrashingStorage(copy)
    faults.save(storage, step)
    return storage.phases


def crash_points(phases: list[str], every: bool) -> list[int]:
    """1-based points to crash at: all, or the first and last of each phase and the last three."""
    if every:
        return list(range(1, len(phases) + 1))
    picks = {len(phases) - 2, len(phases) - 1, len(phases)}
    for phase in set(phases):
        at = [i + 1 for i, p in enumerate(phases) if p == phase]
        picks.update((at[0], at[-1]))
    return sorted(picks)


def check_crash(path: str, crash_at: int, committed: list[int], new_step: int, capsys) -> None:
    code = run_child(path, crash_at, new_step)
    assert code == 137, f"crash point {crash_at}: the child exited with {code}"
    with Checkpointer(path, create=False) as reader:
        visible = reader.steps()
        if new_step in visible:
            # Killed after the record was linked: the step must be complete.
            assert_same_state(reader.load(new_step), faults.state_at(new_step))
        else:
            assert visible == committed, (crash_at, visible)
        for s in committed:
            assert_same_state(reader.load(s), faults.state_at(s))
        assert reader.verify().ok
    assert cli(["ls", path, "--json"]) == 0
    listed = capsys.readouterr().out
    assert (f'"step": {new_step},' in listed) == (new_step in visible)


def run_crash_test(tmp_path, kind: str, every: bool, capsys) -> None:
    path = str(tmp_path / "store")
    committed = [1] if kind == "base" else [1, 2]
    for s in committed:
        faults.save(faults.CrashingStorage(path), s)
    new_step = committed[-1] + 1
    phases = persist_phases(tmp_path, path, new_step)
    assert {"write_chunk", "fsync", "write_manifest_tmp", "rename_manifest", "fsync_dir"} <= set(phases)
    for crash_at in crash_points(phases, every):
        check_crash(path, crash_at, committed, new_step, capsys)
        with Checkpointer(path, create=False) as reader:
            if new_step in reader.steps():
                break
    else:
        raise AssertionError("no crash point after the commit was exercised")
    with Checkpointer(path, create=False) as reader:
        assert reader.steps() == [*committed, new_step]
        assert reader.verify().ok


@pytest.mark.parametrize("kind", ["base", "delta"])
def test_crash_at_sampled_persist_points(tmp_path, kind, capsys):
    run_crash_test(tmp_path, kind, every=False, capsys=capsys)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["base", "delta"])
def test_crash_at_every_persist_point(tmp_path, kind, capsys):
    run_crash_test(tmp_path, kind, every=True, capsys=capsys)
