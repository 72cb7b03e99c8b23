#!/usr/bin/env python3
"""SkyRL-gym's own environments recovered mid-rollout with no change to their code.

Runs many rollouts of SkyRL-gym's ``gsm8k_multi_turn``, ``text2sql`` (over a small
SQLite database made for the run) and ``rlm`` (a live Python REPL) on an embedded local
Ray cluster, each through
``nemo_ckpt.adapters.AdaptedRollout`` on an environment worker pinned to its holder's
node, with a scripted, seeded policy in the model's place. Halfway it snapshots both
halves (sessions and the reference data plane), runs a step more (work the crash
loses), crashes (workers, data plane and holders killed), restores as a new job:
continued rollouts are rebuilt by replaying their recorded actions (no model call),
checked step by step; the others start over. Then every rollout's observations and
rewards are compared with a crash-free run. Prints VERIFIED only when every rollout
was checked and equal; exit 1 otherwise.

    .venv/bin/python examples/adapter_recovery.py
    .venv/bin/python examples/adapter_recovery.py --rollouts 64 --nodes 3
    .venv/bin/python examples/adapter_recovery.py --address HOST:PORT  # a running cluster
                                                  # on one machine (the database is local)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nemo_ckpt import CheckpointConfig, EnvironmentEpisode, RayEnvironmentCheckpoint
from nemo_ckpt.adapters import AdaptedRollout
from nemo_ckpt.connect import connect, ray_address
from nemo_ckpt.errors import NemoCkptError
from nemo_ckpt.options import at_least, non_negative_float
from nemo_ckpt.sessions import SessionClient
from nemo_ckpt.testing import DataPlaneBarrier, start_data_plane, trajectory_result
from nemo_ckpt.testing.text_envs import (
    TextTask,
    gsm8k_task,
    make_sql_database,
    reference_outputs,
    rlm_task,
    sql_task,
)

MAX_TURNS = 6  # steps per rollout at most (a rollout ends earlier when it is done)


def task_of(rollout_id: str, seed: int, db_root: Path) -> TextTask:
    """The task of a rollout id: ``gsm-<n>``, ``sql-<n>`` or ``rlm-<n>``."""
    if rollout_id.startswith("gsm-"):
        return gsm8k_task(rollout_id, seed, max_turns=MAX_TURNS)
    if rollout_id.startswith("rlm-"):
        return rlm_task(rollout_id, seed, max_turns=MAX_TURNS)
    return sql_task(rollout_id, seed, db_root, max_turns=MAX_TURNS)


class AdapterWorker:
    """Runs adapted rollouts for one session-holder instance."""

    def __init__(self, instance_id: str, namespace: str, data_plane: Any, db_root: str,
                 seed: int, turn_seconds: float) -> None:
        self.instance_id, self.namespace = instance_id, namespace
        self.data_plane, self.db_root, self.seed = data_plane, Path(db_root), seed
        self.turn_seconds = turn_seconds
        self.client: SessionClient | None = None
        self.rollouts: dict[str, AdaptedRollout] = {}  # by capture key, while they run

    async def run(self, episode: EnvironmentEpisode, until_steps: int, fresh: bool
                  ) -> dict[str, Any]:
        """Run ``episode`` until ``until_steps`` steps or done; a done rollout is handed
        in (its result kept by the backend until RL acknowledges it). Returns how it was
        rebuilt and, once done, its records and staging keys for RL's ledger."""
        if self.client is None:
            self.client = await SessionClient.connect(self.instance_id, self.namespace)
        client, task = self.client, task_of(episode.rollout_id, self.seed, self.db_root)

        async def staging(turn: int) -> list[str]:  # the model call's token capture
            key = f"{episode.capture_key}/t{turn}"
            await self.data_plane.write_staging.remote(key, {"turn": turn})
            return [key]

        rollout = self.rollouts.get(episode.capture_key)
        if fresh:
            rollout = await AdaptedRollout.start(client, episode, task.framework, task.prompt,
                                                 staging=staging)
        elif rollout is None:  # a continued rollout after a restore: rebuilt here
            rollout = await AdaptedRollout.resume(client, episode, task.framework)
        self.rollouts[episode.capture_key] = rollout
        rebuilt, replayed = rollout.rebuilt_by, len(rollout.replayed)
        while not rollout.done and len(rollout.records) - 1 < until_steps:
            await asyncio.sleep(self.turn_seconds)  # the model's time
            await rollout.step(task.policy(len(rollout.records)), staging)
        answer: dict[str, Any] = {"rebuilt": rebuilt, "replayed": replayed, "done": False}
        if rollout.done:
            session = await client.get(episode)
            keys = sorted(session.staging_keys, key=lambda k: int(k.rsplit("/t", 1)[1]))
            records = [{"kind": r.kind, "given": r.given, "output": r.output}
                       for r in rollout.records]
            await rollout.finish(trajectory_result(records, keys))
            answer.update(done=True, records=records, keys=keys)
            del self.rollouts[episode.capture_key]
        return answer


