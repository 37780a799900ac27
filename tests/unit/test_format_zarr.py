"""docs/format.md's zarr-python example opens a base's tensors without deltackpt."""

from __future__ import annotations

import json
import pathlib
import re

import torch

from deltackpt import Checkpointer
from helpers import same_bits

DOC = pathlib.Path(__file__).parents[2] / "docs" / "format.md"


def example() -> str:
    text = DOC.read_text()
    return re.search(r"<!-- zarr-python example -->\n```python\n(.*?)```", text, re.S).group(1)


def test_zarr_python_reads_a_base_tensor_as_the_doc_says(tmp_path):
    torch.manual_seed(0)
    # Parts over 1 MiB are zarr arrays of their own; smaller ones are in the pack.
    state = {"model": {"emb.weight": torch.randn(20000, 16), "bias": torch.randn(7)},
             "table": torch.randn(300000, 4).bfloat16(), "ids": torch.arange(200000)}
    with Checkpointer(tmp_path / "s", chunk_bytes=1 << 18, memory_budget=1 << 20) as ckpt:
        ckpt.save(5, state)
        assert ckpt.store.manifest(5).tensors["model/bias"].parts[0].pack == "pack.0"
    for key, want in [("model/emb.weight", state["model"]["emb.weight"]),
                      ("table", state["table"]), ("ids", state["ids"])]:
        scope = {"root": str(tmp_path / "s"), "step": 5, "key": key}
        exec(example(), scope)
        got = torch.from_numpy(scope["value"])
        if want.dtype == torch.bfloat16:
            got = got.view(torch.bfloat16)
        assert same_bits(got, want), key
