#!/usr/bin/env python3
"""A job told to stop keeps its rollouts (``make demo-preemption``).

The job runs as a child process: agentic rollouts take turns (each a short tool call,
writing a row to RL's staging), a ``RolloutCheckpointManager`` snapshots them every
couple of seconds with NeMo RL's ledger and barrier (``nemo_ckpt.testing.nemo_rl``), and
its main body runs inside ``async with manager.preemption(deadline_s=...)``. Mid-run
this script tells it to stop, as Kubernetes or Slurm would, with SIGTERM; or, with
``--drain``, the child runs a two-node Ray cluster and this script drains the node of
one holder with Ray's own ``ray drain-node``, whose deadline (a fifth sooner than the
job's grace) the child's final snapshot is then held to. The child takes a final snapshot
within the deadline (RL's half through the manager's hook, the sessions parked and their
sandboxes freed by its stop commit) and exits with status 143.

Then this script restores the latest snapshot in a fresh job, checks that every turn the
child had committed came back (none lost), runs every rollout to its end, and compares
their turns with a crash-free run: VERIFIED when they are the same. Exit 1 otherwise.

    python examples/preemption_recovery.py
    python examples/preemption_recovery.py --drain --rollouts 6 --turns 20
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from nemo_ckpt import (
    CheckpointConfig,
    RayEnvironmentCheckpoint,
    RolloutCheckpointConfig,
    RolloutCheckpointManager,
    SessionClient,
)
from nemo_ckpt.integrations.nemo_rl import NemoRlEnvironmentCheckpoint
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.testing.nemo_rl import (
    DataPlaneCheckpointBarrier,
    NemoRlState,
    RecoveryTargetLevel,
)

PROGRESS = "progress.jsonl"
SIGTERM_STATUS = 128 + signal.SIGTERM


def turn_record(group: str, n: int, state: bytes) -> bytes:
    """Turn ``n`` of ``group``'s rollout: a pure function of what came before."""
    return hashlib.sha256(f"{group}:{n}:".encode() + state).hexdigest()[:16].encode()


class Job:
    """One life of the job: its checkpoint, NeMo RL's half and the manager."""

    def __init__(self, root: Path, namespace: str, instances: int,
                 interval_s: float = 2.0) -> None:
        self.ckpt = RayEnvironmentCheckpoint(CheckpointConfig(
            namespace=namespace, checkpoint_root=root, drain_timeout_s=2.0,
            turn_timeout_s=60.0))
        self.barrier = DataPlaneCheckpointBarrier()
        # RL's owners, one per holder (named holder-0, holder-1, ... as made).
        self.owners = {f"replica-{i}": f"holder-{i}" for i in range(instances)}
        self.env = NemoRlEnvironmentCheckpoint(
            self.ckpt, ledger=lambda: self.rl.ledger,
            staging=lambda: self.rl.staging.list_keys(), owners=self.owners)
        self.rl: NemoRlState = NemoRlState(self.env, self.barrier)
        self.manager = RolloutCheckpointManager(
            self.env, self.barrier, self.rl,
            RolloutCheckpointConfig(root=str(root), snapshot_attempt_interval_s=interval_s,
                                    keep_latest_k=2))
        self.clients: dict[str, SessionClient] = {}

    async def start(self) -> None:
        await self.ckpt.check_startup()

    async def client(self, owner: str) -> SessionClient:
        if owner not in self.clients:
            self.clients[owner] = await SessionClient.connect(
                self.owners[owner], namespace=self.ckpt.config.namespace)
        return self.clients[owner]

    async def open(self, group: str, owner: str) -> EnvironmentEpisode:
        async with self.barrier.mutation() as cut:
            prompt = int(group[1:])  # groups are g0, g1, ...: the dataset's sample index
            record = self.rl.ledger.reserve_group(
                cut, group_id=group, prompt_id=str(prompt), prompt_payload={"idx": prompt},
                expected_generations=1, target_step=1, start_weight_version=0,
                restore_level=RecoveryTargetLevel.TURN)
            self.rl.ledger.mark_group_dispatched(cut, group, gym_instance_id=owner)
        ep = EnvironmentEpisode(*record.gym_episode(0))
        await (await self.client(owner)).open(ep, b"")
        return ep

    async def turn(self, group: str, owner: str, ep: EnvironmentEpisode,
                   tool_seconds: float) -> int:
        """One turn: a tool call, a row in RL's staging. Returns the turns now."""
        async with (await self.client(owner)).turn(ep) as turn:
            n = turn.turn_count
            await asyncio.sleep(tool_seconds)
            key = f"{ep.capture_key}/row{n}"
            async with self.barrier.mutation() as cut:
                self.rl.staging.put(cut, key, b"tokens")
            turn.complete(turn_record(group, n, turn.state), turn_record(group, n, turn.state),
                          [key])
        return n + 1


