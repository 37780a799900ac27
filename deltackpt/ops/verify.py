"""Proving steps restorable without loading a model: chains, sizes and checksums of every chunk.

Verify accepts no less than restore does: records are parsed as strictly (chunk sizes that fit
their place in the grid), coded chunks must decode to the size their place holds, a delta's row
ids must be sorted, unique and inside their part, and a file that cannot be read at all is one
more problem on the list, never the end of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial

import torch

from ..errors import (
    BrokenChainError,
    DeltackptError,
    IntegrityError,
    ManifestError,
    MissingChunkError,
    StepNotFoundError,
)
from ..format.grid import chunk_bytes
from ..format.layout import STEPS, as_step, chunk_path
from ..format.manifest import Manifest, PartRecord, TensorRecord
from ..format.record_io import hashes_key
from ..format.zarr_meta import decode
from ..io.fetch import fetch, fetch_file_in_pieces, file_size, stored_size
from ..io.reader import ChainReader
from ..io.staging import StagingPool
from ..storage import Storage
from ..store import Store


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a step: ``kind`` is ``missing``, ``corrupt``, ``unreadable`` (the
    file cannot be read: a link, a special file, an I/O error), ``record`` or ``chain``."""

    step: int
    kind: str
    key: str
    detail: str


@dataclass
class VerifyReport:
    """What :func:`verify` checked and found.

    Attributes:
        steps: the steps checked (each with its whole chain).
        chunks: chunk files read.
        bytes: bytes read.
        problems: everything wrong, in step order.
    """

    steps: list[int] = field(default_factory=list)
    chunks: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    store: Store,
    step: int | None,
    pool: StagingPool,
    executor: Executor,
    progress: Callable[[int], None] = lambda n: None,
) -> VerifyReport:
    """Re-reads every chunk of the chain of ``step`` (None: of every committed step); each
    record's chunks are read once.

    Args:
        store: the store.
        step: the committed step to check, or None.
        pool: staging buffers for the reads.
        executor: I/O threads.
        progress: called with the bytes of each chunk checked.

    Raises:
        SettingError: ``step`` is no step (see :func:`~deltackpt.format.layout.as_step`).
        StepNotFoundError: ``step`` is not committed.
    """
    steps = store.steps()
    if step is not None:
        if (step := as_step(step)) not in steps:
            raise StepNotFoundError(step, steps)
        steps = [step]
    report = VerifyReport()
    checked: dict[int, list[Problem]] = {}
    for step in steps:
        report.steps.append(step)
        try:
            chain = store.chain(step)
        except BrokenChainError as e:
            report.problems.append(Problem(step, "chain", "", str(e)))
            continue
        except DeltackptError as e:
            report.problems.append(Problem(step, "record", "", str(e)))
            continue
        report.problems += [p for p in _check_bounds(chain) + _check_shapes(chain)
                            if p not in report.problems]
        for m in chain:
            if m.step not in checked:
                checked[m.step] = _check_step(store, m, pool, executor, report, progress)
                report.problems += checked[m.step]
            elif m.step != step and checked[m.step]:
                report.problems.append(
                    Problem(step, "chain", "", f"its chain includes step {m.step}, which is damaged")
                )
    return report


def _check_bounds(chain: list[Manifest]) -> list[Problem]:
    """Each lossy tensor's chain bound covers its parent's: the loss a chain carries only grows."""
    problems = []
    for parent, m in zip(chain, chain[1:]):
        for key, rec in m.tensors.items():
            held = parent.tensors.get(key)
            carried = held.lossy.chain_bound if held is not None and held.lossy is not None else 0.0
            if carried > (rec.lossy.chain_bound if rec.lossy else 0.0):
                problems.append(Problem(m.step, "record", key,
                                        f"chain bound {rec.lossy.chain_bound if rec.lossy else 0} is "
                                        f"below step {parent.step}'s {carried}"))
    return problems


def _check_shapes(chain: list[Manifest]) -> list[Problem]:
    """Each tensor of the step is in its chain's base with the same dtype and shape (restore
    reads the base's parts into a tensor of the step's)."""
    base, head = chain[0], chain[-1]
    problems = []
    for key, rec in head.tensors.items():
        held = base.tensors.get(key)
        if held is None or (held.dtype, held.shape) != (rec.dtype, rec.shape):
            problems.append(Problem(head.step, "record", key,
                                    f"{key}: {rec.dtype} {list(rec.shape)} at step {head.step}, "
                                    f"{'missing' if held is None else f'{held.dtype} {list(held.shape)}'}"
                                    f" in its base, step {base.step}"))
    return problems


