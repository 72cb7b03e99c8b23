#!/usr/bin/env python3
"""The smallest complete RL driver on nemo-ckpt: the README's integration guide, runnable.

It does what an RL single controller does, in order, with a data plane of its own (a
recovery ledger and token-capture staging rows, below) and no ``nemo_ckpt.testing``:

1. constructs ``RayEnvironmentCheckpoint`` and runs ``check_startup``;
2. starts one environment worker per session holder, with the holder's instance id;
3. dispatches rollouts (ledger first), opens their sessions and runs half their turns;
   finishes one rollout (the worker hands its result to the backend, RL's ledger records
   it, then ``acknowledge``), and one more whose result only the backend has yet; leaves
   one dispatched, not opened;
4. snapshots both halves at one cut (no lock: a finish may race it), then runs a turn
   more and records the second finish (work the crash will cost);
5. crashes: kills the workers, the data plane and the holders;
6. restarts like a new job: ``shutdown()`` of anything left, ``check_startup``, restores
   both halves, records the finished results the restore hands back, continues the
   continued rollouts on their instances, starts the others over as new attempts, runs
   everything to the end and acknowledges it;
7. checks every trajectory against a run that never crashed (exit 1 if one differs).

    python examples/minimal_driver.py                      # an embedded 2-node cluster
    python examples/minimal_driver.py --address HOST:PORT  # a running cluster (README)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from minimal_worker import EnvWorkerActor, expected_records, records_of
from nemo_ckpt import CheckpointConfig, EnvironmentEpisode, RayEnvironmentCheckpoint
from nemo_ckpt.connect import connect, ray_address
from nemo_ckpt.errors import NemoCkptError
from nemo_ckpt.options import (
    at_least,
    checkpoint_folder,
    non_empty,
    non_negative_float,
    writable_folder_problem,
)

# --- RL's half: a recovery ledger and staging rows, with a barrier ------------------------


class DataPlane:
    """RL's data plane, as small as it gets: the ledger says which attempt of which
    rollout runs on which instance; staging rows are the turns' token captures.

    ``freeze`` is the barrier: mutations wait until ``thaw``, so what ``freeze``
    returns and what ``save`` writes is one consistent cut.
    """

    def __init__(self) -> None:
        self.ledger: dict[str, dict[str, Any]] = {}  # rollout -> instance, attempt, status
        self.staging: dict[str, Any] = {}  # staging key -> row
        self.trajectories: dict[str, list[bytes]] = {}
        self.finished_rows: dict[str, dict[str, Any]] = {}  # rollout -> its rows, by key
        self.thawed = asyncio.Event()
        self.thawed.set()

    async def dispatch(self, rollout_id: str, instance_id: str) -> EnvironmentEpisode:
        """Record a dispatch (before the environment opens the session): a rollout seen
        before starts over as its next attempt."""
        await self.thawed.wait()
        entry = self.ledger.get(rollout_id)
        attempt = 0 if entry is None else entry["attempt"] + 1
        self.ledger[rollout_id] = {"instance": instance_id, "attempt": attempt,
                                   "status": "dispatched"}
        return EnvironmentEpisode(rollout_id, attempt)

    async def write_staging(self, key: str, row: Any) -> None:
        await self.thawed.wait()
        self.staging[key] = row

    async def finish(self, episode: EnvironmentEpisode, records: list[bytes]) -> None:
        """Record a finished rollout: its trajectory, and its staging rows (of every
        attempt) moved out of staging. A rollout already recorded changes nothing."""
        await self.thawed.wait()
        self._record_finish(episode, records)

    def _record_finish(self, episode: EnvironmentEpisode, records: list[bytes]) -> None:
        if self.ledger[episode.rollout_id]["status"] == "finished":
            return
        self.ledger[episode.rollout_id]["status"] = "finished"
        self.trajectories[episode.rollout_id] = records
        attempts = {EnvironmentEpisode(episode.rollout_id, a).capture_key
                    for a in range(episode.attempt + 1)}
        mine = [k for k in self.staging if k.split("/", 1)[0] in attempts]
        self.finished_rows[episode.rollout_id] = {k: self.staging.pop(k) for k in mine}

    async def freeze(self) -> tuple[dict[str, list[EnvironmentEpisode]], list[str]]:
        """Hold mutations back; return the ledger's unfinished attempts per instance and
        the staging keys present."""
        self.thawed.clear()
        expected: dict[str, list[EnvironmentEpisode]] = {}
        for rollout_id, e in self.ledger.items():
            if e["status"] == "dispatched":
                expected.setdefault(e["instance"], []).append(
                    EnvironmentEpisode(rollout_id, e["attempt"]))
        return expected, list(self.staging)

    async def thaw(self) -> None:
        self.thawed.set()

    async def save(self, path: str) -> None:
        """Write the ledger, the staging rows and the finished trajectories to
        ``<path>/data_plane.json`` (inside the barrier), by temporary file and rename."""
        assert not self.thawed.is_set(), "save only inside the barrier"
        target = Path(path) / "data_plane.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_suffix(".tmp")
        finished = {r: [record.decode() for record in records]  # the env's JSON bytes
                    for r, records in self.trajectories.items()}
        temporary.write_text(json.dumps({"ledger": self.ledger, "staging": self.staging,
                                         "finished": finished,
                                         "finished_rows": self.finished_rows}))
        os.replace(temporary, target)

    async def restore(self, path: str, continued_attempts: frozenset[tuple[str, str, int]],
                      staging_keys: frozenset[str],
                      results: list[tuple[EnvironmentEpisode, bytes]]
                      ) -> tuple[list[tuple[str, EnvironmentEpisode]], list[str]]:
        """Load the data plane saved at ``path``, matched to the environment's restore:
        continue exactly ``continued_attempts`` (as their next attempts, on their
        instances), keep ``staging_keys``, clear every other row, record the finished
        ``results`` the ledger does not have yet, and mark every other unfinished
        rollout to start over. Returns ``(continued, restart)``."""
        saved = json.loads((Path(path) / "data_plane.json").read_text())
        ledger = saved["ledger"]
        continued = []
        for instance_id, rollout_id, attempt in sorted(continued_attempts):
            entry = ledger[rollout_id]
            if (entry["instance"], entry["attempt"]) != (instance_id, attempt):
                raise RuntimeError(f"{rollout_id}: the environment restored attempt "
                                   f"{attempt} on {instance_id}, the ledger has {entry}")
            episode = EnvironmentEpisode(rollout_id, attempt).next_attempt()
            entry["attempt"] = episode.attempt  # the ledger bumps it as the backend did
            continued.append((instance_id, episode))
        continued_ids = {r for _, r, _ in continued_attempts}
        finished_ids = {episode.rollout_id for episode, _ in results}
        restart = sorted(r for r, e in ledger.items() if e["status"] == "dispatched"
                         and r not in continued_ids and r not in finished_ids)
        # Nothing changes above this line: raising there drops both halves' restore.
        self.ledger = ledger
        self.staging = {k: v for k, v in saved["staging"].items() if k in staging_keys}
        self.trajectories = {r: [record.encode() for record in records]
                             for r, records in saved["finished"].items()}
        self.finished_rows = saved["finished_rows"]
        for episode, result in results:  # handed back by the backend, not run again
            self._record_finish(episode, records_of(result))
        return continued, restart

    async def result(self) -> dict[str, list[bytes]]:
        return self.trajectories


# As a Ray actor (Any: Ray's stubs type ray.remote(...)(cls) as the class itself).
DataPlaneActor: Any = ray.remote(num_cpus=0)(DataPlane)


class FrozenCut:
    """The cut nemo-ckpt checks a snapshot against (``nemo_ckpt.DataPlaneMutationCut``)."""

    def __init__(self, expected: Mapping[str, list[EnvironmentEpisode]], keys: list[str]
                 ) -> None:
        self.live = True
        self._expected = {i: frozenset(eps) for i, eps in expected.items()}
        self._keys = frozenset(keys)

    def require_live(self) -> None:
        if not self.live:
            raise RuntimeError("this data-plane cut ended with its barrier block")

    def expected_episodes(self) -> Mapping[str, frozenset[EnvironmentEpisode]]:
        return self._expected

    def staging_keys(self) -> frozenset[str]:
        return self._keys


@contextlib.asynccontextmanager
async def barrier(data_plane: Any) -> AsyncIterator[FrozenCut]:
    """RL's data plane frozen for the block; the cut dies when it exits."""
    expected, keys = await data_plane.freeze.remote()
    cut = FrozenCut(expected, keys)
    try:
        yield cut
    finally:
        cut.live = False
        await data_plane.thaw.remote()


