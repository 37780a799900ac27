"""A writer, a compactor, a GC and a reader on one store, as processes killed at random (SIGKILL)
and started again: no read ever gives other bits than the step's, and in the end every committed
step restores bit for bit and verify finds nothing. The jobs are in ``maintenance_procs``."""

from __future__ import annotations

import pytest

from maintenance_procs import run_and_kill


def test_maintenance_beside_a_writer_all_killed_at_random(tmp_path):
    run_and_kill(str(tmp_path / "store"), {}, tmp_path / "logs", seconds=25, seed=0)


@pytest.mark.slow
def test_maintenance_beside_a_writer_all_killed_at_random_for_minutes(tmp_path):
    run_and_kill(str(tmp_path / "store"), {}, tmp_path / "logs", seconds=300, seed=1)
