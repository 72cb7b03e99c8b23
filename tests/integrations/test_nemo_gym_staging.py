"""Rows staged by NeMo Gym's own token capture (``RolloutTokenCapture`` of nemo-gym
0.7.0, through a ``StagingSink`` whose keys are ``"{rollout_id}/{model_call_id}"``),
written into NeMo RL's staging partition inside turns, and a snapshot's cut checked
against them through the integration (``nemo_ckpt.integrations.nemo_rl``). Gym runs in
a process of its own (``tests/integrations/gym_worker.py``, phase ``stage``); the job is
the in-process one (``tests.harness``)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.errors import SnapshotMismatchError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.storage.checkpoint_folder import environment_dir
from tests.harness import World
from tests.integrations.test_nemo_gym_local import run_worker
from tests.integrations.test_nemo_rl import OWNERS, Job

pytestmark = pytest.mark.timeout(120)
OWNER = "tools/replica-0"


def gym_stage(calls: list[tuple[str, str]], tmp: Path) -> dict[str, Any]:
    """What Gym's capture staged for each ``(rollout id, model call id)``."""
    return run_worker("stage", {"calls": calls}, tmp)


def test_rows_gyms_token_capture_staged_pass_the_cut_check_and_a_lost_one_is_named(
        world: World, tmp_path: Path) -> None:
    job = Job(world)

    async def dispatch() -> list[Ep]:
        await world.ckpt.ensure_holders()
        return await job.dispatch("g1", OWNER)

    eps = world.run(dispatch())
    # Gym's rollout id is the session's capture key; one model call per turn.
    calls = [(ep.capture_key, f"call-{n}") for n in range(2) for ep in eps]
    gym = gym_stage(calls, tmp_path)
    assert gym["protocols"] == [True, True]  # Gym's StagingSink and StagingSource
    assert gym["keys"] == [f"{rollout}/{call}" for rollout, call in calls]
    assert gym["fetched"] == [[rollout, call, 3] for rollout, call in calls]
    staged = dict(zip(calls, gym["keys"], strict=True))

    async def turns() -> dict[str, Any]:
        client = await world.client(OWNERS[OWNER])
        for n in range(2):
            for ep in eps:
                key = staged[(ep.capture_key, f"call-{n}")]
                async with client.turn(ep) as turn:
                    async with job.barrier.mutation() as cut:  # the sink's durable write
                        job.staging.put(cut, key, gym["rows"][key].encode())
                    turn.complete(pickle.dumps(n), f"s{n + 1}".encode(), [key])
        return await job.snapshot(world.path("step-1"))

    metrics = world.run(turns())
    assert (environment_dir(world.path("step-1")) / "manifest.json").exists()
    assert metrics["captured_rollouts"] == 2 and metrics["orphan_staging_rows"] == 0
    row = json.loads(job.staging.rows[gym["keys"][0]].decode())
    assert (row["rollout_id"], row["model_call_id"]) == calls[0]

    # The data plane loses one row Gym staged: the cut no longer holds what a captured
    # turn references, and the snapshot names it.
    lost = gym["keys"][-1]
    del job.staging.rows[lost]
    with pytest.raises(SnapshotMismatchError, match="missing_staging_key") as refused:
        world.run(job.snapshot(world.path("step-2")))
    assert f"references staging row {lost!r}, which the cut does not hold" \
        in str(refused.value)
    assert not (environment_dir(world.path("step-2")) / "manifest.json").exists()
