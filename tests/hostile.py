"""Building damaged and hostile stores for the hardening tests, from ``docs/format.md`` alone.

A test saves a small store through the public API, then rewrites a commit record, its root and
part tables (recomputing sizes and checksums where a chunk's or a table's bytes change, so only
the hostile part is wrong) or replaces
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

from deltackpt.format import encodings
from deltackpt.format.manifest import Manifest, PartRecord, TensorRecord
from deltackpt.format.part_tables import encode_table
from deltackpt.format.record_checks import parse_manifest
from deltackpt.storage import open_storage
from deltackpt.store import Store

RUN_SECONDS = 60  # a command that takes longer than this hangs


def record_path(root: Path, step: int) -> Path:
    return root / "commits" / f"{step:020d}.json"


def read_record(root: Path, step: int) -> dict:
    """A step's record as one document: the root with every tensor's parts inline, read from its
    part tables (the shape ``show --json`` prints, and :func:`write_record` writes back)."""
    root_doc = json.loads(record_path(root, step).read_bytes())
    return Store(open_storage(str(root))).manifest(step).to_doc() | {"tables": root_doc["tables"]}


def write_record(root: Path, step: int, doc: dict | str) -> None:
    """Replaces a step's record (records are immutable for the library, not for an attacker): a
    string as the root's text, a document (see :func:`read_record`) as a root and part tables
    that hold exactly what it says, checked by nothing."""
    if isinstance(doc, str):
        text = doc
    else:
        data, tables = encode_doc(doc)
        for rank, table in tables.items():
            path = root / "steps" / doc["attempt"] / f"parts.{rank}"
            path.unlink(missing_ok=True)
            path.write_bytes(table)
        text = data.decode()
    path = record_path(root, step)
    path.unlink()
    path.write_text(text)


def encode_doc(doc: dict) -> tuple[bytes, dict[int, bytes]]:
    """A root record and part tables holding what the document (see :func:`read_record`) says,
    whatever it says: nothing is checked."""
    doc = json.loads(json.dumps(doc))
    index = {key: i for i, key in enumerate(doc["tensors"])}
    by_rank: dict[int, list] = {}
    for key, t in doc["tensors"].items():
        rec = TensorRecord(t["dtype"], tuple(t["shape"]), encodings.get(t["encoding"]), ())
        ranks = set()
        for p in t.pop("parts"):
            part = PartRecord(tuple(p["offset"]), tuple(p["shape"]), p["path"], tuple(p["chunk_shape"]),
                              p["changed"], {k: tuple(v) for k, v in p["chunks"].items()}, p["pack"],
                              p.get("rank", 0))
            by_rank.setdefault(part.rank, []).append((index[key], rec, part))
            ranks.add(part.rank)
            t["parts"] = t.get("parts", 0) + 1
        t.setdefault("parts", 0)
        t.setdefault("ranks", [[r, r] for r in sorted(ranks)])
    tables = {rank: encode_table(entries) for rank, entries in sorted(by_rank.items())}
    doc["tables"] = [[rank, len(data), xxhash.xxh3_64_hexdigest(data)] for rank, data in tables.items()]
    return json.dumps(doc).encode(), tables


def parse_doc(doc: dict, where: str = "r") -> Manifest:
    """Parses the record a document (see :func:`read_record`) stands for, every tensor's parts
    read and checked."""
    data, tables = encode_doc(doc)
    m = parse_manifest(data, where, lambda key, size, digest: tables[int(key.rsplit(".", 1)[1])])
    for rec in m.tensors.values():
        tuple(rec.parts)
    return m


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


def set_packed_chunk(root: Path, step: int, key: str, name: str, data: bytes, part: int = 0) -> None:
    """Overwrites chunk ``name`` of a tensor's part where it lies in its pack (``data`` of the
    chunk's size) and makes the record agree (the chunk's and the pack file's checksums)."""
    doc = read_record(root, step)
    p = doc["tensors"][key]["parts"][part]
    size, _, offset = p["chunks"][name]
    assert len(data) == size, (len(data), size)
    files = doc["packs"][p["pack"]]
    path = root / "steps" / doc["attempt"] / p["pack"] / "c.0"
    pack = bytearray(path.read_bytes())
    pack[offset:offset + size] = data
    path.unlink()
    path.write_bytes(bytes(pack))
    p["chunks"][name] = [size, xxhash.xxh3_64_hexdigest(data), offset]
    files["c.0"] = [len(pack), xxhash.xxh3_64_hexdigest(bytes(pack))]
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
