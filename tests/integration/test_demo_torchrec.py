"""``deltackpt demo --torchrec``: the DLRM as a 2-rank DMP, restored under another plan bit for
bit, resumed identically; a clear error without torchrec."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import trec_model as tm


@pytest.mark.slow
def test_demo_torchrec(tmp_path):
    if tm.torchrec_missing():
        pytest.skip(tm.torchrec_missing())
    # In a child process: importing torchrec here would import triton before the kernel tests
    # set TRITON_INTERPRET.
    done = subprocess.run(
        [sys.executable, "-m", "deltackpt", "demo", "--torchrec", "--scale", "0.002", "--steps", "6",
         "--every", "2", "--base-every", "2", "--path", str(tmp_path), "--json"],
        capture_output=True, text=True)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stderr[-2000:]
    saves = [e for e in events if e["event"] == "saved"]
    assert [(e["step"], e["kind"]) for e in saves] == [(2, "base"), (4, "delta"), (6, "base")]
    done = events[-1]
    assert done["ok"] and done["restore_step"] == 4
    assert not done["restored_mismatches"] and not done["resumed_mismatches"]
    assert done["restored_values"] > 0 and done["resumed_values"] == done["restored_values"]


def test_demo_torchrec_without_torchrec(tmp_path):
    code = ("import sys; sys.modules['torchrec'] = None; from deltackpt.cli import main; "
            f"sys.exit(main(['demo', '--torchrec', '--path', {str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.startswith("deltackpt: error: --torchrec needs torchrec")
    assert "pip install --no-deps torchrec==1.9.2" in done.stderr and "Traceback" not in done.stderr
