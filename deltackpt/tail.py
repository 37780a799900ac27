"""The delta stream written out: JSON lines, or a safetensors file per step.

A JSON line per step: ``{"step", "kind", "parent", "tree", "changes": [{"key", "ids", "columns",
"dtype", "shape", "data"}]}``, where ``ids`` lists the changed rows (null: ``data`` is the whole
tensor) and ``data`` is the values' bytes, little-endian, base64-coded, so every value, NaN
payloads included, arrives bit for bit. A safetensors file ``step-<S>.safetensors`` (of a step
whose dtypes safetensors has: not complex, nor the float8 kinds it lacks) holds tensors
``changes.<i>.values`` and ``changes.<i>.ids`` and, in its metadata, the step, kind, parent,
skeleton and each change's key and columns (``deltackpt.changes``).
"""

from __future__ import annotations

import base64
import json
import os
from typing import IO

import torch

from .errors import ConvertError
from .format import dtypes
from .ops.export import SAFETENSORS_DTYPES
from .stream import StepDelta


def _head(delta: StepDelta) -> dict[str, object]:
    return {"step": delta.step, "kind": delta.kind, "parent": delta.parent, "tree": delta.tree}


def write_step_json(delta: StepDelta, out: IO[str]) -> None:
    """Writes one step of the stream as a JSON line to ``out``."""
    changes = []
    for c in delta.changes:
        raw = c.values.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        changes.append({"key": c.key, "ids": None if c.ids is None else c.ids.tolist(),
                        "columns": list(c.columns), "dtype": dtypes.name(c.values.dtype),
                        "shape": list(c.values.shape), "data": base64.b64encode(raw).decode()})
    out.write(json.dumps({**_head(delta), "changes": changes}, separators=(",", ":")) + "\n")
    out.flush()


def write_step_safetensors(delta: StepDelta, folder: str) -> str:
    """Writes one step of the stream as ``folder/step-<S>.safetensors``; returns its path."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    index = []
    for i, c in enumerate(delta.changes):
        if c.values.dtype not in SAFETENSORS_DTYPES:
            raise ConvertError(f"{c.key}: safetensors cannot hold {c.values.dtype}; follow the "
                               "stream as JSON lines instead")
        tensors[f"changes.{i}.values"] = c.values.contiguous()
        if c.ids is not None:
            tensors[f"changes.{i}.ids"] = c.ids
        index.append({"key": c.key, "columns": list(c.columns), "whole": c.ids is None})
    meta = {f"deltackpt.{k}": json.dumps(v) for k, v in _head(delta).items()}
    meta["deltackpt.changes"] = json.dumps(index)
    path = os.path.join(folder, f"step-{delta.step:020d}.safetensors")
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)
    return path
