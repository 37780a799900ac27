"""The store's layout: where each record, step folder and chunk lives.

```
ROOT/zarr.json                        zarr v3 group; attributes {"deltackpt": {"format": 4}}
ROOT/commits/00000000000000000042.json   root commit record of step 42 (its presence makes step 42 exist)
ROOT/bases/00000000000000000042.json     a base of step 42 made by compaction (optional)
ROOT/steps/zarr.json                  zarr v3 group
ROOT/steps/ATTEMPT/...                arrays of one save attempt, ATTEMPT = "<step>-<random hex>"
ROOT/steps/ATTEMPT/parts.<rank>       the part table of the parts rank <rank> wrote (see part_tables)
ROOT/steps/ATTEMPT/hashes.<rank>      a base's row hashes of the large parts rank <rank> wrote (see hash_files)
ROOT/writer.lease                     who may commit steps (see deltackpt.ops.lease)
```
"""

from __future__ import annotations

import operator
import re
from typing import TYPE_CHECKING, Any

from ..errors import SettingError

if TYPE_CHECKING:
    from .manifest import Manifest, PartRecord

COMMITS = "commits"
BASES = "bases"
STEPS = "steps"
LEASE = "writer.lease"
RECORD_NAME = re.compile(r"([0-9]{20})\.json", re.ASCII)  # whole names only: use fullmatch


def commit_key(step: int) -> str:
    return f"{COMMITS}/{_digits(step)}.json"


def base_key(step: int) -> str:
    """The record of the base that compaction made for ``step``."""
    return f"{BASES}/{_digits(step)}.json"


def as_step(step: Any) -> int:
    """``step`` as an int (numpy's ints are steps); a bool, a string or a float is refused."""
    if not isinstance(step, bool):
        try:
            return operator.index(step)
        except TypeError:
            pass
    raise SettingError(f"a step is an int, got {step!r}")


def _digits(step: int) -> str:
    """A record's name for ``step`` (see :func:`as_step`: formatting a string or a float as one
    failed with a ValueError)."""
    return f"{as_step(step):020d}"


def chunk_key(index: int, ndim: int) -> str:
    """The zarr v3 default key, with the ``.`` separator, of chunk ``index`` along dimension 0
    (``c`` for a 0-d array). ``.`` keeps every chunk file in its array's folder: ``/`` would make
    a folder per chunk row, each one more directory to create and fsync."""
    return ".".join(["c", str(index)] + ["0"] * (ndim - 1)) if ndim else "c"


def part_folder(key: str, path: str) -> str:
    """The folder of a tensor's part (of the tensor, for a part that is the whole tensor)."""
    return f"{key}/{path}" if path else key


def pack_name(rank: int) -> str:
    """The pack holding the chunks rank ``rank`` writes for a delta."""
    return f"pack.{rank}"


def table_name(rank: int) -> str:
    """The part table of the parts rank ``rank`` wrote (see :mod:`.part_tables`)."""
    return f"parts.{rank}"


def hashes_name(rank: int) -> str:
    """The row hashes of the base parts rank ``rank`` wrote (see :mod:`.hash_files`)."""
    return f"hashes.{rank}"


RANK_FILE = re.compile(r"(pack|parts|hashes)\.[0-9]+", re.ASCII)
"""The names of :func:`pack_name`, :func:`table_name` and :func:`hashes_name`: a rank's own files
in an attempt folder, beside the tensors' folders (so no tensor key may start with one)."""


def chunk_path(m: Manifest, key: str, part: PartRecord, name: str) -> str:
    """Where a chunk is: its file, or for a chunk in a pack, its name and place in the pack."""
    path = f"{STEPS}/{m.attempt}/{part_folder(key, part.path)}/{name}"
    entry = part.chunks.get(name)
    if part.pack is not None and entry is not None and len(entry) == 3:
        return f"{path} (in {part.pack} at byte {entry[2]})"
    return path
