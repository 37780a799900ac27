"""The runnable examples in the docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import tempfile

import pytest

import deltackpt

MODULES = ["deltackpt"] + sorted(
    m.name for m in pkgutil.walk_packages(deltackpt.__path__, "deltackpt.")
    if not m.name.endswith("__main__")  # importing it runs the command line
)


@pytest.fixture(autouse=True)
def examples_write_under_tmp_path(tmp_path, monkeypatch):
    """The examples make their stores with ``tempfile.mkdtemp()``: under the test's folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as e:  # an optional integration whose framework is not installed
        pytest.skip(f"{name}: {e}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_examples_exist():
    attempted = sum(doctest.testmod(importlib.import_module(n), report=False).attempted
                    for n in ("deltackpt", "deltackpt.checkpointer", "deltackpt.ops.gc"))
    assert attempted >= 5