# --- the driver -----------------------------------------------------------------------------


class Driver:
    """One life of the RL single controller."""

    def __init__(self, ckpt: RayEnvironmentCheckpoint, turn_seconds: float) -> None:
        self.ckpt = ckpt
        self.turn_seconds = turn_seconds
        sandbox_root = ckpt.config.sandbox_root
        self.sandbox_root = None if sandbox_root is None else str(sandbox_root)
        self.data_plane = DataPlaneActor.remote()
        self.workers: dict[str, Any] = {}

    async def start_workers(self) -> None:
        """One environment worker per session holder, on its node, for its instance."""
        for holder in await self.ckpt.holders():
            self.workers[holder.instance_id] = EnvWorkerActor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(holder.node_id, soft=False),
            ).remote(holder.instance_id, self.ckpt.config.namespace, self.data_plane,
                     self.turn_seconds, self.sandbox_root)

    async def dispatch(self, rollout_id: str, instance_id: str) -> EnvironmentEpisode:
        episode: EnvironmentEpisode = await self.data_plane.dispatch.remote(
            rollout_id, instance_id)
        return episode

    async def run(self, instance_id: str, episode: EnvironmentEpisode, until_turn: int,
                  fresh: bool, last: bool = False) -> list[bytes]:
        records: list[bytes] = await self.workers[instance_id].run.remote(
            episode, until_turn, fresh, last)
        return records

    async def finish(self, episode: EnvironmentEpisode, records: list[bytes]) -> None:
        # The worker handed the result to the backend already: no lock against snapshots.
        await self.data_plane.finish.remote(episode, records)  # RL's ledger records it,
        await self.ckpt.acknowledge([episode])                 # then the backend lets go

    async def snapshot(self, path: Path) -> dict[str, float]:
        started = time.monotonic()
        async with self.ckpt.snapshot(path) as snap:           # holders paused, captured
            async with barrier(self.data_plane) as cut:        # RL's data plane frozen
                if snap is not None:
                    await snap.check_against_cut(cut)          # raises SnapshotMismatchError
                await self.data_plane.save.remote(str(path))   # RL's half, inside both
        # Committed: every shard durable, then environment/manifest.json.
        # Persist figures are known once the block has exited, not inside it.
        return snap.metrics(time.monotonic() - started) if snap is not None else {}

    def crash(self) -> None:
        """What a preemption does to the job: workers, data plane and holders die."""
        for worker in self.workers.values():
            ray.kill(worker)
        ray.kill(self.data_plane)
        self.ckpt.shutdown()


