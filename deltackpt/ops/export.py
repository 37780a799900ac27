"""Export: one committed step written as a PyTorch DCP checkpoint, safetensors or a torch.save file.

Every format streams: a tensor is read from the chain in blocks of rows (at most half the memory
budget each) and each block goes to the output before the next is read, so an export holds one
block at a time, not the state. The output is written under a temporary name beside ``out`` and
renamed into place at the end; an existing ``out`` is replaced only with ``overwrite=True``.

* ``"safetensors"``: a folder with ``model.safetensors``, or above ``shard_bytes`` the files
  ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json`` (Hugging Face's
  layout). Tensors are named by their dotted path (``model.emb.weight``); the header's
  ``__metadata__`` keeps the state's skeleton (``deltackpt.tree``), so an import rebuilds plain
  values and nesting.
* ``"torch"``: one file ``torch.load(out, weights_only=True)`` reads: the nested state as saved.
* ``"dcp"``: a folder :func:`torch.distributed.checkpoint.load` reads, each tensor cut into the
  row blocks of ``world_size`` ranks (see :mod:`deltackpt.ops.dcp`).

With ``keys`` only the chosen tensors are written, as a flat mapping by dotted name; with
``prefix`` only the subtree there (``prefix="model"``: the model's state dict, names relative).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import uuid
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import statetree
from ..format import dtypes
from ..errors import ConvertError, OutputExistsError
from ..storage import Storage
from .snapshot import MiB, Selection, Snapshot

FORMATS = ("dcp", "safetensors", "torch")
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExportInfo:
    """What an export wrote.

    Attributes:
        step: the step exported.
        format: ``"dcp"``, ``"safetensors"`` or ``"torch"``.
        out: the file or folder written.
        files: the files in it.
        tensors: tensors written.
        bytes: tensor bytes written (after any dtype conversion).
        seconds: wall time.
    """

    step: int
    format: str
    out: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    seconds: float


class _Source:
    """The snapshot plus the selection, with the dtype conversion and progress of one export."""

    def __init__(self, snap: Snapshot, sel: Selection, dtype: torch.dtype | None,
                 progress: Callable[[int], None]):
        self.snap, self.sel, self._dtype, self.progress = snap, sel, dtype, progress
        self.written = 0

    def dtype(self, key: str) -> torch.dtype:
        saved = self.snap.dtype(key)
        return self._dtype if self._dtype is not None and saved.is_floating_point else saved

    def nbytes(self, key: str) -> int:
        return torch.Size(self.snap.shape(key)).numel() * torch.empty((), dtype=self.dtype(key)).element_size()

    def blocks(self, key: str, start: int = 0, stop: int | None = None):
        for block in self.snap.blocks(key, start, stop):
            block = block.to(self.dtype(key))
            yield block
            self.written += block.nbytes
            self.progress(block.nbytes)


def export(path: str | os.PathLike[str] | Storage, step: int | None, to: str,
           out: str | os.PathLike[str], *, world_size: int | None = None,
           keys: Sequence[str] | None = None, prefix: str | None = None,
           dtype: torch.dtype | str | None = None, overwrite: bool = False,
           shard_bytes: int = 5 * 1024 * MiB, memory_budget: int = 256 * MiB,
           progress: Callable[[int], None] = lambda n: None) -> ExportInfo:
    """Writes ``step`` of the store at ``path`` as a DCP checkpoint, safetensors or a torch.save file.

    Args:
        path: the store.
        step: the step (None: the latest).
        to: ``"dcp"``, ``"safetensors"`` or ``"torch"``.
        out: the folder (dcp, safetensors) or file (torch) to create.
        world_size: for dcp, lay each tensor out as the row blocks of this many ranks.
        keys: only these tensors (flat keys, prefixes or globs), written flat by dotted name.
        prefix: only the subtree at this flat-key prefix, named relative to it.
        dtype: convert floating-point tensors to this dtype (``"bfloat16"``); others stay.
        overwrite: replace an existing ``out``.
        shard_bytes: for safetensors, start a new file before one would exceed this.
        memory_budget: bytes of reads in flight plus the block being written.
        progress: called with the bytes of each block written.

    Returns:
        What was written.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
        ConvertError: a bad format, option or dtype for the format.
        KeyMismatchError: a key pattern selects nothing.
        StepNotFoundError, BrokenChainError, IntegrityError: as :meth:`Checkpointer.load`.

    Example:
        >>> import os, tempfile, torch, deltackpt
        >>> d = tempfile.mkdtemp()
        >>> with deltackpt.Checkpointer(f"{d}/s") as ckpt:
        ...     _ = ckpt.save(1, {"model": {"w": torch.ones(2, 2)}, "step": 1})
        >>> info = deltackpt.export(f"{d}/s", 1, "torch", f"{d}/out.pt")
        >>> torch.load(f"{d}/out.pt", weights_only=True)["model"]["w"].sum().item()
        4.0
    """
    t0 = time.perf_counter()
    if to not in FORMATS:
        raise ConvertError(f"unknown export format {to!r}; choose one of {', '.join(FORMATS)}")
    if world_size is not None and (to != "dcp" or not isinstance(world_size, int) or world_size < 1):
        raise ConvertError(f"world_size must be a positive int and only applies to dcp, got {world_size!r}")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ConvertError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
    if keys is not None and prefix is not None:
        raise ConvertError("choose tensors by keys or by prefix, not both")
    target = _dtype(dtype)
    out = os.path.abspath(os.fspath(out))
    if os.path.lexists(out) and not overwrite:
        raise OutputExistsError(f"{out} exists; pass overwrite=True (--force) to replace it")
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{uuid.uuid4().hex[:8]}.tmp")
    with Snapshot(path, step, memory_budget=memory_budget) as snap:
        src = _Source(snap, snap.select(keys, prefix), target, progress)
        try:
            if to == "safetensors":
                _write_safetensors(src, tmp, shard_bytes)
            elif to == "torch":
                _write_torch(src, tmp)
            else:
                from .dcp import write_dcp

                write_dcp(src, tmp, world_size or 1)
            _replace(tmp, out)
        except BaseException:
            _remove(tmp)
            raise
    files = tuple(sorted(os.listdir(out))) if os.path.isdir(out) else (os.path.basename(out),)
    return ExportInfo(snap.step, to, out, files, len(src.sel.names), src.written, time.perf_counter() - t0)


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in dtypes.NAMES:
        raise ConvertError(f"unknown dtype {dtype!r}")
    return dtypes.from_name(name)


def _replace(tmp: str, out: str) -> None:
    if os.path.isdir(out) and not os.path.islink(out):
        old = f"{tmp}.old"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _raw(block: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor."""
    return memoryview(block.reshape(-1).view(torch.uint8).numpy().data) if block.numel() else memoryview(b"")


