"""The kernels ship as ``deltackpt.kernels`` only: deltackpt installs no top-level ``kernels``
(another distribution may: transformers requires one of that name)."""

from __future__ import annotations

import subprocess
import sys


def test_no_toplevel_kernels_package(tmp_path):
    # A fresh isolated interpreter (-I: no current directory or PYTHON* variables on sys.path)
    # started outside the repository sees only what the installations provide; here, the repo root
    # may be on sys.path because of how pytest was started. A top-level ``kernels`` it finds must
    # be neither deltackpt's by its distribution's records nor the folder deltackpt.kernels is.
    code = (
        "import importlib.metadata as md, importlib.util, pathlib, deltackpt.kernels; "
        "spec = importlib.util.find_spec('kernels'); "
        "ours = pathlib.Path(deltackpt.kernels.__file__).resolve().parent; "
        "print('deltackpt' in md.packages_distributions().get('kernels', []), "
        "spec is not None and pathlib.Path(spec.origin).resolve().parent == ours)"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False"]