async def main_async(args: argparse.Namespace, address: str) -> int:
    root = args.checkpoint_dir.resolve()  # holders on other nodes resolve no relative path
    config = CheckpointConfig(namespace=args.namespace, checkpoint_root=root,
                              sandbox_root=args.sandbox_root)  # rollouts' directories
    path = root / "step-1"
    rollouts = [f"r{i}" for i in range(args.rollouts)]
    half = args.turns // 2

    # --- first life ----------------------------------------------------------------------
    ckpt = RayEnvironmentCheckpoint(config)
    await ckpt.check_startup()          # a holder on every node; the folder is shared
    driver = Driver(ckpt, args.turn_seconds)
    await driver.start_workers()
    instances = sorted(driver.workers)
    say(f"namespace {config.namespace}: session holders {', '.join(instances)}; see them "
        f"with: nemo-ckpt status --address {address} --namespace {config.namespace}")

    placed = {r: instances[i % len(instances)] for i, r in enumerate(rollouts)}
    episodes = {r: await driver.dispatch(r, placed[r]) for r in rollouts}  # ledger first
    opened, waiting = rollouts[:-1], rollouts[-1]  # the last one waits for a worker slot
    await asyncio.gather(*(driver.run(placed[r], episodes[r], half, fresh=True)
                           for r in opened))
    done, handed = opened[0], opened[1]
    await driver.finish(episodes[done], await driver.run(placed[done], episodes[done],
                                                         args.turns, fresh=False, last=True))
    # Its result is with the backend; RL records it only after the snapshot.
    late = await driver.run(placed[handed], episodes[handed], args.turns, fresh=False,
                            last=True)
    metrics = await driver.snapshot(path)
    say(f"snapshot {path}: {metrics['captured_rollouts']:.0f} rollouts captured, paused "
        f"{metrics['paused_seconds'] * 1000:.0f} ms, persist "
        f"{metrics['persist_seconds'] * 1000:.0f} ms, {metrics['bytes_written']:.0f} bytes; "
        f"{metrics['not_held_rollouts']:.0f} dispatched but not held ({waiting}), "
        f"{metrics['finished_rollouts']:.0f} finished ({handed}), "
        f"{metrics['orphan_staging_rows']:.0f} orphan staging rows")
    running = [r for r in opened if r not in (done, handed)]
    await asyncio.gather(*(driver.run(placed[r], episodes[r], half + 1, fresh=False)
                           for r in running),  # turns run after the snapshot: the crash
                         driver.finish(episodes[handed], late))  # loses them, and this
    driver.crash()
    say("CRASH: workers, data plane and session holders killed")

    # --- second life: a restarted driver ----------------------------------------------------
    ckpt = RayEnvironmentCheckpoint(config)  # the same namespace: instances keep their ids
    await ckpt.shutdown(wait=True)  # drop what the old job left: a restore refuses live
    await ckpt.check_startup()
    driver = Driver(ckpt, args.turn_seconds)
    async with ckpt.restored(path) as restored:    # verified and loaded, not live yet
        results = [(f.episode, f.result) for f in ckpt.restored_results]  # finished, kept
        continued, restart = await driver.data_plane.restore.remote(
            str(path), restored.continued_attempts, restored.staging_keys, results)
    # The restored sessions are live now; RL has recorded the results handed back.
    await ckpt.acknowledge([episode for episode, _ in results])
    await driver.start_workers()
    say(f"restored {path}: {len(continued)} rollouts continue mid-rollout, "
        f"{len(restart)} start over, {len(results)} finished result(s) handed back")

    async def to_the_end(instance_id: str, episode: EnvironmentEpisode, fresh: bool) -> None:
        await driver.finish(episode, await driver.run(instance_id, episode, args.turns, fresh,
                                                      last=True))

    async def start_over(rollout_id: str) -> None:
        episode = await driver.dispatch(rollout_id, placed[rollout_id])  # its next attempt
        await to_the_end(placed[rollout_id], episode, fresh=True)

    await asyncio.gather(*(to_the_end(i, ep, fresh=False) for i, ep in continued),
                         *(start_over(r) for r in restart))
    trajectories: dict[str, list[bytes]] = await driver.data_plane.result.remote()
    wrong = [r for r in rollouts if trajectories.get(r) != expected_records(r, args.turns)]
    if wrong:
        say(f"NOT VERIFIED: rollouts {wrong} differ from a run without a crash")
        return 1
    say(f"VERIFIED: {len(rollouts)} rollouts x {args.turns} turns equal a run without a "
        f"crash; {len(continued) * half} turns were restored, not re-run")
    return 0


