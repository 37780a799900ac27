"""Parsing and checking a commit record read from a store.

A record is untrusted (see :mod:`deltackpt.format.limits` and :mod:`deltackpt.format.grid`):
parsing is strict, a record that breaks the format raises :class:`ManifestError` naming the
record and the field, never a deep traceback, and no size read from a record is trusted for an
allocation before it is checked against the shape.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from ..collector import paused
from ..errors import ManifestError
from ..quantization import QuantizationError, Rowwise
from . import dtypes, encodings
from .encodings import Encoding
from .grid import check_pack
from .limits import MAX_DEPTH, MAX_STEP, key_problem, unique_keys
from .lossy import Lossy
from .manifest import FORMATS, KINDS, LOSSY_FORMAT, ChunkMap, Manifest, StepSummary, TensorRecord
from .part_layout import PartLayout, parse_layout
from .lazy_records import Heads, TableReader, TensorHead, lazy_tensors
from .record_io import check_seal

MAX_RANKS = 1 << 24  # ranks one tensor's parts may come from


@paused()
def parse_manifest(data: bytes, where: str, read: TableReader) -> Manifest:
    """Parses and validates a root record; ``where`` names it in errors. Its tensors' parts are
    read by ``read`` from the part tables, and checked, when a reader first asks for them.

    Raises:
        ManifestError: the root breaks the format; a record of format 2 or 3 (written before
            part tables) is refused, naming its format.
    """
    return _parse(_json(data, where), where, read)


@paused()
def parse_summary(data: bytes, where: str) -> StepSummary:
    """Parses a root record's own fields alone, as strictly as :func:`parse_manifest` does, and
    leaves its tree and tensors unchecked: a listing of hundreds of steps of a job of 1,024
    ranks reads each record's step, kind, parent and sizes, not its thousands of tensors (whose
    checks took ~94% of parsing such a root; a restore, load or verify checks them).

    Raises:
        ManifestError: those fields break the format.
    """
    doc = _json(data, where)
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: a commit record must be a JSON object")
    return _summary(doc, where)


def _json(data: bytes, where: str) -> Any:
    try:
        doc = json.loads(data, parse_constant=_reject_constant, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{where}: not valid JSON ({e})") from None
    if isinstance(doc, dict) and "checksum" in doc:  # roots written before checksums have none
        check_seal(data, where)
    return doc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _field(doc: dict[str, Any], name: str, kinds: type | tuple[type, ...], where: str) -> Any:
    if name not in doc:
        raise ManifestError(f"{where}: field {name!r} is missing")
    value = doc[name]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _tuple(kinds)):
        raise ManifestError(f"{where}: field {name!r} has a bad value {value!r:.80}")
    return value


def _tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _optional_count(doc: dict[str, Any], name: str, where: str) -> int | None:
    if doc.get(name) is None:
        if name not in doc:
            raise ManifestError(f"{where}: field {name!r} is missing")
        return None
    return _count(doc, name, where)


def _count(doc: dict[str, Any], name: str, where: str) -> int:
    value: int = _field(doc, name, int, where)
    if value < 0 or value > MAX_STEP:
        raise ManifestError(f"{where}: field {name!r} is out of range: {value}")
    return value


def _summary(doc: dict[str, Any], where: str) -> StepSummary:
    fmt = _field(doc, "format", int, where)
    if fmt not in FORMATS:
        raise ManifestError(f"{where}: format {fmt} is not supported (this version reads {FORMATS}"
                            f"{'; earlier formats kept every part in the record' if fmt in (2, 3) else ''})")
    kind = _field(doc, "kind", str, where)
    if kind not in KINDS:
        raise ManifestError(f"{where}: field 'kind' must be one of {KINDS}, got {kind!r}")
    attempt = _field(doc, "attempt", str, where)
    if "/" in attempt or attempt in ("", ".", ".."):
        raise ManifestError(f"{where}: field 'attempt' has a bad value {attempt!r}")
    created = _field(doc, "created", (int, float), where)
    if not math.isfinite(created):
        raise ManifestError(f"{where}: field 'created' has a bad value {created!r}")
    s = StepSummary(
        step=_count(doc, "step", where),
        kind=kind,
        attempt=attempt,
        parent=_optional_count(doc, "parent", where),
        parent_attempt=_field(doc, "parent_attempt", (str, type(None)), where),
        base=_count(doc, "base", where),
        chain_length=_count(doc, "chain_length", where),
        world_size=_count(doc, "world_size", where),
        created=float(created),
        bytes_written=_count(doc, "bytes_written", where),
        state_bytes=_count(doc, "state_bytes", where),
        compacts=_field(doc, "compacts", (str, type(None)), where),
        lossy=_field(doc, "lossy", bool, where) if fmt == LOSSY_FORMAT else False,
        format=fmt,
    )
    if s.compacts is not None and s.kind != "base":
        raise ManifestError(f"{where}: only a base can stand in for a step ('compacts')")
    if (s.kind == "base") != (s.parent is None) or (s.kind == "base") != (s.base == s.step):
        raise ManifestError(f"{where}: kind {s.kind!r} disagrees with parent {s.parent} / base {s.base}")
    if s.parent is not None and not s.base <= s.parent < s.step:
        raise ManifestError(f"{where}: parent {s.parent} must lie in [base {s.base}, step {s.step})")
    return s


def _parse(doc: Any, where: str, read: TableReader) -> Manifest:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: a commit record must be a JSON object")
    s = _summary(doc, where)
    packs = {}
    for name, files in _field(doc, "packs", dict, where).items():
        if not isinstance(files, dict) or not _PACK.fullmatch(name) or "c.0" not in files:
            raise ManifestError(f"{where}: pack {name!r:.40} has a bad entry {files!r:.80}")
        packs[name] = _chunk_map(files, f"{where}: pack {name!r}", packed=False)
        check_pack(packs[name], f"{where}: pack {name!r}")
    heads = {}
    entries, tree = _field(doc, "tensors", dict, where), _field(doc, "tree", dict, where)
    # The records of a chain list the same keys and tree, checked once (a restore through ten
    # deltas of 20,000 tensors parses eleven records: ~60 ms of each one's ~150 checked them).
    last_tree, last_keys = _sound
    known = last_tree == tree and last_keys == entries.keys()
    # Thousands of tensors share a few distinct entries: each is checked once. repr() of what
    # json.loads builds (dicts, lists, str, int, float, bool, None) tells any two values apart.
    parsed: dict[str, TensorHead] = {}
    for key, rec in entries.items():
        if not known and (why := key_problem(key)) is not None:
            raise ManifestError(f"{where}: tensor key {key!r:.200} is no folder name: {why}")
        same = repr(rec)
        head = parsed.get(same)
        if head is None:
            head = parsed[same] = _parse_tensor(rec, s.format, f"{where}: tensor {key!r}")
        heads[key] = head
    tensors = lazy_tensors(Heads(heads), s.attempt, _tables(doc, "tables", where),
                           {int(name[5:]): pack_room(files) for name, files in packs.items()}, read, where)
    m = Manifest(
        step=s.step,
        kind=s.kind,
        attempt=s.attempt,
        parent=s.parent,
        parent_attempt=s.parent_attempt,
        base=s.base,
        chain_length=s.chain_length,
        world_size=s.world_size,
        created=s.created,
        policy=_field(doc, "policy", dict, where),
        tree=tree,
        tensors=tensors,
        packs=packs,
        bytes_written=s.bytes_written,
        state_bytes=s.state_bytes,
        compacts=s.compacts,
        quantize=_field(doc, "quantize", (dict, type(None)), where) if s.format == LOSSY_FORMAT else None,
        format=s.format,
        hashes=_tables(doc, "hashes", where) if "hashes" in doc else {},
    )
    if m.hashes and (s.kind != "base" or max(m.hashes) >= s.world_size):
        raise ManifestError(f"{where}: field 'hashes' lists row hashes of no rank of a base")
    if s.format == LOSSY_FORMAT:
        if s.lossy != m.lossy:
            raise ManifestError(f"{where}: field 'lossy' disagrees with the tensors' records")
        _check_quantize(m.quantize, m.tensors, where)
    if not known:
        named: set[str] = set()
        check_tree(m.tree, m.tensors, f"{where}: field 'tree'", 0, named)
        if len(named) != len(m.tensors):  # a tensor no load would return
            unnamed = next(k for k in m.tensors if k not in named)
            raise ManifestError(f"{where}: field 'tree' does not name tensor {unnamed!r:.80}")
        _remember(tree, frozenset(entries))
    return m


# The tree and tensor keys of the last record whose keys and tree were found sound (checks that
# depend on nothing else); replaced whole, so a thread reads either the old pair or the new.
_sound: tuple[Any, frozenset[str]] = (None, frozenset())


def _remember(tree: Any, keys: frozenset[str]) -> None:
    global _sound
    _sound = (tree, keys)


# Where a node lies: the record's field, then the keys down to it (joined only for an error).
_Where = str | tuple["_Where", Any]


def _at(where: _Where) -> str:
    keys = []
    while isinstance(where, tuple):
        where, key = where
        keys.append(str(key))
    return "/".join([where, *reversed(keys)])


def check_tree(node: Any, tensors: Mapping[str, TensorRecord], where: _Where, depth: int, named: set[str]) -> None:
    """Checks a state skeleton (see deltackpt.statetree): well-formed nodes, known tensors, each
    named once (added to ``named``: a tensor named twice loaded as one object in two places)."""
    if depth > MAX_DEPTH:
        raise ManifestError(f"{_at(where)}: nested deeper than {MAX_DEPTH}")
    if not isinstance(node, dict) or len(node) != 1:
        raise ManifestError(f"{_at(where)}: a node must be an object with one field, got {node!r:.80}")
    (kind, body), = node.items()
    if kind == "tensor":
        if not isinstance(body, str) or body not in tensors:
            raise ManifestError(f"{_at(where)}: tensor {body!r:.80} is not in 'tensors'")
        if body in named:
            raise ManifestError(f"{_at(where)}: tensor {body!r:.80} is named twice")
        named.add(body)
    elif kind == "float":
        if body not in ("nan", "inf", "-inf"):
            raise ManifestError(f"{_at(where)}: bad float {body!r:.80}")
    elif kind == "value":
        if not (body is None or isinstance(body, (bool, int, float, str))):
            raise ManifestError(f"{_at(where)}: bad value {body!r:.80}")
    elif kind == "dict":
        if not isinstance(body, list) or any(
            not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], (str, int))
            or isinstance(item[0], bool)
            for item in body
        ):
            raise ManifestError(f"{_at(where)}: bad dict node {body!r:.80}")
        for k, child in body:
            check_tree(child, tensors, (where, k), depth + 1, named)
    elif kind in ("list", "tuple"):
        if not isinstance(body, list):
            raise ManifestError(f"{_at(where)}: bad {kind} node {body!r:.80}")
        for i, child in enumerate(body):
            check_tree(child, tensors, (where, i), depth + 1, named)
    else:
        raise ManifestError(f"{_at(where)}: unknown node kind {kind!r:.80}")


def _check_quantize(doc: dict[str, Any] | None, tensors: Mapping[str, TensorRecord], where: str) -> None:
    if doc is None:
        return
    _count(doc, "restores", f"{where}: field 'quantize'")
    for key, choice in _field(doc, "tensors", dict, f"{where}: field 'quantize'").items():
        if key not in tensors or not isinstance(choice, dict) or not all(
                isinstance(choice.get(f), str) for f in ("pattern", "scheme", "reason")):
            raise ManifestError(f"{where}: field 'quantize' has a bad entry for {key!r:.80}")


def _parse_lossy(doc: Any, encoding: Encoding, where: str) -> Lossy:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: field 'lossy' must be a JSON object")
    scheme = _field(doc, "scheme", (str, type(None)), where)
    bounds = []
    for name in ("bound", "chain_bound"):
        v = _field(doc, name, (int, float), where)
        if not (math.isfinite(v) and v >= 0):
            raise ManifestError(f"{where}: field {name!r} has a bad value {v!r}")
        bounds.append(float(v))
    if (scheme is not None) != encoding.quantized or bounds[0] > bounds[1]:
        raise ManifestError(f"{where}: lossy scheme {scheme!r:.40} with encoding {encoding!r}, bound "
                            f"{bounds[0]} and chain bound {bounds[1]} disagree")
    if scheme is not None:
        try:
            Rowwise.from_scheme(scheme)
        except QuantizationError as e:
            raise ManifestError(f"{where}: {e}") from None
    return Lossy(scheme, bounds[0], bounds[1])


def _parse_tensor(rec: Any, fmt: int, where: str) -> TensorHead:
    """A tensor's root fields: dtype, shape, encoding, loss, how many parts, which ranks."""
    if not isinstance(rec, dict):
        raise ManifestError(f"{where}: must be a JSON object")
    shape = _dims(rec, "shape", where)
    if math.prod(shape) >= 2**62:
        raise ManifestError(f"{where}: shape {shape} is too large")
    encoding = encodings.get(_field(rec, "encoding", str, where), where)
    dtype = _field(rec, "dtype", str, where)
    if dtype not in dtypes.NAMES:
        raise ManifestError(f"{where}: unknown dtype {dtype!r:.40}")
    lossy = None
    if fmt == LOSSY_FORMAT and rec.get("lossy") is not None:
        lossy = _parse_lossy(rec["lossy"], encoding, where)
    why = encoding.record_problem(dtype, lossy)
    if why is not None:
        raise ManifestError(f"{where}: {why}")
    ranks: list[int] = []
    runs = _field(rec, "ranks", list, where)
    for run in runs:
        if (not isinstance(run, list) or len(run) != 2 or not all(_is_count(r) for r in run)
                or run[0] > run[1] or (ranks and run[0] <= ranks[-1]) or run[1] - run[0] >= MAX_RANKS):
            raise ManifestError(f"{where}: field 'ranks' has a bad run {run!r:.80}")
        ranks += range(run[0], run[1] + 1)
        if len(ranks) > MAX_RANKS:
            raise ManifestError(f"{where}: field 'ranks' lists more than {MAX_RANKS} ranks")
    count = _count(rec, "parts", where)
    if (count == 0) != (not ranks) or count < len(ranks):
        raise ManifestError(f"{where}: {count} parts cannot come from {len(ranks)} ranks")
    layout = None if rec.get("layout") is None else parse_layout(rec["layout"], tuple(shape), count, runs, where)
    return dtype, tuple(shape), encoding, lossy, count, ranks, layout


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62