def _check_step(store: Store, m: Manifest, pool: StagingPool, executor: Executor,
                report: VerifyReport, progress: Callable[[int], None]) -> list[Problem]:
    """Every file of the step's packs, then every chunk of its parts (a chunk in a pack is read
    from the pack again and checked on its own), once its part tables read and check."""
    storage = store.storage
    try:
        for rec in m.tensors.values():
            tuple(rec.parts)
    except ManifestError as e:
        return [Problem(m.step, "record", "", str(e))]

    def check(path: str, size: Callable[[], int], read: Callable[[torch.Tensor], None],
              pieces: bool) -> Problem | None:
        try:
            n = size()  # checked against the file before a buffer is sized by it
            buf = pool.acquire((min(n, pool.nbytes) or 1) if pieces else n)
            try:
                read(buf)
            finally:
                pool.release(buf)
        except MissingChunkError as e:
            return Problem(m.step, "missing", e.key, str(e))
        except IntegrityError as e:
            return Problem(m.step, "corrupt", e.key, str(e))
        except DeltackptError as e:  # StoreError: unreadable, whatever the reason
            return Problem(m.step, "unreadable", path, str(e))
        progress(n)
        return None

    # A pack's file is as long as the pack: read through one staging buffer a piece at a time.
    jobs: list[tuple[int, str, Callable[[], int], Callable[[torch.Tensor], None], bool]] = []
    for pack, files in m.packs.items():
        for name, entry in files.items():
            path = f"{STEPS}/{m.attempt}/{pack}/{name}"
            jobs.append((entry[0], path, partial(file_size, storage, m.step, path, entry),
                         partial(fetch_file_in_pieces, storage, m.step, path, entry), True))
    for rank, entry in m.hashes.items():
        path = hashes_key(m.attempt, rank)
        jobs.append((entry[0], path, partial(file_size, storage, m.step, path, entry),
                     partial(fetch_file_in_pieces, storage, m.step, path, entry), True))
    for key, rec in m.tensors.items():
        for part in rec.parts:
            for name, chunk in part.chunks.items():
                jobs.append((chunk[0], chunk_path(m, key, part, name),
                             partial(stored_size, storage, m, key, part, name),
                             partial(_fetch_decodable, storage, m, key, rec, part, name), False))
    futures = []
    for size, path, sizer, read, pieces in jobs:
        report.chunks += 1
        report.bytes += size
        futures.append(executor.submit(check, path, sizer, read, pieces))
    found = [p for f in futures if (p := f.result()) is not None]
    found += _check_ids(storage, m, pool, executor, {p.key for p in found})
    found += _check_hashes(storage, m, pool, executor, {p.key for p in found})
    return sorted(found, key=lambda p: p.key)


def _check_hashes(storage: Storage, m: Manifest, pool: StagingPool, executor: Executor,
                  damaged: set[str]) -> list[Problem]:
    """Each row hash file that passed, read as restore reads it: a file of the record's
    tensors, listing each part's rows (its values are not compared with the rows')."""
    reader = ChainReader(storage, [m], pool, executor)
    found = []
    for key, rec in m.tensors.items():
        for part in rec.parts:
            if part.rank not in m.hashes or hashes_key(m.attempt, part.rank) in damaged:
                continue
            try:
                reader.stored_hashes(m, key, part)
            except IntegrityError as e:
                found.append(Problem(m.step, "corrupt", e.key, str(e)))
                damaged.add(e.key)
            except ManifestError as e:
                found.append(Problem(m.step, "record", hashes_key(m.attempt, part.rank), str(e)))
                damaged.add(hashes_key(m.attempt, part.rank))
            except DeltackptError as e:
                found.append(Problem(m.step, "unreadable", hashes_key(m.attempt, part.rank), str(e)))
                damaged.add(hashes_key(m.attempt, part.rank))
    return found


def _check_ids(storage: Storage, m: Manifest, pool: StagingPool, executor: Executor,
               damaged: set[str]) -> list[Problem]:
    """The row ids of each delta part whose ids chunks passed, read together as restore reads
    them (sorted and unique across its chunks, inside the part), one part at a time (a part's
    ids are 8 bytes a row)."""
    found = []
    for key, rec in m.tensors.items():
        for part in rec.parts if rec.encoding.claims == "rows" else ():
            where = chunk_path(m, key, part, "ids")
            if not part.changed or any(d.startswith(f"{where}/") for d in damaged):
                continue
            try:
                ChainReader(storage, [m], pool, executor).ids(m, key, part)
            except IntegrityError as e:
                found.append(Problem(m.step, "corrupt", e.key, str(e)))
            except DeltackptError as e:
                found.append(Problem(m.step, "unreadable", where, str(e)))
    return found


def _fetch_decodable(storage: Storage, m: Manifest, key: str, rec: TensorRecord, part: PartRecord, name: str,
                     into: torch.Tensor) -> None:
    """Reads and checks a chunk as :func:`fetch` does; a coded one must also decode to the size
    that its place in the grid holds, as restore decodes it, and the chunk (decoded) must pass
    its encoding's own checks."""
    fetch(storage, m, key, part, name, into)
    if name == "zarr.json":
        return
    decoded, coded = chunk_bytes(rec, part, name)
    try:
        data = torch.from_numpy(decode(into.numpy(), decoded)) if coded else into
    except ValueError as e:
        raise IntegrityError(m.step, chunk_path(m, key, part, name), str(e)) from None
    why = rec.encoding.verify_chunk(rec, part, name, data)
    if why is not None:
        raise IntegrityError(m.step, chunk_path(m, key, part, name), why)

