"""A process that exits with a Checkpointer open, while the kernels still warm up in the
background, exits with its own status: the interpreter's exit waits for the warm-up thread,
whose parallel kernels' threads otherwise abort the process ("terminate called without an
active exception")."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import atexit, sys, threading
# Registered first, so it runs last: the threads still alive once every exit handler has run.
atexit.register(lambda: print("alive:", sorted(t.name for t in threading.enumerate()
                                               if t is not threading.main_thread())))
from deltackpt import Checkpointer
ckpt = Checkpointer(sys.argv[1])
sys.exit(3)  # a failing command: no close()
"""


def test_a_child_exiting_with_a_checkpointer_open_exits_cleanly(tmp_path):
    for i in range(3):
        r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / f"s{i}")], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 3, r.stderr[-2000:]
        assert "terminate called" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert "alive: []" in r.stdout, r.stdout


def test_a_failing_cli_command_exits_cleanly(tmp_path):
    """The command line opens a Checkpointer on the store and fails on the missing step."""
    child = "from deltackpt import Checkpointer; Checkpointer(__import__('sys').argv[1]).close()"
    subprocess.run([sys.executable, "-c", child, str(tmp_path / "s")], check=True, timeout=300)
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "deltackpt", "show", str(tmp_path / "s"), "7"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode not in (0, 134) and r.returncode > 0, r.stderr[-2000:]
        assert "terminate called" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
