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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..format import dtypes
from ..errors import ConvertError, OutputExistsError
from ..storage import LocalStorage, Storage
from ..storage.direct import BLOCK
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
        return torch.Size(self.snap.shape(key)).numel() * self.dtype(key).itemsize

    def blocks(self, key: str, start: int = 0, stop: int | None = None, *, reuse: bool = False):
        for block in self.snap.blocks(key, start, stop, reuse=reuse):
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
                from .torch_file import write_torch

                write_torch(src, tmp)
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
    """The floating-point dtype to convert to, checked: converting floats to integers or bool
    would change their values, and torch converts to no packed float4."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        name = dtype.removeprefix("torch.")
        if name not in dtypes.NAMES:
            raise ConvertError(f"unknown dtype {dtype!r}")
        dtype = dtypes.from_name(name)
    converts = dtype.is_floating_point
    try:
        torch.zeros(1).to(dtype)
    except (RuntimeError, NotImplementedError):
        converts = False
    if not converts:
        raise ConvertError("dtype must be a floating-point dtype torch converts floats to (float16, "
                           f"bfloat16, float8_e4m3fn...), got {dtypes.name(dtype)}")
    return dtype


def _replace(tmp: str, out: str) -> None:
    """Moves ``tmp`` to ``out``; an existing ``out`` (file or folder) is moved aside first and
    removed once ``tmp`` is in place."""
    if not os.path.lexists(out):
        os.replace(tmp, out)
        return
    old = f"{tmp}.old"
    os.replace(out, old)
    os.replace(tmp, out)
    _remove(old)


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
    storage = LocalStorage(folder)
    for name, group in zip(files, groups):
        storage.write(name, _safetensors_parts(src, group, meta))
        weight_map.update({src.sel.names[k]: name for k in group})
    storage.sync(files)
    if len(files) > 1:
        index = {"metadata": {**meta, "total_size": sum(src.nbytes(k) for k in src.sel.names)},
                 "weight_map": weight_map}
        with open(os.path.join(folder, INDEX), "w") as f:
            json.dump(index, f, indent=2)


def _safetensors_parts(src: _Source, keys: list[str], meta: dict[str, str]) -> Iterator[memoryview]:
    """The bytes of one safetensors file, in pieces. The header is padded (with spaces, as the
    format allows) to a 4 KiB boundary and tensors of whole 4 KiB blocks come first, so their
    blocks (aligned in memory) go to the disk past the page cache (see ``LocalStorage.write``)."""
    keys = sorted(keys, key=lambda k: src.nbytes(k) % BLOCK != 0)
    header: dict[str, Any] = {"__metadata__": meta}
    at = 0
    for key in keys:
        n = src.nbytes(key)
        header[src.sel.names[key]] = {"dtype": SAFETENSORS_DTYPES[src.dtype(key)],
                                      "shape": list(src.snap.shape(key)), "data_offsets": [at, at + n]}
        at += n
    doc = json.dumps(header, separators=(",", ":")).encode()
    doc += b" " * (-(8 + len(doc)) % BLOCK)
    yield memoryview(struct.pack("<Q", len(doc)) + doc)
    for key in keys:
        for block in src.blocks(key, reuse=True):
            yield _raw(block)