# --- the child: the job that is told to stop --------------------------------------------


async def child_job(run: Path, rollouts: int, turns: int, tool_seconds: float,
                    deadline_s: float, address: str, drain_node: str | None) -> None:
    progress = (run / PROGRESS).open("a", buffering=1)

    def say(**event: Any) -> None:
        progress.write(json.dumps(event) + "\n")

    job = Job(run / "ckpt", "preempted-job", instances=2 if drain_node else 1)
    await job.start()
    groups = {f"g{k}": f"replica-{k % len(job.owners)}" for k in range(rollouts)}
    eps = {g: await job.open(g, owner) for g, owner in groups.items()}
    say(event="ready", address=address, drain_node=drain_node, pid=os.getpid(),
        rollouts={g: [owner, ep.rollout_id] for (g, owner), ep in
                  zip(groups.items(), eps.values(), strict=True)})

    async def rollout(group: str) -> None:
        for _ in range(turns):
            done = await job.turn(group, groups[group], eps[group], tool_seconds)
            say(event="turn", group=group, turns=done)

    async def periodic() -> None:
        while True:
            taken = await job.manager.maybe_snapshot()
            if taken is not None:
                say(event="snapshot", path=taken.path)
            await asyncio.sleep(0.25)

    async with job.manager.preemption(deadline_s=deadline_s, drain_poll_s=0.5):
        ticker = asyncio.ensure_future(periodic())
        try:
            await asyncio.gather(*(rollout(g) for g in groups))
        finally:
            ticker.cancel()
    say(event="finished")  # never told to stop: the parent's signal came too late


def child_main(args: argparse.Namespace) -> int:
    import ray

    logging.basicConfig(level=logging.WARNING, format="child: %(message)s")
    cluster = None
    drain_node = None
    if args.drain:  # two nodes, so that a holder's node can drain while the job runs
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 1, "include_dashboard": False})
        drain_node = cluster.add_node(num_cpus=1).node_id
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        cluster.wait_for_nodes()
        address = cluster.address
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        address = ray.get_runtime_context().gcs_address
    try:
        asyncio.run(child_job(args.child, args.rollouts, args.turns, args.tool_seconds,
                              args.deadline, address, drain_node))
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    return 0


# --- this script: stop the child, restore, compare --------------------------------------


def _events(run: Path) -> list[dict[str, Any]]:
    path = run / PROGRESS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def stop_the_child(run: Path, args: argparse.Namespace
                   ) -> tuple[int, float, dict[str, int], str]:
    """Start the child, stop it mid-run; its status, seconds to exit, turns committed,
    and what it said of the final snapshot's deadline."""
    cmd = [sys.executable, __file__, "--child", str(run), "--rollouts", str(args.rollouts),
           "--turns", str(args.turns), "--tool-seconds", str(args.tool_seconds),
           "--deadline", str(args.deadline)] + (["--drain"] if args.drain else [])
    with (run / "child.log").open("w") as log_file:
        # Its own session, so that giving up on it kills its Ray processes too; the
        # stop itself (SIGTERM) goes to the child alone, as a scheduler's would.
        child = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            start = time.monotonic()
            while True:  # until a snapshot committed and every rollout is a third in
                events = _events(run)
                turns = {e["group"]: e["turns"] for e in events if e["event"] == "turn"}
                if any(e["event"] == "snapshot" for e in events) and \
                        len(turns) == args.rollouts and \
                        min(turns.values()) >= args.turns // 3:
                    break
                if child.poll() is not None or time.monotonic() - start > 240:
                    raise RuntimeError(f"the child job ended or stalled before it was "
                                       f"stopped (status {child.poll()}); see "
                                       f"{run / 'child.log'}")
                time.sleep(0.05)
            ready = next(e for e in events if e["event"] == "ready")
            told = time.monotonic()
            if args.drain:
                subprocess.run([str(Path(sys.executable).with_name("ray")), "drain-node",
                                "--address", ready["address"], "--node-id",
                                ready["drain_node"], "--reason",
                                "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                                "preemption demo", "--deadline-remaining-seconds",
                                str(_drain_deadline_s(args.deadline))],
                               check=True, capture_output=True)
            else:
                child.send_signal(signal.SIGTERM)
            status = child.wait(timeout=args.deadline + 30)
            took = time.monotonic() - told
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    committed = {e["group"]: e["turns"] for e in _events(run) if e["event"] == "turn"}
    said = next((line.split("; ", 1)[-1] for line in
                 (run / "child.log").read_text(errors="replace").splitlines()
                 if "taking the final snapshot within" in line), "nothing of its deadline")
    return status, took, committed, said


