"""The kernels ship as ``deltackpt.kernels`` only: no top-level ``kernels`` is installed."""

from __future__ import annotations

import subprocess
import sys


def test_no_toplevel_kernels_package(tmp_path):
    # A fresh isolated interpreter (-I: no current directory or PYTHON* variables on sys.path)
    # started outside the repository sees only what the installation provides; here, the repo root
    # may be on sys.path because of how pytest was started.
    code = (
        "import importlib.util, deltackpt.kernels; "
        "print(importlib.util.find_spec('kernels') is None)"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"
