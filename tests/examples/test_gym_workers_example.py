"""The NeMo Gym-style example (``examples/gym_workers.py``) on the test cluster: rollouts
run by environment-server processes of their own, crashed mid-rollout, are continued by
new server processes from their saved turns and end equal to a crash-free run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.examples import load_example

EXAMPLE = load_example("gym_workers")


@pytest.mark.timeout(240)
async def test_gym_servers_killed_mid_rollout_are_replaced_and_continue_from_saved_turns(
        cluster: Any, tmp_path: Path) -> None:
    report = await EXAMPLE.run_gym_example(tmp_path, "t-gym-workers", rollouts=6, turns=8)
    told = "\n".join(report.lines)
    assert report.verified, told
    assert report.lines[-1].startswith("VERIFIED: 6 rollouts x 8 turns equal a crash-free "
                                       "run's"), told
    # The snapshot held rollouts mid-way: each continued one resumed from a saved turn,
    # neither from 0 nor finished, and said so.
    assert report.continued, told
    for rollout_id, turns in report.continued.items():
        assert 0 < turns < 8, told
        assert f"{rollout_id}: continued by a new gym server on " in told
        assert f"from its saved turn {turns} of 8" in told
    restored = sum(report.continued.values())
    assert f"{restored} turns were restored, not re-run" in report.lines[-1]
    # The rollout still queued for its server at the snapshot started over, and only it.
    assert report.restarted == ["r5"] and "r5" not in report.continued
    assert "1 dispatched and not opened yet (r5)" in told
    assert "; 1 rollout(s) started over" in report.lines[-1]
    # The snapshot's figures under the names a NeMo RL dashboard finds.
    for name in ("barrier_wait_seconds", "exclusive_hold_seconds", "total_save_seconds"):
        assert f"timing/rollout_checkpoint/{name}=" in told
    # New processes: every server of the restarted job has another pid than before.
    before, after = report.pids
    assert set(before) == set(after) and len(after) == 3  # one per node of the cluster
    assert all(after[i] != before[i] for i in after), report.pids
    assert "CRASH: gym servers, model server, data plane and session holders killed" in told
