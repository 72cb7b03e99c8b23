"""A bounded chaos run: the toy workload under a seeded schedule of faults.

Rollouts of the deterministic toy environment run on every holder, while a seeded
schedule kills holders, kills the coordinator mid-snapshot, removes and adds nodes,
interrupts snapshots, and strikes around a snapshot's commit: it cancels the driver's
task as the commit starts or while it runs, and kills the coordinator while the commit
waits before its shards or right after the manifest's rename. After each fault a
snapshot is taken in DESIGN.md's order; the live sessions at its cut are recorded.
Afterwards:

- every committed snapshot passes every check a restore makes, and its sessions equal
  the live sessions at its cut (sessions mid-turn at the drain deadline excepted: they
  are reported as restarting); a sample is restored for real into a fresh namespace;
- every snapshot struck around its commit is committed (the manifest names it, and its
  folder holds just what the manifest names) or left nothing behind;
- every rollout's final trajectory equals the crash-free reference, turn by turn.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import ray

from nemo_ckpt import (
    CheckpointConfig,
    EnvironmentEpisode,
    RayEnvironmentCheckpoint,
    SessionClient,
    SessionRecord,
)
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.checkpoint_folder import environment_dir
from nemo_ckpt.storage.snapshot_files import read_manifest, read_snapshot, snapshot_rollouts
from nemo_ckpt.testing.data_plane import DataPlaneBarrier, ReferenceDataPlane
from nemo_ckpt.testing.toy_env import (
    ToyState,
    initial_state,
    ordered_staging_keys,
    reference_trajectory,
    staging_key,
    step,
)
from tests.conftest import remove_node_and_wait

SEED = 20261129
# Rollouts running at once (two a holder); new ones start until the faults are done. Every
# fault strikes rollouts in flight; more at once ran more rollouts for the same faults, at
# a CPU cost the rest of `make test` shares on 2 cores.
IN_FLIGHT = 6
TURNS = 8
FAULTS = 50
NODE_FAULTS = 4  # node removals and additions are slow (seconds each): a few of them

pytestmark = pytest.mark.timeout(420)


# Faults around the commit: where a cancellation or a coordinator kill strikes.
CANCEL_POINTS = ("as_it_starts", "commit_snapshot", "after_manifest")
KILL_POINTS = ("commit_snapshot", "after_manifest")
CANCEL_DELAY_S = 1.0  # the commit's injected delay a cancellation strikes inside


class Interrupted(Exception):
    """The caller's own failure inside a snapshot block."""


@dataclass(eq=False)
class Taken:
    """One snapshot as its block saw it, kept to verify it once it committed."""

    path: Path
    snapshot_id: str | None = None
    live: dict[str, list[SessionRecord]] = field(default_factory=dict)
    restarting: set[str] = field(default_factory=set)
    block_done: asyncio.Event = field(default_factory=asyncio.Event)  # the commit starts