AdapterWorkerActor: Any = ray.remote(num_cpus=0)(AdapterWorker)


class Job:
    """One life of the driver: its checkpoint, data plane and workers."""

    def __init__(self, ckpt: RayEnvironmentCheckpoint, args: argparse.Namespace) -> None:
        self.ckpt, self.args = ckpt, args
        self.data_plane = start_data_plane()
        self.barrier = DataPlaneBarrier(self.data_plane)
        self.workers: dict[str, Any] = {}

    async def start_workers(self) -> None:
        for holder in await self.ckpt.holders():
            self.workers[holder.instance_id] = AdapterWorkerActor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(holder.node_id, soft=False),
            ).remote(holder.instance_id, self.ckpt.config.namespace, self.data_plane,
                     str(self.args.db_root), self.args.seed, self.args.turn_seconds)

    async def run(self, instance: str, episode: EnvironmentEpisode, until: int,
                  fresh: bool) -> dict[str, Any]:
        answer: dict[str, Any] = await self.workers[instance].run.remote(episode, until, fresh)
        if answer["done"]:  # RL records it, then the backend lets go
            await self.data_plane.finish.remote(episode, answer["records"], answer["keys"])
            await self.ckpt.acknowledge([episode])
        return answer

    async def snapshot(self, path: Path) -> dict[str, float]:
        async with self.ckpt.snapshot(path) as snap:
            async with self.barrier.checkpoint() as cut:
                if snap is not None:
                    await snap.check_against_cut(cut)
                await self.barrier.save(cut, path)
        return snap.metrics(0.0) if snap is not None else {}

    def crash(self) -> None:
        for worker in self.workers.values():
            ray.kill(worker)
        ray.kill(self.data_plane)
        self.ckpt.shutdown()


