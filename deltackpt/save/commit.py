"""The commit phase of a save: each writing rank's part table, then on the coordinator the root
record that names every table and makes the step exist.

Each rank lists the parts it wrote in its own table (``steps/<attempt>/parts.<rank>``, see
:mod:`deltackpt.format.part_tables`), writes it and makes it durable with its chunks before it
answers; the coordinator receives only what the root holds of each rank (:class:`Written`) and
creates the root in one create-only put once every rank answered, so no committed step names a
missing table, and nothing the coordinator does at a commit grows with the parts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..collector import paused
from ..errors import StateError, StepExistsError, StoreError, WriterConflictError
from ..format import dtypes
from ..format.encodings import choose, in_pack
from ..format.layout import commit_key, pack_name
from ..format.lossy import Lossy
from ..format.manifest import (
    FORMAT,
    LOSSY_FORMAT,
    ChunkMap,
    Manifest,
    PartRecord,
    TensorRecord,
)
from ..format.part_tables import Entry, Unchanged, encode_table
from ..format.part_layout import PartLayout
from ..format.record_checks import pack_room
from ..format.lazy_records import Heads, TensorHead, lazy_tensors
from ..format.record_io import checksum, encode_root, tensor_entries
from ..format.zarr_meta import array_doc
from ..ops.gc import holder_chain
from ..ops.lease import Holding
from ..ops.lease import read as read_lease
from ..store import Store
from ..quantization import Rowwise
from .planner import GlobalPlan
from .stage import described
from .types import Kind, SavePlan, WriteItem, WriteResult, Written


@dataclass
class Reuse:
    """What one checkpointer's records share from save to save, made once and kept (saves of
    20,000 tiny tensors made them anew each time): a rank's table entries of the parts a delta
    leaves unchanged, and the coordinator's plan's encoded pieces (see :class:`_PlanPieces`).
    Each checkpointer keeps its own, so two saving in turn keep theirs."""

    # The table of a rank's delta parts all unchanged under its last assignment (by the tensors'
    # indexes in the root, which the assignment keeps from save to save): the same at every delta.
    unchanged: tuple[tuple[Any, ...], Unchanged] | None = None
    plan: _PlanPieces | None = None  # the coordinator's plan stays the same from save to save


@paused()
def part_table(save: SavePlan, rank: int, items: Sequence[WriteItem], index: Sequence[int],
               shapes: Mapping[str, tuple[int, ...]], held: Sequence[int],
               result: WriteResult, sizes: tuple[int, int], aligned: Collection[str] = (),
               reuse: Reuse | None = None) -> tuple[bytes | None, Written]:
    """A writing rank's part table and what it tells the coordinator: each part of ``items`` (the
    parts it writes, each tensor's place in the root ``index`` and its global shape in
    ``shapes``), holding ``held`` rows or chunks each, with the chunks ``result`` lists and the zarr
    metadata the coordinator wrote for it (see :func:`~deltackpt.save.stage.describe`). The table
    is None for a rank that writes no part. ``aligned``: this rank's 1-d tensors whose changes
    are rows (see :class:`~deltackpt.save.scan.PartScan`). ``reuse``: what the rank's last
    saves left to be kept (None: every entry made afresh)."""
    unchanged = None if reuse is None else _unchanged_parts(save, rank, items, index, shapes, sizes, aligned, reuse)
    entries: list[tuple[int, Entry]] = []
    files = rows = 0
    # What a part's entry is made of but its place and chunks, by what that depends on (without a
    # quantization rule): thousands of small tensors come in a few dtypes and shapes.
    made: dict[tuple[Any, ...], tuple[TensorRecord, tuple[int, ...], tuple[int, str] | None, bool]] = {}
    chosen = range(len(items)) if unchanged is None else np.flatnonzero(np.asarray(held, dtype=np.int64)).tolist()
    for n in chosen:
        it, changed = items[n], held[n]
        entry = _entry(save, rank, it, index[n], shapes[it.key], changed,
                       result.files.get((it.key, it.part.path), {}), sizes, it.key in aligned, made)
        entries.append((n, entry))
        files += sum(e[0] for e in entry[2].chunks.values() if len(e) == 2)
        rows += changed if it.tensor.dim() >= 2 else 0
    if unchanged is not None:  # a delta: only its parts that hold something have chunks
        places = {(items[n].key, items[n].part.path) for n, _ in entries}
        if stray := [k for k, chunks in result.files.items() if chunks and k not in places]:
            raise StateError(f"{stray[0][0]!r}: a delta wrote chunks of a part that holds nothing")
    table = (None if not items else encode_table([e for _, e in entries]) if unchanged is None
             else unchanged.encode(entries))
    files += sum(e[0] for chunks in result.packs.values() for e in chunks.values() if len(e) == 2)
    return table, Written(None if table is None else (len(table), checksum(table)), dict(result.packs), files,
                          rows, dict(result.bounds))


def _entry(save: SavePlan, rank: int, it: WriteItem, index: int, shape: tuple[int, ...], changed: int,
           chunks: ChunkMap, sizes: tuple[int, int], aligned: bool, made: dict[tuple[Any, ...], Any]) -> Entry:
    """The table entry of part ``it`` (its tensor ``index`` in the root, of global ``shape``),
    holding ``changed`` rows or chunks in ``chunks``; ``made`` keeps what entries of equal
    fields share."""
    key, part, t = it.key, it.part, it.tensor
    rule = save.quantize[key].rule if key in save.quantize else None
    at = (t.dtype, shape, part.box.shape, changed, aligned) if rule is None else None
    got = made.get(at) if at is not None else None
    if got is None:
        enc = choose(save.kind, shape, rule is not None, aligned)
        cs = enc.chunk_shape(part.box.shape, t.element_size(), changed, sizes, rule)
        meta = None
        for a in described(save.kind, t.dtype, shape, part.box.shape, sizes):
            if not a.name:  # the part's own array (the only one of a base's part)
                doc = array_doc(a.shape, a.chunk_shape, a.dtype, raw=not a.coded)
                meta = (len(doc), checksum(doc))
        got = (TensorRecord(dtypes.name(t.dtype), shape, enc, ()), cs, meta,
               save.kind == Kind.DELTA or in_pack(part.box.shape, t.element_size(), cs))
        if at is not None:
            made[at] = got
    record, cs, meta, in_a_pack = got
    chunks = dict(chunks)
    if meta is not None:
        chunks["zarr.json"] = meta
    # A part without chunks (nothing changed, or no elements) is in no pack.
    packed = bool(chunks) and in_a_pack
    return index, record, PartRecord(part.box.offset, part.box.shape, part.path, cs, changed, chunks,
                                     pack_name(rank) if packed else None, rank)


def _unchanged_parts(save: SavePlan, rank: int, items: Sequence[WriteItem], index: Sequence[int],
                     shapes: Mapping[str, tuple[int, ...]], sizes: tuple[int, int], aligned: Collection[str],
                     reuse: Reuse) -> Unchanged | None:
    """The table of a delta's ``items`` all unchanged, made once for them under their ``index``
    (see :class:`~deltackpt.format.part_tables.Unchanged`), or None for a save whose table is
    made whole (a base, a quantized delta). A base makes it for the deltas after it."""
    if save.quantize:
        return None
    at = (index, rank, sizes, frozenset(aligned))
    last = reuse.unchanged
    if last is None or last[0][0] is not index or last[0][1:] != at[1:]:
        # Each part as _entry makes it holding nothing: its chunk shape is all that it is made of.
        shaped: dict[tuple[Any, ...], tuple[int, ...]] = {}
        parts = []
        for it, i in zip(items, index):
            box, t = it.part.box, it.tensor
            f = (t.dtype, shapes[it.key], box.shape, it.key in aligned)
            if f not in shaped:
                shaped[f] = choose(Kind.DELTA, f[1], False, f[3]).chunk_shape(box.shape, t.element_size(), 0, sizes, None)
            parts.append((i, it.part.path, box.offset, box.shape, shaped[f]))
        last = reuse.unchanged = at, Unchanged(parts)
    return last[1] if save.kind == Kind.DELTA else None


@paused()
def record_root(save: SavePlan, plan: GlobalPlan, written: Sequence[Written], *, head: Manifest | None,
                world_size: int, policy: dict[str, Any], restores: int | None = None,
                aligned: Collection[str] = (), reuse: Reuse | None = None) -> bytes:
    """The root record of a save: every tensor of ``plan`` (its parts are in the tables of the
    ranks that wrote them, which ``written`` lists by rank), each lossy tensor's scheme and
    bounds, and with ``restores`` (the checkpointer has ``quantize=``) the quantization
    decisions, in a format-5 record. ``aligned``: the 1-d tensors whose changes are rows.
    ``reuse``: what the coordinator's last saves left to be kept (None: all made afresh)."""
    return _root(save, plan, written, head=head, world_size=world_size, policy=policy, restores=restores,
                 aligned=aligned, reuse=reuse).encode()


