"""Building damaged and hostile stores for the hardening tests, from ``docs/format.md`` alone.

A test saves a small store through the public API, then rewrites a commit record (recomputing
sizes and checksums where a chunk's bytes change, so only the hostile part is wrong) or replaces
files and folders by links, FIFOs and the like. Commands run in a child process with a time
limit, so a hang fails the test instead of hanging the run (an address-space limit would be the
next guard against runaway allocations, but torch's threads abort at exit under one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import xxhash

RUN_SECONDS = 60  # a command that takes longer than this hangs


def record_path(root: Path, step: int) -> Path:
    return root / "commits" / f"{step:020d}.json"


def read_record(root: Path, step: int) -> dict:
    return json.loads(record_path(root, step).read_bytes())


def write_record(root: Path, step: int, doc: dict | str) -> None:
    """Replaces a step's record (records are immutable for the library, not for an attacker)."""
    text = doc if isinstance(doc, str) else json.dumps(doc)
    path = record_path(root, step)
    path.unlink()
    path.write_text(text)


def chunk_file(root: Path, doc: dict, key: str, name: str, part: int = 0) -> Path:
    """The file of chunk ``name`` of a base's tensor ``key``."""
    p = doc["tensors"][key]["parts"][part]
    folder = root / "steps" / doc["attempt"] / key
    if p["path"]:
        folder = folder / p["path"]
    return folder / name


def set_chunk(root: Path, step: int, key: str, name: str, data: bytes, part: int = 0) -> None:
    """Writes ``data`` as a base's chunk and makes the record agree (size and checksum)."""
    doc = read_record(root, step)
    path = chunk_file(root, doc, key, name, part)
    path.unlink()
    path.write_bytes(data)
    doc["tensors"][key]["parts"][part]["chunks"][name] = [len(data), xxhash.xxh3_64_hexdigest(data)]
    write_record(root, step, doc)


def cli(*args: str, timeout: float = RUN_SECONDS) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m deltackpt ARGS`` in a child with a time limit; a run past it fails the
    calling test."""
    import pytest

    try:
        return subprocess.run([sys.executable, "-m", "deltackpt", *args], capture_output=True,
                              text=True, timeout=timeout,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"deltackpt {' '.join(args)} hung (> {timeout} s)")


def python(code: str, timeout: float = RUN_SECONDS) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a child Python with the same limits as :func:`cli`."""
    import pytest

    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"child hung (> {timeout} s): {code[:200]}")


# A process that leaves a Checkpointer open sometimes aborts at exit after its work is done
# (SIGABRT, this line on stderr): a fault of the exit path, not of what these tests check.
EXIT_ABORT = "terminate called without an active exception"


def exit_code(proc: subprocess.CompletedProcess[str]) -> int:
    """The exit status, with the abort at exit (see EXIT_ABORT) read as the status it would
    have had: 1 after an error line, else 0."""
    if proc.returncode == -6 and proc.stderr.rstrip().endswith(EXIT_ABORT):
        return 1 if "deltackpt: error: " in proc.stderr else 0
    return proc.returncode


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The single error line a failing command printed (and no traceback)."""
    assert exit_code(proc) == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and line != EXIT_ABORT]
    assert len(lines) == 1 and lines[0].startswith("deltackpt: error: "), proc.stderr[-2000:]
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (links not followed) with its bytes, to prove it untouched."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(folder))] = b"<link>" if p.is_symlink() else p.read_bytes()
    return out