class Chaos:
    """The workload, the fault schedule and what they observed."""

    def __init__(self, ckpt: RayEnvironmentCheckpoint, cluster: Any, root: Path) -> None:
        self.ckpt = ckpt
        self.cluster = cluster
        self.root = root
        self.rng = random.Random(SEED)  # the fault schedule
        self.placement = random.Random(SEED + 1)  # where rollouts run
        self.dp = ReferenceDataPlane()
        self.barrier = DataPlaneBarrier(self.dp)
        self.lock = asyncio.Lock()  # snapshots vs. finish + retire (DESIGN.md)
        self.instances: list[str] = []
        self.restarted: set[str] = set()
        self.committed: list[Taken] = []
        # Snapshots struck around their commit, and whether each committed.
        self.around_commit: list[tuple[Taken, bool]] = []
        self.points: dict[str, int] = {}  # "kind@point" -> count
        self.injected: dict[str, int] = {}
        self.survived: dict[str, int] = {}
        self.added_nodes: list[Any] = []
        self.node_faults = 0

    # --- the workload -------------------------------------------------------------------

    async def rollout(self, rollout_id: str) -> None:
        """Run one rollout to its end; when its holder dies, start it over elsewhere."""
        while True:
            instance = self.placement.choice(self.instances)
            episode = await self.dp.dispatch(rollout_id, instance)
            try:
                final = await self._run(episode, instance)
            except Exception:  # its holder or node died under it: start over
                self.restarted.add(rollout_id)
                async with self.lock:  # as RL does: forget the attempt, then abandon it
                    await self.ckpt.forget([episode])
                    await self.dp.abandon(episode)
                await asyncio.sleep(0.05)
                continue
            async with self.lock:
                await self.dp.finish(episode, [json.loads(r) for r in final.turns],
                                     list(ordered_staging_keys(final)))
                await self.ckpt.retire([episode])
            return

    async def _run(self, episode: EnvironmentEpisode, instance: str) -> SessionRecord:
        client = await SessionClient.connect(instance, namespace=self.ckpt.config.namespace)
        await client.open(episode, initial_state(SEED, episode.rollout_id, TURNS).to_bytes())
        for _ in range(TURNS):
            async with client.turn(episode) as turn:
                state = ToyState.from_bytes(turn.state)
                await asyncio.sleep(0.02)  # the model's and the tool's time
                new_state, record, row = step(state)
                key = staging_key(episode, state.turn)
                await self.dp.write_staging(key, row)  # inside the turn, before commit
                turn.complete(json.dumps(record, sort_keys=True).encode(),
                              new_state.to_bytes(), [key])
        return await client.get(episode)

    async def workload(self, stop: asyncio.Event) -> list[str]:
        """Keep ``IN_FLIGHT`` rollouts running until ``stop``; returns every rollout id."""
        slots = asyncio.Semaphore(IN_FLIGHT)
        started: list[str] = []
        tasks: list[asyncio.Task[None]] = []

        async def one(rollout_id: str) -> None:
            try:
                await self.rollout(rollout_id)
            finally:
                slots.release()

        while not stop.is_set():
            await slots.acquire()
            if stop.is_set():
                break
            started.append(f"r{len(started):04d}")
            tasks.append(asyncio.ensure_future(one(started[-1])))
        await asyncio.gather(*tasks)
        return started

    # --- snapshots ----------------------------------------------------------------------

    def _path(self) -> Path:
        return self.root / f"snap-{len(list(self.root.iterdir())):04d}-{uuid.uuid4().hex[:4]}"

    async def snapshot(self, fault: str | None = None, taken: Taken | None = None) -> None:
        """One snapshot in DESIGN.md's order; ``fault`` strikes inside its block. What the
        block saw goes into ``taken``, which is recorded as committed on a clean exit."""
        taken = taken or Taken(self._path())
        path = taken.path
        async with self.lock:
            async with self.ckpt.snapshot(path) as snap:
                taken.snapshot_id = self.ckpt.open_operation
                async with self.barrier.checkpoint() as cut:
                    if snap is not None:
                        await snap.check_against_cut(cut)
                        taken.restarting = {ep.capture_key for eps in snap.restarting().values()
                                            for ep in eps}
                    # The live sessions at the cut, on the holders this snapshot paused.
                    taking_part = list(snap.captured()) if snap is not None else []
                    taken.live = {i: await self._holder(i).sessions.remote()
                                  for i in taking_part}
                    if fault == "interrupt":
                        raise Interrupted("the caller's save failed")
                    if fault == "kill_coordinator":
                        ray.kill(ray.get_actor(self.ckpt.config.coordinator_name,
                                               namespace=self.ckpt.config.namespace))
                    if fault == "kill_holder_in_snapshot":
                        ray.kill(self._holder(self.rng.choice(self.instances)))
                    await self.barrier.save(cut, path)
                taken.block_done.set()  # the block is over: the exit starts the commit
        self.committed.append(taken)

    async def healthy_snapshot(self) -> None:
        """A committed snapshot after a fault; retried while the backend is unavailable."""
        for _ in range(20):
            await self.refresh()
            try:
                await self.snapshot()
                return
            except Exception as exc:
                if not self.ckpt.is_unavailable(exc):
                    raise
                await asyncio.sleep(0.3)
        raise AssertionError("no snapshot committed after 20 tries")

    async def refresh(self) -> None:
        holders = await self.ckpt.ensure_holders()
        self.instances = [h.instance_id for h in holders]

    def _holder(self, instance: str) -> Any:
        return ray.get_actor(HOLDER_NAME_PREFIX + instance,
                             namespace=self.ckpt.config.namespace)

    def _coordinator(self) -> Any:
        return ray.get_actor(self.ckpt.config.coordinator_name,
                             namespace=self.ckpt.config.namespace)

    # --- faults around the commit -------------------------------------------------------

    async def cancel_around_commit(self) -> None:
        """Cancel the driver's task as the commit starts, while the commit waits before
        its shards, or right after the manifest's rename. A commit under way runs to its
        end and the cancellation is raised after it; one that had not started when the
        cancellation came leaves nothing."""
        point = self._next_point("cancel", CANCEL_POINTS)
        coordinator = self._coordinator()
        if point != "as_it_starts":
            await coordinator.inject_delay.remote(point, CANCEL_DELAY_S)
        taken = Taken(self._path())
        try:
            task = asyncio.ensure_future(self.snapshot(taken=taken))
            await self._until_commit_starts(taken, task)
            if point == "commit_snapshot":
                await asyncio.sleep(self.rng.uniform(0.05, CANCEL_DELAY_S - 0.1))
            elif point == "after_manifest":
                await self._until_manifest(taken, task)
            assert not task.done(), f"the cancellation at {point} came after the commit"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 60)
        finally:
            if point != "as_it_starts":
                await coordinator.inject_delay.remote(point, 0.0)
        self.settle(taken, returned=False)
        if point != "as_it_starts":  # the coordinator was inside the commit: it won
            assert self.around_commit[-1][1], f"{taken.path.name} did not commit"

    async def kill_coordinator_around_commit(self) -> None:
        """Kill the coordinator while the commit waits before its shards (the snapshot
        fails, retriable, and leaves nothing), or right after the manifest's rename (the
        fresh coordinator answers the driver's abort with "committed": no error)."""
        point = self._next_point("kill", KILL_POINTS)
        doomed = self._coordinator()
        await doomed.inject_delay.remote(point, 30.0)
        taken = Taken(self._path())
        task = asyncio.ensure_future(self.snapshot(taken=taken))
        await self._until_commit_starts(taken, task)
        if point == "after_manifest":
            await self._until_manifest(taken, task)
        else:
            await asyncio.sleep(self.rng.uniform(0.05, 0.3))  # the commit waits in its delay
        ray.kill(doomed, no_restart=True)
        if point == "after_manifest":
            await asyncio.wait_for(task, 60)
            self.settle(taken, returned=True)
            assert self.around_commit[-1][1], f"{taken.path.name} did not commit"
        else:
            with pytest.raises(Exception) as err:
                await asyncio.wait_for(task, 60)
            assert self.ckpt.is_unavailable(err.value), err.value
            self.settle(taken, returned=False)
            assert not self.around_commit[-1][1], f"{taken.path.name} committed"

    def _next_point(self, what: str, points: tuple[str, ...]) -> str:
        """The points in turn, so that each is struck whatever the seed picks how often."""
        done = sum(n for key, n in self.points.items() if key.startswith(f"{what}@"))
        point = points[done % len(points)]
        self.points[f"{what}@{point}"] = self.points.get(f"{what}@{point}", 0) + 1
        return point

    async def _until_commit_starts(self, taken: Taken, task: asyncio.Future[None]) -> None:
        done = asyncio.ensure_future(taken.block_done.wait())
        await asyncio.wait({task, done}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            done.cancel()
            raise AssertionError(f"the snapshot ended before its commit started: {task}")

    async def _until_manifest(self, taken: Taken, task: asyncio.Future[None]) -> None:
        manifest = environment_dir(taken.path) / "manifest.json"
        for _ in range(600):
            if manifest.exists() or task.done():
                break
            await asyncio.sleep(0.01)
        assert manifest.exists(), f"no manifest at {taken.path.name}: {task}"

    def settle(self, taken: Taken, returned: bool) -> None:
        """Record the outcome of a snapshot struck around its commit: committed when the
        manifest at its path names it (``snapshot()`` returned, or raised after its
        commit completed), else it must leave nothing behind (checked at the end)."""
        manifest = environment_dir(taken.path) / "manifest.json"
        committed = manifest.exists()
        if committed:
            assert read_manifest(taken.path).snapshot_id == taken.snapshot_id
            if not returned:  # raised after its commit: committed all the same
                self.committed.append(taken)
        else:
            assert not returned, f"{taken.path.name} returned without a manifest"
        self.around_commit.append((taken, committed))

    # --- faults -------------------------------------------------------------------------

    async def inject(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1
        if kind == "kill_holder":
            ray.kill(self._holder(self.rng.choice(self.instances)))
        elif kind in ("interrupt", "kill_coordinator", "kill_holder_in_snapshot"):
            expected = Interrupted if kind == "interrupt" else Exception
            with pytest.raises(expected) as err:
                await self.snapshot(kind)
            if kind != "interrupt":
                assert self.ckpt.is_unavailable(err.value), err.value
        elif kind == "cancel_commit":
            await self.cancel_around_commit()
        elif kind == "kill_coordinator_in_commit":
            await self.kill_coordinator_around_commit()
        elif kind == "remove_node":
            node = self.added_nodes.pop(self.rng.randrange(len(self.added_nodes)))
            self.cluster.remove_node(node, allow_graceful=False)
        elif kind == "add_node":
            self.added_nodes.append(self.cluster.add_node(num_cpus=1))
            self.cluster.wait_for_nodes()
        # Survived: no holder is left paused or restoring, and a snapshot commits.
        await self.wait_all_running()
        await self.healthy_snapshot()
        self.survived[kind] = self.survived.get(kind, 0) + 1

    def next_fault(self) -> str:
        if self.node_faults < NODE_FAULTS and self.rng.random() < 0.1:
            self.node_faults += 1
            return "remove_node" if self.added_nodes and self.rng.random() < 0.5 else "add_node"
        return self.rng.choice(["kill_holder", "kill_holder", "interrupt", "interrupt",
                                "kill_coordinator", "kill_holder_in_snapshot",
                                "cancel_commit", "kill_coordinator_in_commit"])

    async def wait_all_running(self) -> None:
        for _ in range(200):
            holders = await self.ckpt.holders()
            if all(h.state is HolderState.RUNNING for h in holders):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"holders left paused: {holders}")


async def test_chaos_survives_every_fault_and_loses_nothing_committed(
    cluster: Any, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = CheckpointConfig(allow_unchecked_snapshots=True,
                              namespace=namespace, drain_timeout_s=0.5, lease_s=3.0,
                              phase_timeout_s=10.0, persist_timeout_s=20.0)
    ckpt = RayEnvironmentCheckpoint(config)
    root = tmp_path / "snapshots"
    root.mkdir()
    chaos = Chaos(ckpt, cluster, root)
    try:
        await chaos.refresh()
        stop = asyncio.Event()
        workload = asyncio.ensure_future(chaos.workload(stop))
        for _ in range(FAULTS):
            await chaos.inject(chaos.next_fault())
            assert not workload.done(), workload
        faults = sum(chaos.injected.values())
        stop.set()
        rollout_ids = await asyncio.wait_for(workload, 180)

        # Every rollout ends with the crash-free trajectory, turn by turn.
        trajectories = await chaos.dp.trajectories()
        assert sorted(trajectories) == rollout_ids
        wrong = [r for r in rollout_ids
                 if trajectories[r].steps != reference_trajectory(SEED, r, TURNS)]
        assert wrong == []

        # Every committed snapshot verifies, and holds the live sessions at its cut.
        for taken in chaos.committed:
            loaded = read_snapshot(taken.path)
            assert loaded.manifest.snapshot_id == taken.snapshot_id, taken.path.name
            for instance, records in taken.live.items():
                expected = [r for r in records
                            if r.episode.capture_key not in taken.restarting]
                got = sorted(loaded.sessions.get(instance, []),
                             key=lambda r: r.episode.capture_key)
                assert got == expected, f"{taken.path.name}/{instance}"
        # Struck around its commit: committed, and just that, or nothing left behind.
        for taken, committed in chaos.around_commit:
            files = sorted(p.name for p in environment_dir(taken.path).iterdir())
            if committed:
                named = read_manifest(taken.path).shards
                assert files == sorted(["manifest.json", *(s.file for s in named)]), \
                    taken.path.name
            else:
                assert files == [], f"{taken.path.name} left {files}"
        # A sample restores for real, into a fresh job.
        for path in [t.path for t in chaos.committed[::12] + chaos.committed[-1:]]:
            fresh = RayEnvironmentCheckpoint(CheckpointConfig(namespace=f"{namespace}-r"))
            try:
                async with fresh.restored(path) as restored:
                    manifest = read_manifest(path)
                    assert restored.continued_attempts == {
                        (r.instance_id, r.rollout_id, r.attempt)
                        for r in snapshot_rollouts(path, manifest)[0]}
            finally:
                fresh.shutdown()
        assert faults >= FAULTS - NODE_FAULTS and chaos.survived == chaos.injected
        struck = len(chaos.around_commit)
        kept = sum(committed for _, committed in chaos.around_commit)
        with capsys.disabled():
            print(f"\nchaos: {faults} faults injected, {sum(chaos.survived.values())} "
                  f"survived ({dict(sorted(chaos.injected.items()))}); around the commit "
                  f"({dict(sorted(chaos.points.items()))}): {kept} committed and {struck - kept} "
                  f"left nothing; "
                  f"{len(chaos.committed)} snapshots committed and verified; "
                  f"{len(chaos.restarted)} of {len(rollout_ids)} rollouts restarted at least "
                  f"once; all {len(rollout_ids)} trajectories equal the crash-free run")
    finally:
        ckpt.shutdown()
        for node in chaos.added_nodes:
            remove_node_and_wait(cluster, node)
