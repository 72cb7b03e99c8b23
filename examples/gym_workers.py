#!/usr/bin/env python3
"""Environment servers in processes of their own, NeMo Gym-style, crashed and continued.

In NeMo Gym the environment is a set of server processes: RL's controller sends each a
rollout to run, and the server runs the whole multi-turn episode itself, calling the
model (RL's generation server) once per turn, and sends the finished trajectory back.
The driver never opens a session or runs a turn. Here:

- one ``GymServer`` actor per node finds the session holder of its node with
  ``SessionClient.connect()`` and tells RL its instance id; RL's ledger (the reference
  data plane of ``nemo_ckpt.testing``) dispatches rollouts to those instances;
- a ``GymServer`` runs each rollout's turns in ``client.turn(...)``; each turn calls the
  ``ModelServer`` actor, which writes the turn's token-capture row to RL's data plane
  (inside the turn, before it commits) and returns the completion; at the end the server
  hands the result to the backend (``client.finish``) and returns it;
- the driver takes a snapshot while the servers run, at turn boundaries (the holders
  drain turns in flight), under a data-plane cut, with one rollout dispatched and still
  queued for its server, and prints its figures under NeMo RL's names
  (``nemo_ckpt.nemo_rl_telemetry``); then it kills the servers, the model server, the
  data plane and the holders mid-rollout: a crash;
- a fresh job restores both halves, starts NEW server processes, and sends each
  continued rollout back to the server of its instance, which continues it from its
  last saved turn; the queued one, not held at the snapshot, starts over;
- every trajectory is compared with a crash-free run's (the toy environment's are pure
  functions of seed, rollout and turn): VERIFIED, or exit 1.

    python examples/gym_workers.py                 # an embedded 2-node cluster
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
from nemo_ckpt.nemo_rl_telemetry import SNAPSHOT_NAMES, nemo_rl_snapshot_figures
from nemo_ckpt.options import at_least, non_negative_float
from nemo_ckpt.sessions import SessionClient
from nemo_ckpt.testing import (
    DataPlaneBarrier,
    RolloutOutcome,
    RolloutTask,
    ToyState,
    initial_state,
    ordered_staging_keys,
    reference_trajectory,
    staging_key,
    start_data_plane,
    step,
    trajectory_result,
)

Say = Callable[[str], None]
# What a NeMo RL dashboard shows of a snapshot (nemo_ckpt.nemo_rl_telemetry).
NEMO_RL = [alias.name for alias in SNAPSHOT_NAMES]


class ModelServer:
    """RL's generation server: one model call per turn. Its token-capture row goes to
    RL's data plane before the completion comes back, so the row exists before the turn
    that names it commits (the README's ledger rules)."""

    def __init__(self, data_plane: Any, turn_seconds: float) -> None:
        self.data_plane = data_plane
        self.turn_seconds = turn_seconds

    async def generate(self, state: bytes, key: str) -> tuple[bytes, bytes]:
        await asyncio.sleep(self.turn_seconds)  # the model's and the tool's time
        new_state, record, row = step(ToyState.from_bytes(state))
        await self.data_plane.write_staging.remote(key, row)
        return new_state.to_bytes(), json.dumps(record, sort_keys=True).encode()


class GymServer:
    """An environment server process: runs whole rollouts on the holder of its node."""

    def __init__(self, namespace: str, model: Any) -> None:
        self.namespace = namespace  # the job's CheckpointConfig.namespace
        self.model = model
        self.client: SessionClient | None = None

    async def start(self) -> tuple[str, int]:
        """Connect to the session holder on this node: ``(its instance id, our pid)``."""
        self.client = await SessionClient.connect(namespace=self.namespace)
        return self.client.instance_id, os.getpid()

    async def run(self, task: RolloutTask) -> RolloutOutcome:
        """Run ``task``'s rollout to its last turn; hand its result to the backend."""
        client, episode = self.client, task.episode
        if client is None or task.instance_id != client.instance_id:
            raise RuntimeError(f"{episode.capture_key} was dispatched to "
                               f"{task.instance_id}, not to this server's holder")
        if task.fresh:
            await client.open(episode, initial_state(task.seed, episode.rollout_id,
                                                     task.turns).to_bytes())
        restored = len((await client.get(episode)).turns)  # 0 unless continued
        for turn_index in range(restored, task.turns):
            async with client.turn(episode) as turn:  # waits while a snapshot pauses
                key = staging_key(episode, turn_index)
                new_state, record = await self.model.generate.remote(turn.state, key)
                turn.complete(record, new_state, [key])
        final = await client.get(episode)
        keys = ordered_staging_keys(final)  # every attempt's, in turn order
        outcome = RolloutOutcome(episode=episode, instance_id=client.instance_id,
                                 node_id=ray.get_runtime_context().get_node_id(),
                                 records=final.turns,
                                 staging_keys=keys, turns_at_start=restored,
                                 turns_run=task.turns - restored)
        # Kept, finished, until the driver acknowledges RL's record of it.
        await client.finish(episode, trajectory_result(outcome.decoded_records(), keys))
        return outcome


@dataclass
class Life:
    """One life of the job: its backend, RL's data plane, the model and Gym servers."""

    ckpt: RayEnvironmentCheckpoint
    data_plane: Any
    model: Any
    servers: dict[str, Any] = field(default_factory=dict)  # instance id -> GymServer
    pids: dict[str, int] = field(default_factory=dict)
    tasks: list[asyncio.Task[RolloutOutcome]] = field(default_factory=list)

    @classmethod
    async def start(cls, config: CheckpointConfig, turn_seconds: float) -> Life:
        ckpt = RayEnvironmentCheckpoint(config)
        await ckpt.shutdown(wait=True)  # what a crashed job left: a restore refuses live
        await ckpt.check_startup()
        data_plane = start_data_plane()
        model = ray.remote(num_cpus=0)(ModelServer).remote(data_plane, turn_seconds)
        life, server_class = cls(ckpt, data_plane, model), ray.remote(num_cpus=0)(GymServer)
        server: Any
        for holder in await ckpt.holders():  # one server per node, on that node
            server = server_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(holder.node_id, soft=False),
            ).remote(config.namespace, model)
            instance_id, pid = await server.start.remote()
            life.servers[instance_id], life.pids[instance_id] = server, pid
        return life

    def send(self, task: RolloutTask) -> None:
        """Send a rollout to its instance's server; record its end in RL's ledger."""
        async def run() -> RolloutOutcome:
            outcome: RolloutOutcome = await self.servers[task.instance_id].run.remote(task)
            await self.data_plane.finish.remote(task.episode, outcome.decoded_records(),
                                                list(outcome.staging_keys))
            await self.ckpt.acknowledge([task.episode])  # RL has it: the backend lets go
            return outcome

        self.tasks.append(asyncio.ensure_future(run()))

    async def snapshot(self, path: Path) -> dict[str, float | int]:
        """Both halves at one cut; its figures, with NeMo RL's names beside ours."""
        barrier = DataPlaneBarrier(self.data_plane)
        async with self.ckpt.snapshot(path) as snap:    # holders paused at turn ends
            async with barrier.checkpoint() as cut:      # RL's data plane frozen
                if snap is not None:
                    await snap.check_against_cut(cut)
                await barrier.save(cut, path)
        return {} if snap is None else nemo_rl_snapshot_figures(snap.metrics(0.0))

    async def rows_written(self) -> int:
        return int((await self.data_plane.stats.remote()).rows_written)

    async def crash(self) -> None:
        """Kill every process of the job: servers, model, data plane, holders."""
        for handle in (*self.servers.values(), self.model, self.data_plane):
            ray.kill(handle, no_restart=True)
        await self.ckpt.shutdown(wait=True)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def wait_for_rows(life: Life, rows: int) -> None:
    """Until the job has written ``rows`` token-capture rows (one a turn)."""
    while await life.rows_written() < rows:
        failed = [t for t in life.tasks if t.done() and t.exception() is not None]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        await asyncio.sleep(0.02)