@dataclass(frozen=True)
class _Root:
    """A root record as :func:`record_root` makes it: ``m`` but its encoded ``fields``, the part
    tables it names, and for a lossless root the tensors' fields as a reader parses them."""

    m: Manifest
    tables: dict[int, tuple[int, str]]
    held: dict[str, tuple[int, list[int], PartLayout | None]]
    fields: dict[str, str]
    heads: Heads | None

    def encode(self) -> bytes:
        return encode_root(self.m, self.tables, self.held, encoded=self.fields)

    def parsed(self, store: Store) -> Manifest | None:
        """For a lossless root, what parsing its bytes in ``store`` gives (see
        :func:`~deltackpt.format.record_checks.parse_manifest`), made of what it was made of:
        a root of thousands of tensors takes a tenth of a second to parse. Else None."""
        if self.heads is None:
            return None
        m = self.m
        rooms = {int(name[5:]): pack_room(files) for name, files in m.packs.items()}
        return replace(m, tensors=lazy_tensors(self.heads, m.attempt, self.tables, rooms, store.read_table,
                                               commit_key(m.step)))


@paused()
def _root(save: SavePlan, plan: GlobalPlan, written: Sequence[Written], *, head: Manifest | None,
          world_size: int, policy: dict[str, Any], restores: int | None, aligned: Collection[str],
          reuse: Reuse | None) -> _Root:
    """See :func:`record_root`."""
    step, kind, attempt = save.step, save.kind, save.attempt
    packs: dict[str, ChunkMap] = {}
    bounds: dict[str, float] = {}
    tables: dict[int, tuple[int, str]] = {}
    hashes: dict[int, tuple[int, str]] = {}
    for rank, w in enumerate(written):
        if w.table is not None:
            tables[rank] = w.table
        if w.hashes is not None:
            hashes[rank] = w.hashes
        packs.update(w.packs)
        for key, bound in w.bounds.items():
            bounds[key] = max(bounds.get(key, 0.0), bound)
    pieces = _plan_pieces(plan, Reuse() if reuse is None else reuse)
    encoded = {"tree": pieces.tree}
    tensors: dict[str, TensorRecord] = {}
    heads = None
    if restores is None and not save.quantize and (head is None or head.format == FORMAT):
        # Nothing lossy (a format-4 head carries no loss): the entries depend on the plan, the
        # kind and the aligned tensors alone, and are encoded once for them (a base's, and the
        # deltas' after it, at the base).
        for k in {kind, Kind.DELTA}:
            if (k, frozenset(aligned)) not in pieces.entries:
                pieces.entries[k, frozenset(aligned)] = _entries(plan, k, aligned)
        encoded["tensors"], heads = pieces.entries[kind, frozenset(aligned)]
    else:
        for t in plan.tensors.values():
            rule = save.quantize[t.key].rule if t.key in save.quantize else None
            enc = choose(kind, t.global_shape, rule is not None, t.key in aligned)
            # The parts are not held here: the root lists their count and ranks (plan.writers).
            tensors[t.key] = TensorRecord(t.dtype, t.global_shape, enc, (),
                                          lossy_record(kind, t.key, head, rule, bounds.get(t.key, 0.0)))
    lossy = any(r.lossy is not None for r in tensors.values())
    quantize = None if restores is None else {
        "restores": restores, "tensors": {k: c.to_doc() for k, c in sorted(save.quantize.items())}}
    delta = head is not None and kind == Kind.DELTA
    if kind == Kind.DELTA and head is None:
        raise StateError(f"step {step}: a delta needs the step it applies to")
    m = Manifest(
        step=step,
        kind=kind,
        attempt=attempt,
        parent=head.step if head is not None and delta else None,
        parent_attempt=head.attempt if head is not None and delta else None,
        base=head.base if head is not None and delta else step,
        chain_length=head.chain_length + 1 if head is not None and delta else 0,
        world_size=world_size,
        created=time.time(),
        policy=policy,
        tree=plan.tree,
        tensors=tensors,
        packs=packs,
        bytes_written=sum(w.bytes_written for w in written),
        state_bytes=pieces.state_bytes,
        quantize=quantize,
        format=LOSSY_FORMAT if lossy or restores is not None else FORMAT,
        hashes=hashes,
    )
    return _Root(m, tables, plan.writers, encoded, heads)


