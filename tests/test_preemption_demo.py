"""The preemption example (``examples/preemption_recovery.py``) on real Ray: a child job
sent SIGTERM mid-run, and one whose holder's node is drained with Ray's ``ray
drain-node``; each exits with 143 within its deadline after a final snapshot, and a
fresh job restores every committed turn and matches a crash-free run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "preemption_recovery.py"


def _run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray
    done = subprocess.run([sys.executable, str(EXAMPLE), "--rollouts", "2", "--turns", "30",
                           "--tool-seconds", "0.2", "--deadline", "20", *args],
                          capture_output=True, text=True, timeout=220, env=env)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    return out


@pytest.mark.parametrize("how, told", [((), "SIGTERM"),
                                       (("--drain",), "a drain of a holder's node")])
def test_a_job_told_to_stop_exits_143_and_its_final_snapshot_restores_every_turn(
        how: tuple[str, ...], told: str) -> None:
    out = _run(*how)
    assert f"told to stop by {told}" in out, out
    assert "it exited with status 143" in out, out
    assert "restored the final snapshot rollout-" in out and "none lost" in out, out
    assert "preemption demo: VERIFIED" in out, out
