"""NeMo RL's names for a snapshot's and a restore's figures (``nemo_ckpt.nemo_rl_telemetry``),
beside ours, as a NeMo RL dashboard finds them: the names of NeMo RL's controller
(``timing/rollout_checkpoint/...``, ``timing/rollout_recovery/...``) with the values of
the figures that mean the same. In-process (``actors.sim``): the real driver,
coordinator and holders, on virtual time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.nemo_rl_telemetry import nemo_rl_restore_figures, nemo_rl_snapshot_figures
from tests.harness import World, cut_of

pytestmark = pytest.mark.timeout(60)

SAVE = "timing/rollout_checkpoint/"
LOAD = "timing/rollout_recovery/"


def test_a_snapshot_gives_nemo_rls_barrier_wait_exclusive_hold_and_total_save_beside_ours(
        world: World) -> None:
    path = world.path("step-1")

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        live = await world.populate()
        instance = sorted(live)[0]
        client = await world.client(instance)
        slow = Ep("slow", 0)
        await client.open(slow, b"s0")
        live[instance].append(slow)

        async def long_turn() -> None:  # in flight when the snapshot asks for its pause
            async with client.turn(slow) as turn:
                await asyncio.sleep(1.0)
                turn.complete(b"t0", b"s1", [])

        turning = asyncio.ensure_future(long_turn())
        await asyncio.sleep(0.4)
        async with world.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(cut_of(live))
            inside = nemo_rl_snapshot_figures(snap.metrics(0.0))
            await asyncio.sleep(2.0)  # RL saves its half: the holders stay paused
        await turning
        ours = snap.metrics(0.0)
        return inside, ours, nemo_rl_snapshot_figures(ours)

    inside, ours, seen = world.run(scenario())
    # Ours are all there, unchanged; NeMo RL's beside them.
    assert {k: v for k, v in seen.items() if "/" not in k} == ours
    assert sorted(k for k in seen if "/" in k) == [
        SAVE + "barrier_wait_seconds", SAVE + "exclusive_hold_seconds",
        SAVE + "total_save_seconds"]
    # The wait for the turn in flight (the 0.6 s of its 1 s left), then the hold.
    assert seen[SAVE + "barrier_wait_seconds"] == ours["drain_seconds"]
    assert 0.5 <= ours["drain_seconds"] < 0.8
    assert seen[SAVE + "exclusive_hold_seconds"] == pytest.approx(
        ours["holders_paused_seconds"] - ours["drain_seconds"])
    assert 2.0 <= seen[SAVE + "exclusive_hold_seconds"] < 2.5
    assert seen[SAVE + "total_save_seconds"] == ours["snapshot_seconds"]
    assert ours["snapshot_seconds"] >= ours["holders_paused_seconds"]
    # Inside the block neither the hold nor the whole save is known yet: left out.
    assert SAVE + "barrier_wait_seconds" in inside
    assert SAVE + "exclusive_hold_seconds" not in inside
    assert SAVE + "total_save_seconds" not in inside


def test_a_restore_gives_nemo_rls_recovery_prepare_seconds_beside_ours(world: World) -> None:
    path = world.path("step-1")

    async def scenario() -> tuple[dict[str, Any] | None, dict[str, Any]]:
        live = await world.populate()
        await world.snapshot(path, live)
        await world.ckpt.retire([ep for eps in live.values() for ep in eps])
        before = nemo_rl_restore_figures(world.ckpt.last_restore_metrics)
        async with world.ckpt.restored(path):
            await asyncio.sleep(1.5)  # RL prepares its ledger inside the restore
        return world.ckpt.last_restore_metrics, before

    ours, before = world.run(scenario())
    assert before == {}  # no restore went live yet
    assert ours is not None
    seen = nemo_rl_restore_figures(ours)
    assert seen == {**ours, LOAD + "recovery_prepare_seconds": ours["restore_seconds"]}
    assert 1.5 <= seen[LOAD + "recovery_prepare_seconds"] < 2.0
