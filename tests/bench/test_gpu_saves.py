"""``bench/gpu_saves.py``, which ``gpu_check.py`` runs on a GPU, on the CPU at a tiny size: its
saves, its bit-for-bit checks and its table cannot rot on a machine without one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_saves_runs_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, "bench/gpu_saves.py", "--device", "cpu", "--tables", "2", "--rows",
                          "4000", "--dim", "8", "--repeat", "1", "--dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith(("| base", "| 1% delta"))]
    assert [r[0].strip() for r in rows] == ["base", "1% delta"]
    for r in rows:  # blocked, to commit, DCP's blocked, DCP's to commit, the ratio: all measured
        assert all(float(x) > 0 for x in r[1:]), r
    assert list(tmp_path.iterdir()) == []  # its scratch folder removed