@dataclass
class _PlanPieces:
    """What the root records of saves under one plan share, encoded once (a delta of 20,000
    tiny tensors encoded them anew at each save): the tree, the state's bytes, and the tensors'
    entries of a lossless root by kind and aligned tensors."""

    plan: GlobalPlan
    tree: str
    state_bytes: int
    entries: dict[tuple[Kind, frozenset[str]], tuple[str, Heads]] = field(default_factory=dict)


def _entries(plan: GlobalPlan, kind: Kind, aligned: Collection[str]) -> tuple[str, Heads]:
    """The root's ``tensors`` field of a lossless ``kind`` of save under ``plan``, encoded, and
    those fields as a reader parses them."""
    shared: dict[tuple[Any, ...], TensorRecord] = {}  # tensors of equal fields share one
    records = {}
    for t in plan.tensors.values():
        f = (t.dtype, t.global_shape, t.key in aligned)
        if f not in shared:
            shared[f] = TensorRecord(t.dtype, t.global_shape, choose(kind, t.global_shape, False, f[2]), ())
        records[t.key] = shared[f]
    return tensor_entries(records, plan.writers), Heads(_heads(records, plan.writers))


def _heads(tensors: Mapping[str, TensorRecord], held: Mapping[str, tuple[int, list[int], PartLayout | None]]
           ) -> dict[str, TensorHead]:
    """The lossless ``tensors``' fields as a reader parses them from the root (see
    :func:`~deltackpt.format.record_checks.parse_manifest`)."""
    out: dict[str, TensorHead] = {}
    for key, t in tensors.items():
        count, ranks, layout = held[key]
        out[key] = (t.dtype, t.shape, t.encoding, None, count, ranks, layout)
    return out


