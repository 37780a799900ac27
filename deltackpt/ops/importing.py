"""Import: a DCP checkpoint, safetensors or a torch.save file committed as a base of a store.

Delta checkpointing then goes on from an existing model: the next save of a Checkpointer that
restored the imported step is a delta against it. The source's kind is found from what is there:
a folder with ``.metadata`` is DCP, a folder of ``*.safetensors`` files (with or without
``model.safetensors.index.json``) or one such file is safetensors, a zip file is a torch.save file.
Nothing from the source runs code: torch.save files and DCP items load with
``torch.load(weights_only=True)``, DCP metadata through an unpickler that builds only its own
classes, safetensors through the safetensors library.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..checkpointer import Checkpointer, SaveInfo
from ..errors import ConvertError
from ..format.record_checks import check_tree
from ..storage import Storage
from .dcp import METADATA, read_dcp


def detect(src: str) -> str:
    """The kind of checkpoint at ``src``: ``"dcp"``, ``"safetensors"`` or ``"torch"``.

    Raises:
        ConvertError: ``src`` is none of them.
    """
    if os.path.isdir(src):
        names = os.listdir(src)
        if METADATA in names:
            return "dcp"
        if any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        raise ConvertError(f"{src}: a folder with neither DCP {METADATA} nor *.safetensors files")
    try:
        with open(src, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise ConvertError(f"{src}: cannot read ({e.strerror})") from None
    if head[:2] == b"PK":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise ConvertError(f"{src}: neither a torch.save file, safetensors nor a DCP folder")


def read_checkpoint(src: str | os.PathLike[str]) -> dict[str, Any]:
    """The state held by a DCP folder, safetensors file or folder, or torch.save file.

    Raises:
        ConvertError: ``src`` is not such a checkpoint, or is damaged.
    """
    src = os.fspath(src)
    kind = detect(src)
    if kind == "dcp":
        return read_dcp(src)
    if kind == "safetensors":
        return _read_safetensors(src)
    try:
        state = torch.load(src, weights_only=True, mmap=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any failure of an untrusted file is one error
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConvertError(f"{src}: not a torch.save file torch.load(weights_only=True) reads ({why})") from None
    if not isinstance(state, Mapping):
        raise ConvertError(f"{src}: holds a {type(state).__name__}, not a state dict")
    return dict(state)


def _read_safetensors(src: str) -> dict[str, Any]:
    from safetensors import SafetensorError, safe_open

    files = [src] if not os.path.isdir(src) else sorted(
        os.path.join(src, n) for n in os.listdir(src) if n.endswith(".safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    tree: str | None = None
    try:
        for path in files:
            with safe_open(path, framework="pt") as f:
                tree = (f.metadata() or {}).get("deltackpt.tree", tree)
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name in tensors:
                        raise ConvertError(f"{src}: tensor {name!r} is in two files")
                    tensors[name] = f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ConvertError(f"{src}: not readable safetensors ({e})") from None
    if tree is None:
        return tensors
    try:
        node = json.loads(tree)
        check_tree(node, dict.fromkeys(tensors), "deltackpt.tree", 0, set())  # type: ignore[arg-type]
        (kind, _), = node.items()
        if kind != "dict":
            raise ValueError("the state is not a dict")
    except Exception as e:  # noqa: BLE001 - a damaged skeleton is one error
        raise ConvertError(f"{src}: bad deltackpt.tree metadata ({e})") from None
    from ..statetree import build

    return build(node, tensors)


def import_checkpoint(src: str | os.PathLike[str], path: str | os.PathLike[str] | Storage, step: int,
                      **options: Any) -> SaveInfo:
    """Commits the checkpoint at ``src`` as a base at ``step`` of the store at ``path``.

    Args:
        src: a DCP folder, a safetensors file or folder, or a torch.save file.
        path: the store (created if absent).
        step: the step to commit; after every step the store holds.
        options: further :class:`Checkpointer` arguments (``chunk_bytes``, ``memory_budget``...).

    Returns:
        The save's info (``kind == "base"``).

    Raises:
        ConvertError: ``src`` is not a checkpoint of those kinds.
        StepExistsError: ``step`` is not after the store's latest step.

    Example:
        >>> import os, tempfile, torch, deltackpt
        >>> d = tempfile.mkdtemp()
        >>> torch.save({"w": torch.ones(3)}, f"{d}/m.pt")
        >>> deltackpt.import_checkpoint(f"{d}/m.pt", f"{d}/store", 100).kind
        'base'
    """
    state = read_checkpoint(src)
    with Checkpointer(path, **options) as ckpt:
        return ckpt.save(step, state)