def _tables(doc: dict[str, Any], name: str, where: str) -> dict[int, tuple[int, str]]:
    """The root's ``tables`` (or ``hashes``): ``[rank, size, xxh3_64_hex]`` each, ranks ascending."""
    out: dict[int, tuple[int, str]] = {}
    last = -1
    for entry in _field(doc, name, list, where):
        if (not isinstance(entry, list) or len(entry) != 3 or not _is_count(entry[0])
                or not _is_count(entry[1]) or not isinstance(entry[2], str) or len(entry[2]) != 16
                or entry[0] <= last):
            raise ManifestError(f"{where}: field {name!r} has a bad entry {entry!r:.80}")
        out[entry[0]] = (entry[1], entry[2])
        last = entry[0]
    return out


def pack_room(files: ChunkMap) -> int:
    """The bytes of a pack (its files ``c.0``, ``c.1``, ... of one size)."""
    return files["c.0"][0] * sum(name.startswith("c.") for name in files)


def _dims(doc: dict[str, Any], name: str, where: str) -> tuple[int, ...]:
    dims = _field(doc, name, list, where)
    if any(not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < 2**62 for d in dims):
        raise ManifestError(f"{where}: field {name!r} has a bad value {dims!r:.80}")
    return tuple(dims)


_PACK = re.compile(r"pack\.(0|[1-9][0-9]*)", re.ASCII)


def _chunk_map(doc: dict[str, Any], where: str, *, packed: bool) -> dict[str, Any]:
    """File or chunk entries: ``[size, xxh3_64_hex]``, plus the offset in the pack if ``packed``."""
    chunks = {}
    for key, entry in doc.items():
        ok = (
            isinstance(entry, list)
            and len(entry) == 2 + packed
            and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**62
                    for n in entry[:1] + entry[2:])
            and isinstance(entry[1], str)
            and len(entry[1]) == 16
        )
        if not ok or ".." in key.split("/") or key.startswith("/"):
            raise ManifestError(f"{where}: chunk {key!r} has a bad entry {entry!r:.80}")
        chunks[key] = tuple(entry)
    return chunks