def _drain_deadline_s(grace_s: float) -> int:
    """The deadline ``ray drain-node`` is given: a fifth sooner than the job's grace, so
    the child is seen holding its final snapshot to the drain's, not its own."""
    return max(1, int(grace_s * 0.8))


async def restore_and_finish(run: Path, args: argparse.Namespace,
                             rollouts: dict[str, list[str]]
                             ) -> tuple[dict[str, list[bytes]], dict[str, int], str]:
    """Restore the latest snapshot in a fresh job; each rollout's turns once run to its
    end, the turns each had when restored, and the snapshot's path."""
    job = Job(run / "ckpt", "preempted-job", instances=2 if args.drain else 1)
    await job.start()
    handover = await job.manager.restore()
    assert handover is not None, "no snapshot to restore"
    continued = handover.continued_by_id()  # each rollout's episode, owner, turns
    out: dict[str, list[bytes]] = {}
    restored_turns: dict[str, int] = {}
    for group, (_owner, rollout_id) in sorted(rollouts.items()):
        kept = continued[rollout_id]
        client = await job.client(kept.owner)
        restored_turns[group] = len((await client.get(kept.episode)).turns)
        assert restored_turns[group] == kept.turns, (group, kept)
        while len((await client.get(kept.episode)).turns) < args.turns:
            await job.turn(group, kept.owner, kept.episode, 0.0)
        out[group] = list((await client.get(kept.episode)).turns)
    await job.ckpt.shutdown(wait=True)
    return out, restored_turns, handover.path


async def crash_free(run: Path, args: argparse.Namespace) -> dict[str, list[bytes]]:
    job = Job(run / "clean", f"clean-{uuid.uuid4().hex[:6]}", instances=1,
              interval_s=3600.0)
    await job.start()
    out = {}
    for k in range(args.rollouts):
        group, owner = f"g{k}", f"replica-{k % len(job.owners)}"
        ep = await job.open(group, owner)
        for _ in range(args.turns):
            await job.turn(group, owner, ep, 0.0)
        out[group] = list((await (await job.client(owner)).get(ep)).turns)
    await job.ckpt.shutdown(wait=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--turns", type=int, default=24)
    p.add_argument("--tool-seconds", type=float, default=0.25,
                   help="how long each turn's tool call takes")
    p.add_argument("--deadline", type=float, default=25.0,
                   help="the grace period: seconds from the signal to the kill")
    p.add_argument("--drain", action="store_true",
                   help="drain a node hosting a holder with Ray's drain-node instead of "
                        "sending SIGTERM")
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rollouts < 1 or args.turns < 6 or args.deadline <= 0:
        p.error("need --rollouts >= 1, --turns >= 6 and a positive --deadline")
    if args.child is not None:
        return child_main(args)

    how = "a drain of a holder's node (ray drain-node)" if args.drain else "SIGTERM"
    run = Path(tempfile.mkdtemp(prefix="preemption-"))
    try:
        status, took, committed, said = stop_the_child(run, args)
        events = _events(run)
        rollouts = next(e for e in events if e["event"] == "ready")["rollouts"]
        print(f"preemption demo: the job was told to stop by {how} after "
              f"{sum(committed.values())} turns; it exited with status {status} "
              f"{took:.1f}s later (deadline {args.deadline:g}s); it said: {said}")
        import ray

        logging.basicConfig(level=logging.ERROR)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            turns, restored_turns, path = asyncio.run(restore_and_finish(run, args,
                                                                         rollouts))
            reference = asyncio.run(crash_free(run, args))
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(run, ignore_errors=True)
    periodic = {e["path"] for e in events if e["event"] == "snapshot"}
    final = f"the final snapshot {Path(path).name}" if path not in periodic \
        else f"{Path(path).name}, a periodic snapshot (NOT the final one)"
    lost = {g: committed.get(g, 0) - n for g, n in restored_turns.items()
            if n != committed.get(g, 0)}
    print(f"preemption demo: restored {final}: {len(restored_turns)} rollout(s) continued "
          f"with {sum(restored_turns.values())} turns, "
          f"{'none lost' if not lost else f'LOST {lost}'}")
    same = turns == reference
    ok = status == SIGTERM_STATUS and took <= args.deadline and not lost and same \
        and path not in periodic
    print(f"preemption demo: {'VERIFIED' if ok else 'DIFFERENT'}: exit status "
          f"{status} (expected {SIGTERM_STATUS}) within the deadline, a final snapshot "
          f"committed, every committed turn restored, every rollout's turns equal a "
          f"crash-free run's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
