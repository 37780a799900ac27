"""docs/format.md's zarr-python example opens a base's tensors without deltackpt."""

from __future__ import annotations

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
    state = {"model": {"emb.weight": torch.randn(1000, 16), "bias": torch.randn(7)},
             "table": torch.randn(300, 4).bfloat16(), "ids": torch.arange(50)}
    with Checkpointer(tmp_path / "s", chunk_bytes=1 << 14, memory_budget=1 << 16) as ckpt:
        ckpt.save(5, state)
    for key, want in [("model/emb.weight", state["model"]["emb.weight"]),
                      ("model/bias", state["model"]["bias"]), ("table", state["table"]), ("ids", state["ids"])]:
        scope = {"root": str(tmp_path / "s"), "step": 5, "key": key}
        exec(example(), scope)
        got = torch.from_numpy(scope["value"])
        if want.dtype == torch.bfloat16:
            got = got.view(torch.bfloat16)
        assert same_bits(got, want), key