async def main_async(args: argparse.Namespace) -> int:
    config = CheckpointConfig(namespace="nemo-ckpt-adapter-example",
                              checkpoint_root=args.checkpoint_dir)
    path = args.checkpoint_dir / "step-1"
    rollouts = [f"{('gsm', 'sql', 'rlm')[i % 3]}-{i}" for i in range(args.rollouts)]
    make_sql_database(args.db_root)

    ckpt = RayEnvironmentCheckpoint(config)
    await ckpt.shutdown(wait=True)  # what an earlier run left
    await ckpt.check_startup()
    job = Job(ckpt, args)
    await job.start_workers()
    instances = sorted(job.workers)
    placed = {r: instances[k % len(instances)] for k, r in enumerate(rollouts)}
    episodes = {r: await job.data_plane.dispatch.remote(r, placed[r]) for r in rollouts}
    half = MAX_TURNS // 2
    waiting = rollouts[-2:]  # dispatched, not opened before the snapshot: they start over
    await asyncio.gather(*(job.run(placed[r], episodes[r], half, fresh=True)
                           for r in rollouts if r not in waiting))
    metrics = await job.snapshot(path)
    say(f"snapshot {path}: {metrics.get('captured_rollouts', 0):.0f} rollouts captured "
        f"({metrics.get('finished_rollouts', 0):.0f} finished), "
        f"{metrics.get('replay_restarted_rollouts', 0):.0f} restarted by a diverging replay")
    done = set(await job.data_plane.trajectories.remote())
    await asyncio.gather(*(job.run(placed[r], episodes[r], half + 1, r in waiting)
                           for r in rollouts if r not in done))
    job.crash()
    say("CRASH: workers, data plane and session holders killed")

    ckpt = RayEnvironmentCheckpoint(config)
    await ckpt.shutdown(wait=True)
    await ckpt.check_startup()
    job = Job(ckpt, args)
    async with ckpt.restored(path) as restored:
        results = ckpt.restored_results
        report = await job.barrier.restore(path, restored, results)
    await ckpt.acknowledge([r.episode for r in results])
    await job.start_workers()
    say(f"restored: {len(report.continued)} rollouts continue mid-rollout, "
        f"{len(report.restarted)} start over, {len(report.recorded)} finished result(s) "
        f"handed back")

    async def start_over(rollout_id: str) -> dict[str, Any]:
        episode = await job.data_plane.dispatch.remote(rollout_id, placed[rollout_id])
        return await job.run(placed[rollout_id], episode, MAX_TURNS, fresh=True)

    answers = await asyncio.gather(
        *(job.run(i, ep, MAX_TURNS, fresh=False) for i, ep in report.continued),
        *(start_over(r) for r in report.restarted))
    rebuilt = answers[:len(report.continued)]
    by_replay = sum(a["rebuilt"] == "replay" for a in rebuilt)
    restarted = sum(a["rebuilt"] == "restarted" for a in rebuilt)
    replayed = sum(a["replayed"] for a in rebuilt)

    trajectories = await job.data_plane.trajectories.remote()
    wrong, checked = [], 0
    for r in rollouts:
        task = task_of(r, args.seed, args.db_root)
        expected = [o.as_plain() for o in reference_outputs(task)]
        got = trajectories.get(r)
        if got is None or [rec["output"] for rec in got.records] != expected or [
                rec["given"] for rec in got.records[1:]] != [
                task.policy(t) for t in range(1, len(expected))]:
            wrong.append(r)
        else:
            checked += 1
    if wrong or checked != len(rollouts):
        say(f"NOT VERIFIED: rollouts {wrong} differ from a crash-free run")
        return 1
    say(f"VERIFIED: {checked} rollouts of gsm8k_multi_turn, text2sql and rlm: every observation "
        f"and reward equals a crash-free run; {by_replay} continued rollouts rebuilt by "
        f"replaying {replayed} recorded turns without the model, {restarted} restarted by a "
        f"diverging replay")
    return 0


def say(text: str) -> None:
    print(text, flush=True)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", type=ray_address, default=None,
                   help="join this running cluster (HOST:PORT of its head); default: start "
                        "an embedded one")
    p.add_argument("--nodes", type=at_least(1), default=2,
                   help="nodes of the embedded cluster (default 2)")
    p.add_argument("--rollouts", type=at_least(2), default=24)
    p.add_argument("--seed", type=int, default=0, help="the scripted policy's seed")
    p.add_argument("--turn-seconds", type=non_negative_float, default=0.01,
                   help="the model's time per step (default 0.01)")
    args = p.parse_args(argv)
    args.scratch = Path(tempfile.mkdtemp(prefix="nemo-ckpt-adapter-"))
    args.checkpoint_dir = args.scratch / "checkpoints"
    args.db_root = args.scratch / "sql"
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    cluster: Any = None
    try:
        if args.address is not None:
            connect(args.address, log_to_driver=False, logging_level=logging.WARNING)
        else:
            from ray.cluster_utils import Cluster  # one machine, one raylet per "node"

            cluster = Cluster(initialize_head=True,
                              head_node_args={"num_cpus": 1, "include_dashboard": False})
            for _ in range(args.nodes - 1):
                cluster.add_node(num_cpus=1)
            ray.init(address=cluster.address, log_to_driver=False,
                     logging_level=logging.WARNING)
            cluster.wait_for_nodes()
        return asyncio.run(main_async(args))
    except NemoCkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if ray.is_initialized():
            RayEnvironmentCheckpoint(CheckpointConfig(
                namespace="nemo-ckpt-adapter-example")).shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(args.scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
