"""Assertions shared by the tests."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (so NaN payloads and -0.0 count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same_state(got, want, path: str = "") -> None:
    """Recursively compares a loaded state with the expected one, tensors bit for bit."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert same_bits(got, want), f"{path}: tensors differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {set(got)} != {set(want)}"
        for k in want:
            assert_same_state(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_state(g, w, f"{path}/{i}")
    elif isinstance(want, float) and want != want:
        assert got != got, path
    else:
        assert got == want and type(got) is type(want), f"{path}: {got!r} != {want!r}"


def assert_runs_fresh(code: str, *argv: str) -> None:
    """Runs ``code`` (with ``argv``) in a fresh interpreter, which must exit 0; else fails with
    the end of what it wrote to stderr."""
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def checkpointer_threads() -> set[threading.Thread]:
    """The live threads checkpointers start (not the process's one kernel and buffer warm-up)."""
    return {t for t in threading.enumerate()
            if t.name.startswith(("deltackpt-io", "deltackpt-save", "deltackpt-lease"))}
