"""Building damaged and hostile stores for the hardening tests, from ``docs/format.md`` alone.

A test saves a small store through the public API, then rewrites a commit record (recomputing
sizes and checksums where a chunk's bytes change, so only the hostile part is wrong) or replaces
files and folders by links, FIFOs and the like. Commands run in a child process with a time
limit and an address-space limit, so a hang or a runaway allocation fails the test instead of
hanging or swamping the machine.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import xxhash

RUN_SECONDS = 60  # a command that takes longer than this hangs
ADDRESS_SPACE = 6 << 30  # torch maps ~1-2 GiB; a runaway allocation dies at this limit


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


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def cli(*args: str, timeout: float = RUN_SECONDS) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m deltackpt ARGS`` in a child with a time and memory limit; a run past the
    time limit fails the calling test."""
    import pytest

    try:
        return subprocess.run([sys.executable, "-m", "deltackpt", *args], capture_output=True,
                              text=True, timeout=timeout, preexec_fn=_limits,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"deltackpt {' '.join(args)} hung (> {timeout} s)")


def python(code: str, timeout: float = RUN_SECONDS) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a child Python with the same limits as :func:`cli`."""
    import pytest

    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, preexec_fn=_limits,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"child hung (> {timeout} s): {code[:200]}")


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The single error line a failing command printed (and no traceback)."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
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