def say(text: str) -> None:
    print(text, flush=True)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Every option is checked here, before Ray starts (a bad one exits 2)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", type=ray_address, default=None,
                   help="join this running cluster (HOST:PORT of its head, or 'auto'); "
                        "default: start an embedded one")
    p.add_argument("--nodes", type=at_least(1), default=2,
                   help="nodes of the embedded cluster (default 2)")
    p.add_argument("--namespace", type=non_empty, default="nemo-ckpt-minimal",
                   help="the job's Ray namespace (CheckpointConfig.namespace)")
    p.add_argument("--checkpoint-dir", type=checkpoint_folder, default=Path("minimal-checkpoints"),
                   help="checkpoint root; on a running cluster every node must mount it at "
                        "the same path (default: minimal-checkpoints)")
    p.add_argument("--sandbox-root", type=Path, default=None,
                   help="give every rollout a sandbox directory under this folder (the "
                        "same path on every node; default: a new temporary folder)")
    p.add_argument("--no-sandboxes", action="store_true",
                   help="run the rollouts without sandbox directories")
    p.add_argument("--rollouts", type=at_least(3), default=6)
    p.add_argument("--turns", type=at_least(4), default=6, help="turns per rollout")
    p.add_argument("--turn-seconds", type=non_negative_float, default=0.02,
                   help="simulated model and tool time per turn")
    args = p.parse_args(argv)
    problem = writable_folder_problem(args.checkpoint_dir)
    if problem is not None:
        p.error(f"argument --checkpoint-dir: {problem}")
    if args.no_sandboxes:
        args.sandbox_root = None
    elif args.sandbox_root is None:  # removed at the end (made_sandbox_root)
        args.sandbox_root = Path(tempfile.mkdtemp(prefix="nemo-ckpt-minimal-sandboxes-"))
        args.made_sandbox_root = True
    else:
        args.sandbox_root = args.sandbox_root.resolve()
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    cluster: Any = None
    try:
        if args.address is not None:
            # ray.init(address=...), failing in seconds and one line (README, token auth)
            connect(args.address, log_to_driver=False, logging_level=logging.WARNING)
            address = args.address
        else:
            from ray.cluster_utils import Cluster  # one machine, one raylet per "node"

            cluster = Cluster(initialize_head=True,
                              head_node_args={"num_cpus": 1, "include_dashboard": False})
            for _ in range(args.nodes - 1):
                cluster.add_node(num_cpus=1)
            ray.init(address=cluster.address, log_to_driver=False,
                     logging_level=logging.WARNING)
            cluster.wait_for_nodes()
            address = cluster.address
        return asyncio.run(main_async(args, address))
    except NemoCkptError as exc:  # no cluster, a folder the nodes do not share ...
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if ray.is_initialized():
            # Holders are detached actors: they outlive this driver unless shut down.
            RayEnvironmentCheckpoint(CheckpointConfig(namespace=args.namespace)).shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if getattr(args, "made_sandbox_root", False):
            shutil.rmtree(args.sandbox_root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