def _plan_pieces(plan: GlobalPlan, reuse: Reuse) -> _PlanPieces:
    pieces = reuse.plan
    if pieces is None or pieces.plan is not plan:
        pieces = reuse.plan = _PlanPieces(plan, json.dumps(plan.tree, separators=(",", ":"), allow_nan=False),
                                          plan.state_bytes)
    return pieces


def lossy_record(kind: Kind, key: str, head: Manifest | None, rule: Rowwise | None,
                 bound: float) -> Lossy | None:
    """A tensor's loss in a new step: this step's quantization, and what the chain carries."""
    held = head.tensors.get(key) if kind == Kind.DELTA and head is not None else None
    carried = held.lossy.chain_bound if held is not None and held.lossy is not None else 0.0
    if rule is not None and kind == Kind.DELTA:
        return Lossy(rule.scheme, bound, max(carried, bound))
    return Lossy(None, 0.0, carried) if carried > 0 else None


def commit(store: Store, save: SavePlan, plan: GlobalPlan, written: Sequence[Written], *,
           head: Manifest | None, world_size: int, policy: str, lease: Holding | None,
           restores: int | None = None, aligned: Collection[str] = (), reuse: Reuse | None = None
           ) -> Manifest | None:
    """Coordinator: the root record of every rank's part table (see :func:`record_root`; each
    rank made its own durable before it answered), created only if absent while ``lease``
    holds, and kept only if ``lease`` still holds and the parent is still there once the record
    exists. The record as a reader parses it (its parts read from the tables on first use), or
    None when the parent was gone (nothing is committed then).

    Raises:
        WriterConflictError: another writer took the lease over (the record is withdrawn unless
            the new holder builds on it, see :func:`withdraw`).
        StepExistsError: another writer committed the step meanwhile.
        StoreError: creating the record or a check once it exists failed (the record is removed
            if it stands, see :func:`_take_back`).
    """
    made = _root(save, plan, written, head=head, world_size=world_size,
                 policy={"name": policy, "decision": str(save.kind), "reason": save.reason},
                 restores=restores, aligned=aligned, reuse=reuse)
    root = made.encode()
    if lease is None:
        raise StepExistsError(f"step {save.step}: the coordinator holds no writer lease")
    lease.check()
    try:
        manifest = store.commit_root(save.step, root, parsed=made.parsed(store))
        if manifest is None:
            lease.check()
            raise StepExistsError(f"step {save.step} was committed by another writer meanwhile")
        try:
            lease.check()
        except WriterConflictError:
            withdraw(store, manifest, root)
            raise
        if (manifest.parent is not None and manifest.parent_attempt is not None
                and not store.holds(manifest.parent, manifest.parent_attempt)):
            store.withdraw(manifest.step)  # the parent went after decide looked (a fenced writer's)
            return None
    except StoreError as e:  # creating the record, or a check once it exists, failed
        _take_back(store, made.m, root, lease, e)
        raise
    return manifest


