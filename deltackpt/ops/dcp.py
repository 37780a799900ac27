"""PyTorch Distributed Checkpoint (DCP) folders, written from a step and read for an import.

The layout is the one :class:`torch.distributed.checkpoint.FileSystemWriter` makes, so
:func:`torch.distributed.checkpoint.load` reads it on any number of ranks: a file
``__<rank>_0.distcp`` per rank that holds rows, its items back to back, each a ``torch.save`` blob, and
``.metadata``, the pickled :class:`~torch.distributed.checkpoint.metadata.Metadata` naming every
item by its fully qualified name (the dotted path DCP's own flattening gives) with its file,
offset and length. A tensor is written as the row blocks of ``world_size`` ranks (blocks of
``ceil(rows / world_size)`` rows, as ``torch.chunk`` splits), each cut further to stay within
the memory budget; plain values (learning rates, step counters) are byte items on rank 0.

Reading a DCP folder for an import unpickles ``.metadata`` with an unpickler that builds only
DCP's metadata classes and a few torch and builtin types, and loads every item with
``torch.load(weights_only=True)``, so an import runs no code from the checkpoint.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

from .. import statetree
from ..errors import ConvertError
from ..sharding import Box, row_block

METADATA = ".metadata"


def _dcp() -> Any:
    from torch.distributed.checkpoint import filesystem, metadata

    return metadata, filesystem


def write_dcp(src: Any, folder: str, world_size: int) -> None:
    """Writes the selection of ``src`` (an export source) into a new DCP folder."""
    md, fs = _dcp()
    with torch.device("meta"):
        metas = {k: torch.empty(src.snap.shape(k), dtype=src.dtype(k)) for k in src.sel.names}
    if src.sel.tree is None:
        state: dict[str, Any] = {src.sel.names[k]: metas[k] for k in src.sel.names}
    else:
        state = statetree.build(src.sel.tree, metas)
        if not isinstance(state, dict):
            raise ConvertError("DCP needs a state that is a dict at the top")
    by_id = {id(v): k for k, v in metas.items()}
    items: list[tuple[tuple[str | int, ...], Any]] = []
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    traverse_state_dict(state, lambda path, value: items.append((path, value)))
    os.makedirs(folder)
    named = [(".".join(map(str, path)), path, value) for path, value in items]
    planner = {fqn: path for fqn, path, _ in named}
    tensors = {fqn: by_id[id(value)] for fqn, _, value in named if id(value) in by_id}
    blocks = {fqn: _blocks(src.snap.shape(key), world_size) for fqn, key in tensors.items()}
    chunks: dict[str, list[Any]] = {fqn: [] for fqn in tensors}
    storage: dict[Any, Any] = {}
    # Rank by rank, one file open at a time (a thousand ranks must not need a thousand open
    # files); the ranks past the last one holding rows have no file.
    for rank in range(max((len(b) for b in blocks.values()), default=1)):
        name = f"__{rank}_0.distcp"
        with open(os.path.join(folder, name), "xb") as f:
            if rank == 0:  # plain values: byte items on rank 0
                for fqn, _, value in named:
                    if fqn not in tensors:
                        data = io.BytesIO()
                        torch.save(_materialized(value, by_id, src), data)
                        storage[md.MetadataIndex(fqn)] = _append(fs, f, name, data.getvalue())
            for fqn, key in tensors.items():
                if rank >= len(blocks[fqn]):
                    continue
                shape = src.snap.shape(key)
                row = blocks[fqn][rank].offset[0] if shape else 0
                for block in src.blocks(key, row, row + blocks[fqn][rank].shape[0] if shape else None):
                    offsets = torch.Size((row, *[0] * (len(shape) - 1)) if shape else ())
                    row += block.shape[0] if shape else 0
                    at = f.tell()
                    torch.save(block, f)
                    storage[md.MetadataIndex(fqn, offsets)] = fs._StorageInfo(
                        relative_path=name, offset=at, length=f.tell() - at)
                    chunks[fqn].append(md.ChunkStorageMetadata(offsets, block.shape))
            f.flush()
            os.fsync(f.fileno())
    sd_meta = {fqn: md.TensorStorageMetadata(md.TensorProperties(dtype=src.dtype(tensors[fqn])),
                                             torch.Size(src.snap.shape(tensors[fqn])), chunks[fqn])
               if fqn in tensors else md.BytesStorageMetadata() for fqn in planner}
    meta = md.Metadata(state_dict_metadata=sd_meta, planner_data=planner, storage_data=storage,
                       storage_meta=md.StorageMeta(), version=fs.CURRENT_DCP_VERSION)
    with open(os.path.join(folder, METADATA), "xb") as f:
        pickle.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())


def _blocks(shape: tuple[int, ...], world_size: int) -> list[Box]:
    """The row blocks of the ranks that hold rows: the first ``ceil(rows / block)``, blocks of
    ``ceil(rows / world_size)`` rows (rank 0 takes a 0-d or empty tensor whole)."""
    if not shape or shape[0] == 0:
        return [Box((0,) * len(shape), shape)]
    block = -(-shape[0] // world_size)
    return [row_block(shape, r, world_size) for r in range(-(-shape[0] // block))]


def _append(fs: Any, f: Any, name: str, data: bytes) -> Any:
    at = f.tell()
    f.write(data)
    return fs._StorageInfo(relative_path=name, offset=at, length=len(data))


def _materialized(value: Any, by_id: dict[int, str], src: Any) -> Any:
    """A plain value with any tensor inside it (a tuple of tensors is one DCP item) read."""
    if id(value) in by_id:
        return src.snap.read(by_id[id(value)]).to(src.dtype(by_id[id(value)]))
    if isinstance(value, dict):
        return {k: _materialized(v, by_id, src) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_materialized(v, by_id, src) for v in value)
    return value


# -- reading, for an import ----------------------------------------------------------------------

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch", "layout"), ("torch", "memory_format"), ("torch", "dtype"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("builtins", "set"), ("builtins", "frozenset"), ("torch.serialization", "_get_layout"),
}
_TORCH_ATTRS = {"strided", "contiguous_format", "channels_last", "preserve_format"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and nothing that could run code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and (
                name in _TORCH_ATTRS or isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise ConvertError(f"DCP metadata refers to {module}.{name}, which an import does not load")


def read_dcp(folder: str) -> dict[str, Any]:
    """The state of a DCP folder: nested by the paths its metadata records (flat by fully
    qualified name where it records none), every tensor whole on the CPU.

    Raises:
        ConvertError: the folder is not a DCP checkpoint this reader understands, or is damaged.
    """
    try:
        return _read_dcp(folder)
    except ConvertError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of an untrusted folder is one error
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConvertError(f"{folder}: not a DCP checkpoint this reader understands "
                           f"({type(e).__name__}: {why:.200})") from None


def _read_dcp(folder: str) -> dict[str, Any]:
    md, fs = _dcp()
    with open(os.path.join(folder, METADATA), "rb") as f:
        data = f.read()  # unpickled from memory: a length in it never sizes a read of the file
    meta = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(meta, md.Metadata) or not isinstance(meta.storage_data, dict):
        raise ConvertError(f"{folder}: {METADATA} is not DCP metadata")
    flat: dict[str, Any] = {}
    for fqn, item in meta.state_dict_metadata.items():
        if isinstance(item, md.BytesStorageMetadata):
            flat[fqn] = torch.load(io.BytesIO(_item(folder, meta, md.MetadataIndex(fqn))), weights_only=True)
            continue
        if not (isinstance(item, md.TensorStorageMetadata)
                and isinstance(item.properties.dtype, torch.dtype)):
            raise ConvertError(f"{folder}: item {fqn} is neither bytes nor a tensor")
        _check_room(folder, fqn, item, meta)
        t = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        covered = 0
        for c in item.chunks:
            part = torch.load(io.BytesIO(_item(folder, meta, md.MetadataIndex(fqn, c.offsets))),
                              weights_only=True)
            if not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(c.sizes):
                raise ConvertError(f"{folder}: item {fqn} at {list(c.offsets)} is not a tensor "
                                   f"of {list(c.sizes)}")
            t[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] = part
            covered += part.numel()
        if covered != t.numel():
            raise ConvertError(f"{folder}: the chunks of {fqn} cover {covered} of {t.numel()} elements")
        flat[fqn] = t
    return _nest(flat, meta.planner_data)


def _check_room(folder: str, fqn: str, item: Any, meta: Any) -> None:
    """Refuses a tensor whose recorded size its items' bytes on disk cannot hold, before any
    allocation of that size."""
    md, _ = _dcp()
    nbytes = torch.Size(item.size).numel() * torch.empty((), dtype=item.properties.dtype).element_size()
    room = 0
    for c in item.chunks:
        info = meta.storage_data.get(md.MetadataIndex(fqn, c.offsets))
        if info is not None:
            path = os.path.join(folder, os.path.basename(str(info.relative_path)))
            room += min(int(info.length), os.path.getsize(path) if os.path.exists(path) else 0)
    if nbytes > room:
        raise ConvertError(f"{folder}: tensor {fqn} of {list(item.size)} needs {nbytes} B; "
                           f"its items hold {room} B")


def _item(folder: str, meta: Any, index: Any) -> bytes:
    info = meta.storage_data.get(index)
    if info is None:
        raise ConvertError(f"{folder}: no storage entry for {index.fqn} at {index.offset}")
    name = os.path.basename(str(info.relative_path))
    with open(os.path.join(folder, name), "rb") as f:
        f.seek(int(info.offset))
        data = f.read(int(info.length))
    if len(data) != info.length:
        raise ConvertError(f"{folder}/{name}: item {index.fqn} runs past the end of the file")
    return data


def _nest(flat: dict[str, Any], paths: Any) -> dict[str, Any]:
    """Nests values by their recorded paths: str parts are dict keys, int parts list positions."""
    if not isinstance(paths, dict) or set(paths) != set(flat) or not all(
            isinstance(p, tuple) and p and all(isinstance(x, (str, int)) for x in p) for p in paths.values()):
        return flat
    root: dict[str, Any] = {}
    for fqn, value in flat.items():
        node: Any = root
        path = paths[fqn]
        for part, nxt in zip(path, path[1:]):
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = [] if isinstance(nxt, int) else {}
                node = node[part]
            else:
                node = node.setdefault(part, [] if isinstance(nxt, int) else {})
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
            node[last] = value
        else:
            node[last] = value
    return root