@dataclass
class Report:
    """What the run found, and the lines it told."""

    verified: bool
    continued: dict[str, int]  # rollout -> turns restored from the snapshot
    restarted: list[str]  # rollouts not held at the snapshot: run again from turn 0
    pids: tuple[dict[str, int], dict[str, int]]  # instance -> server pid, per life
    lines: list[str]


async def run_gym_example(root: Path, namespace: str, rollouts: int = 6, turns: int = 8,
                          seed: int = 0, turn_seconds: float = 0.05,
                          say: Optional[Say] = None) -> Report:
    """The whole run on the Ray cluster ``ray.init`` joined."""
    lines: list[str] = []

    def tell(text: str) -> None:
        lines.append(text)
        if say is not None:
            say(text)

    config = CheckpointConfig(namespace=namespace, checkpoint_root=root.resolve())
    path, names = root.resolve() / "step-1", [f"r{i}" for i in range(rollouts)]
    life = await Life.start(config, turn_seconds)
    instances = sorted(life.servers)
    tell(f"gym servers {', '.join(f'{i} (pid {life.pids[i]})' for i in instances)}")
    sent = []
    for k, rollout_id in enumerate(names):  # the ledger first, then the environment
        instance_id = instances[k % len(instances)]
        episode = await life.data_plane.dispatch.remote(rollout_id, instance_id)
        sent.append(RolloutTask(episode, instance_id, namespace, seed, turns, fresh=True))
    for task in sent[:-1]:  # the last waits for a free slot on its server
        life.send(task)
    await wait_for_rows(life, (rollouts - 1) * turns // 3)
    figures = await life.snapshot(path)
    tell(f"snapshot {path.name}: {figures.get('captured_rollouts', 0)} rollouts captured "
         f"mid-rollout, {figures.get('not_held_rollouts', 0)} dispatched and not opened yet "
         f"({names[-1]}); " + ", ".join(f"{name}={figures.get(name, 0.0):.3f}" for name in NEMO_RL))
    life.send(sent[-1])
    await wait_for_rows(life, rollouts * turns * 2 // 3)
    await life.crash()
    tell("CRASH: gym servers, model server, data plane and session holders killed")

    first_pids = life.pids
    life = await Life.start(config, turn_seconds)  # a fresh job, NEW server processes
    async with life.ckpt.restored(path) as restored:
        done = await DataPlaneBarrier(life.data_plane).restore(
            path, restored, life.ckpt.restored_results)
    await life.ckpt.acknowledge([f.episode for f in life.ckpt.restored_results])
    for instance_id, episode in done.continued:
        life.send(RolloutTask(episode, instance_id, namespace, seed, turns, fresh=False))
    for rollout_id in done.restarted:
        instance_id = instances[names.index(rollout_id) % len(instances)]
        episode = await life.data_plane.dispatch.remote(rollout_id, instance_id)
        life.send(RolloutTask(episode, instance_id, namespace, seed, turns, fresh=True))
    outcomes = {o.episode.rollout_id: o for o in await asyncio.gather(*life.tasks)}
    continued = {ep.rollout_id: outcomes[ep.rollout_id].turns_at_start
                 for _, ep in done.continued}
    for instance_id, episode in done.continued:
        tell(f"{episode.rollout_id}: continued by a new gym server on {instance_id} (pid "
             f"{life.pids[instance_id]}) from its saved turn "
             f"{continued[episode.rollout_id]} of {turns}")
    trajectories = await life.data_plane.trajectories.remote()
    wrong = [r for r in names if r not in trajectories
             or trajectories[r].steps != reference_trajectory(seed, r, turns)]
    await life.ckpt.shutdown(wait=True)
    if wrong:
        tell(f"NOT VERIFIED: rollouts {wrong} differ from a crash-free run")
    else:
        tell(f"VERIFIED: {rollouts} rollouts x {turns} turns equal a crash-free run's; "
             f"{sum(continued.values())} turns were restored, not re-run; "
             f"{len(done.restarted)} rollout(s) started over")
    return Report(not wrong, continued, list(done.restarted), (first_pids, life.pids), lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=at_least(1), default=2)
    p.add_argument("--rollouts", type=at_least(2), default=6)
    p.add_argument("--turns", type=at_least(3), default=8, help="turns per rollout")
    p.add_argument("--turn-seconds", type=non_negative_float, default=0.05)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    from ray.cluster_utils import Cluster  # one machine, one raylet per "node"

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="gym-workers-"))
    try:
        cluster.wait_for_nodes()
        report = asyncio.run(run_gym_example(
            root, "nemo-ckpt-gym-workers", args.rollouts, args.turns,
            turn_seconds=args.turn_seconds, say=lambda text: print(text, flush=True)))
        return 0 if report.verified else 1
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
