"""The coordinator's fan-out through relays on a real local cluster: the relays are Ray
actors made by the coordinator's process, holders' handles and errors cross them as
they cross a direct call, and a relay killed mid-phase fails its group's calls as
unreachable while every holder resumes. (The same under virtual time, with the relay
killed at exact points: tests/coordinator/test_fan_relay.py.)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.coordinator.actor import CheckpointCoordinator
from actors.ray_transport import RayTransport
from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.phases import HolderState
from nemo_ckpt.protocol.operations import new_operation_id
from nemo_ckpt.storage.snapshot_files import read_snapshot

pytestmark = pytest.mark.timeout(120)


def _id(kind: str, seq: int) -> str:
    return new_operation_id(kind, time.time(), "relaytest", seq)


async def _snapshot(coord: CheckpointCoordinator, path: Path, seq: int) -> None:
    sid = _id("snap", seq)
    await coord.begin_snapshot(sid, str(path))
    await coord.start_writes(sid)
    await coord.commit_snapshot(sid, str(path), {}, 0)


async def test_holders_reached_through_relays_snapshot_restore_and_survive_a_relay_killed(
        cluster: Any, namespace: str, tmp_path: Path) -> None:
    config = CheckpointConfig(allow_unchecked_snapshots=True, namespace=namespace,
                              drain_timeout_s=1.0, lease_s=10.0, phase_timeout_s=10.0,
                              persist_timeout_s=30.0, relay_min_holders=2)
    ckpt = RayEnvironmentCheckpoint(config)
    try:
        infos = await ckpt.ensure_holders()
        assert len(infos) == 3  # one per node: groups of 2 and 1, two relays
        live = {}
        for info in infos:
            client = await SessionClient.connect(info.instance_id, namespace=namespace)
            live[info.instance_id] = Ep(f"{info.instance_id}-r0", 0)
            await client.open(live[info.instance_id], b"state")
        coord = CheckpointCoordinator(config, RayTransport(config))
        path = tmp_path / "ckpt"
        await _snapshot(coord, path, 1)
        assert len(coord.holders.relays) == 2
        loaded = read_snapshot(path)
        assert {i: [r.episode for r in rs] for i, rs in loaded.sessions.items()} == {
            i: [ep] for i, ep in live.items()}

        # A relay killed: its group's holders fail the pause as unreachable (aggregated,
        # by holder), and the abort, through a new relay, resumes every holder.
        victim = next(iter(coord.holders.relays.values()))
        ray.kill(victim.ref.ref, no_restart=True)
        with pytest.raises(BackendUnavailableError, match="relay") as failed:
            await _snapshot(coord, tmp_path / "next", 2)
        assert set(getattr(failed.value, "failures", {"one": failed.value})) <= set(live)
        states = {i.instance_id: i.state for i in await ckpt.holders()}
        assert states == dict.fromkeys(live, HolderState.RUNNING)

        # The retry goes through a new relay; a restore of it makes every session live.
        await _snapshot(coord, path, 3)
        for info in infos:
            client = await SessionClient.connect(info.instance_id, namespace=namespace)
            await client.close(live[info.instance_id])
        rid = _id("restore", 4)
        begun = await coord.prepare_restore(rid, str(path))
        assert await coord.commit_restore(rid) == len(live)
        assert set(begun.continued_attempts) == {
            (i, ep.rollout_id, ep.attempt) for i, ep in live.items()}
    finally:
        ckpt.shutdown()