def _take_back(store: Store, manifest: Manifest, root: bytes, lease: Holding, error: StoreError) -> None:
    """After creating the record, or a check once it existed, raised: removes it where it stands
    (its folder's sync failed once it was linked, an object store's answer was lost once it was
    stored, or reading the lease or the parent's record failed), so that a save that raises
    commits nothing (if another writer took the lease over meanwhile, as :func:`withdraw` does).
    Where that fails too, ``error`` says so."""
    try:
        if store.holds(manifest.step, manifest.attempt):
            try:
                lease.check()
            except WriterConflictError:
                withdraw(store, manifest, root)
            else:
                store.withdraw(manifest.step)
    except StoreError as again:
        error.add_note(f"the record of step {manifest.step} may stand: removing it failed too ({again})")


def withdraw(store: Store, manifest: Manifest, root: bytes) -> None:
    """Removes the record (``root``, its bytes) of a writer that was taken over between its
    lease checks, unless the new holder builds on it. The new holder publishes its head before
    it checks that the head exists; this reads the lease before and after removing the record,
    and puts the record back if the new holder's chain took it in meanwhile."""
    key = commit_key(manifest.step)
    mine = {key: root}  # read from here once removed

    def built_on() -> bool:
        holder = read_lease(store.storage)[1]
        return holder is not None and manifest.attempt in {
            m.attempt for m in holder_chain(store, holder, mine)}

    if built_on():
        return
    store.withdraw(manifest.step)
    if built_on():
        store.storage.put_if_absent(key, mine[key])