def named_tree(tree: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The skeleton with each tensor node naming its exported tensor instead of its flat key."""
    (kind, body), = tree.items()
    if kind == "tensor":
        return {"tensor": names[body]}
    if kind == "dict":
        return {"dict": [[k, named_tree(v, names)] for k, v in body]}
    if kind in ("list", "tuple"):
        return {kind: [named_tree(v, names) for v in body]}
    return tree


# -- safetensors ---------------------------------------------------------------------------------


def _write_safetensors(src: _Source, folder: str, shard_bytes: int) -> None:
    groups: list[list[str]] = [[]]
    size = 0
    for key in src.sel.names:
        if src.dtype(key) not in SAFETENSORS_DTYPES:
            raise ConvertError(f"{key}: safetensors cannot hold {src.dtype(key)}")
        n = src.nbytes(key)
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    meta = {"format": "pt", "deltackpt.step": str(src.snap.step)}
    if src.sel.tree is not None:
        meta["deltackpt.tree"] = json.dumps(named_tree(src.sel.tree, src.sel.names), separators=(",", ":"))
    os.makedirs(folder)
    files = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map = {}
    for name, group in zip(files, groups):
        _write_safetensors_file(src, os.path.join(folder, name), group, meta)
        weight_map.update({src.sel.names[k]: name for k in group})
    if len(files) > 1:
        index = {"metadata": {**meta, "total_size": sum(src.nbytes(k) for k in src.sel.names)},
                 "weight_map": weight_map}
        with open(os.path.join(folder, INDEX), "w") as f:
            json.dump(index, f, indent=2)


def _write_safetensors_file(src: _Source, path: str, keys: list[str], meta: dict[str, str]) -> None:
    header: dict[str, Any] = {"__metadata__": meta}
    at = 0
    for key in keys:
        n = src.nbytes(key)
        header[src.sel.names[key]] = {"dtype": SAFETENSORS_DTYPES[src.dtype(key)],
                                      "shape": list(src.snap.shape(key)), "data_offsets": [at, at + n]}
        at += n
    doc = json.dumps(header, separators=(",", ":")).encode()
    doc += b" " * (-len(doc) % 8)
    with open(path, "xb") as f:
        f.write(struct.pack("<Q", len(doc)))
        f.write(doc)
        for key in keys:
            for block in src.blocks(key):
                f.write(_raw(block))
        f.flush()
        os.fsync(f.fileno())


# -- torch.save ----------------------------------------------------------------------------------


def _write_torch(src: _Source, path: str) -> None:
    """A torch.save file written in two passes: torch.save of the state with empty tensors under
    ``skip_data`` lays out the zip with room for every storage; then each tensor's bytes are
    streamed into its record and the zip's CRC-32 fields are set to match."""
    # Never touched (skip_data writes no storage bytes), so these take address space, not memory.
    fakes = {k: torch.empty(src.snap.shape(k), dtype=src.dtype(k)) for k in src.sel.names}
    if src.sel.tree is None:
        obj: Any = {src.sel.names[k]: fakes[k] for k in src.sel.names}
    else:
        obj = statetree.build(src.sel.tree, fakes)
    # torch.save names storages "0", "1", ... as pickling meets them: depth first, in order.
    order = [k for k in _pickle_order(obj, {id(v): k for k, v in fakes.items()})]
    with torch.serialization.skip_data():
        torch.save(obj, path)
    with zipfile.ZipFile(path) as z:
        records = {i.filename.split("/", 1)[1]: i for i in z.infolist() if "/" in i.filename}
        central = z.start_dir
    crcs: dict[str, int] = {}
    with open(path, "r+b") as f:
        for i, key in enumerate(order):
            info = records.get(f"data/{i}")
            if info is None or info.file_size != src.nbytes(key):
                raise ConvertError(f"{key}: torch.save laid out storage {i} unlike the state "
                                   f"({None if info is None else info.file_size} B)")
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            f.seek(info.header_offset + 30 + name_len + extra_len)
            crc = 0
            for block in src.blocks(key):
                data = _raw(block)
                f.write(data)
                crc = zlib.crc32(data, crc)
            crcs[info.filename] = crc
            f.seek(info.header_offset + 14)
            f.write(struct.pack("<I", crc))
        _patch_central_crcs(f, central, crcs)
        f.flush()
        os.fsync(f.fileno())


def _pickle_order(obj: Any, ids: dict[int, str]) -> list[str]:
    if id(obj) in ids:
        return [ids[id(obj)]]
    if isinstance(obj, dict):
        return [k for v in obj.values() for k in _pickle_order(v, ids)]
    if isinstance(obj, (list, tuple)):
        return [k for v in obj for k in _pickle_order(v, ids)]
    return []


def _patch_central_crcs(f: Any, at: int, crcs: dict[str, int]) -> None:
    """Sets the CRC-32 of the central directory entries named in ``crcs``."""
    left = len(crcs)
    while left:
        f.seek(at)
        head = f.read(46)
        if head[:4] != b"PK\x01\x02":
            raise ConvertError("torch.save wrote a zip this export cannot patch")
        name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
        name = f.read(name_len).decode()
        if name in crcs:
            f.seek(at + 16)
            f.write(struct.pack("<I", crcs[name]))
            left -= 1
        at += 46 + name_len + extra_len + comment_len
