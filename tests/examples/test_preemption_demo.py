"""The preemption example (``examples/preemption_recovery.py``) on real Ray: a child job
sent SIGTERM mid-run, and one whose holder's node is drained with Ray's ``ray
drain-node`` with a deadline, to which its final snapshot is held; each exits with 143
within its deadline after a final snapshot, and a fresh job restores every committed
turn and matches a crash-free run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "preemption_recovery.py"


def _run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray
    done = subprocess.run([sys.executable, str(EXAMPLE), "--rollouts", "2", "--turns", "30",
                           "--tool-seconds", "0.2", "--deadline", "20", *args],
                          capture_output=True, text=True, timeout=220, env=env)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    return out


@pytest.mark.parametrize("how, told, deadline", [
    ((), "SIGTERM", "the deadline: the job's grace period (20s)"),
    # Drained with a 16 s deadline: the final snapshot is held to it (issue 50, row 13).
    (("--drain",), "a drain of a holder's node", "the deadline: the drain's deadline (1")])
def test_a_job_told_to_stop_exits_143_and_its_final_snapshot_restores_every_turn(
        how: tuple[str, ...], told: str, deadline: str) -> None:
    out = _run(*how)
    assert f"told to stop by {told}" in out, out
    assert deadline in out and "3s kept for the exit" in out, out
    assert "it exited with status 143" in out, out
    assert "restored the final snapshot rollout-" in out and "none lost" in out, out
    assert "preemption demo: VERIFIED" in out, out


def test_a_job_stopped_while_every_rollout_is_mid_turn_restores_each_ones_committed_turns(
        ) -> None:
    """Issue 50, case 9, as it was reported: 2.5 s tool calls, a 6 s deadline, SIGTERM
    once each of 3 rollouts has 2 turns committed: the final snapshot continued 0 of 3."""
    out = _run("--rollouts", "3", "--turns", "6", "--tool-seconds", "2.5", "--deadline", "6")
    assert "it exited with status 143" in out, out
    assert "3 rollout(s) continued with" in out and "none lost" in out, out
    assert "restored the final snapshot rollout-" in out, out
    assert "preemption demo: VERIFIED" in out, out
