#!/usr/bin/env python3
"""Rollouts whose environment is a container, crashed hard and recovered turn by turn
(``make demo-containers``).

Each rollout's environment is a container on the node's podman running a tool server
whose state lives in two places: its shell's memory (a counter and a running digest of
every request) and its disk (a note per turn, a log). Each turn the policy sends a
request, the server answers from its memory, and the turn writes the answer to disk.

The job snapshots mid-run, runs on, then crashes hard: every actor of the job killed,
the containers and the node's cache gone. The restarted job restores: each rollout's
container is created again from its image with its files and, where CRIU works, its
processes' memory, and the rollout continues from its saved turn. Sessions open their
containers with ``memory="required"``: on a node where CRIU does not work they are
restart-only, and the restarted job starts them over instead (the run says which it
did). Every rollout then runs to its end, and the answers and files are compared with a
crash-free run: VERIFIED when they are the same.

    python -m tests.container_runtime -- python examples/container_recovery.py
    python examples/container_recovery.py --rollouts 6 --turns 10 --no-criu

podman runs with this process's ``CONTAINERS_CONF`` and ``PATH`` (the first command sets
them for this machine's runtime; ``--no-criu`` drops CRIU from the holders' ``PATH``).
Exit 1 when the runs differ.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.sandbox_backend import ContainerRef
from nemo_ckpt.testing.data_plane import StaticCut

IMAGE = "localhost/nemo-ckpt-busybox:1"
# The tool server: its counter and digest live in the shell's memory only; a request
# through /tmp/req is answered on /tmp/rep with "<count> <digest>".
SERVER = ("mkfifo /tmp/req /tmp/rep; n=0; acc=start; "
          "while true; do read cmd < /tmp/req; n=$((n+1)); "
          "acc=$(echo \"$acc $cmd\" | md5sum | cut -c1-12); echo \"$n $acc\" > /tmp/rep; done")


@dataclass
class Rollout:
    """One rollout as the driver sees it: its answers so far and its container."""

    rollout_id: str
    answers: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    answers: dict[str, list[str]]
    disks: dict[str, str]
    continued: int = 0
    restarted: int = 0


def _config(root: Path, namespace: str, env: dict[str, str]) -> CheckpointConfig:
    return CheckpointConfig(namespace=namespace, checkpoint_root=root / "ckpt",
                            sandbox_root=root / "sandboxes", containers=True,
                            container_env=env, drain_timeout_s=5.0, turn_timeout_s=120.0)


def _request(rollout_id: str, turn: int) -> str:
    """What the policy sends at ``turn`` (a pure function: both runs send the same)."""
    return f"{rollout_id}-step-{turn}"


class Job:
    """One life of the job: a checkpoint, a holder per node, the driver's clients."""

    def __init__(self, root: Path, namespace: str, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        (root / "sandboxes").mkdir(parents=True, exist_ok=True)
        self.ckpt = RayEnvironmentCheckpoint(_config(root, namespace, env))
        self.podman = Podman(env=env)
        self.client: SessionClient | None = None
        self.containers: dict[str, str] = {}  # rollout -> its container, this life

    async def start(self) -> None:
        await self.ckpt.check_startup()
        holders = await self.ckpt.holders()
        self.client = await SessionClient.connect(
            holders[0].instance_id, namespace=self.ckpt.config.namespace)

    async def open(self, rollout: Rollout) -> EnvironmentEpisode:
        """A new attempt of ``rollout`` with a fresh container (the environment's)."""
        assert self.client is not None
        name = f"nemo-ckpt-demo-{uuid.uuid4().hex[:10]}"
        self.podman.run("run", "-d", "--name", name, IMAGE, "/bin/sh", "-c", SERVER)
        self.containers[rollout.rollout_id] = name
        ep = EnvironmentEpisode(rollout.rollout_id, 0)
        await self.client.open(ep, b"", container=ContainerRef(name, memory="required"))
        rollout.answers.clear()
        return ep

    async def turn(self, rollout: Rollout, ep: EnvironmentEpisode) -> None:
        assert self.client is not None
        async with self.client.turn(ep) as turn:
            container = turn.container
            assert container is not None
            t = turn.turn_count + 1
            answer = self.podman.text("exec", container, "sh", "-c",
                                      f"echo '{_request(rollout.rollout_id, t)}' > /tmp/req;"
                                      f" cat /tmp/rep")
            self.podman.run("exec", container, "sh", "-c",
                            f"mkdir -p /work/notes && echo '{answer}' > /work/notes/{t} && "
                            f"echo 'turn {t}: {answer}' >> /work/log")
            turn.complete(answer.encode(), str(t).encode())
        rollout.answers.append(answer)

    def disk(self, container: str) -> str:
        return self.podman.text("exec", container, "sh", "-c",
                                "cat /work/log; ls /work/notes | sort -n | tr '\\n' ' '")

    async def end(self, crash: bool) -> None:
        """The job's end; a crash also takes the node: its containers and its disk."""
        await self.ckpt.shutdown(wait=True)
        if crash:
            for name in self.containers.values():
                self.podman.remove(name)
            shutil.rmtree(self.root / "sandboxes", ignore_errors=True)


async def crash_free(root: Path, rollouts: int, turns: int, env: dict[str, str]) -> Outcome:
    job = Job(root, f"demo-ref-{uuid.uuid4().hex[:6]}", env)
    try:
        await job.start()
        done = [Rollout(f"r{k}") for k in range(rollouts)]
        for r in done:
            ep = await job.open(r)
            for _ in range(turns):
                await job.turn(r, ep)
        return Outcome({r.rollout_id: list(r.answers) for r in done},
                       {r.rollout_id: job.disk(job.containers[r.rollout_id]) for r in done})
    finally:
        await job.end(crash=False)
        for name in job.containers.values():
            job.podman.remove(name)


async def crashed_and_restored(root: Path, rollouts: int, turns: int, snapshot_at: int,
                               env: dict[str, str]) -> Outcome:
    namespace = f"demo-{uuid.uuid4().hex[:6]}"
    path = root / "ckpt" / "step-1"
    first = Job(root, namespace, env)
    live: dict[str, set[EnvironmentEpisode]] = {}
    try:
        await first.start()
        run = [Rollout(f"r{k}") for k in range(rollouts)]
        eps = {r.rollout_id: await first.open(r) for r in run}
        for r in run:
            for _ in range(snapshot_at):
                await first.turn(r, eps[r.rollout_id])
        holders = await first.ckpt.holders()
        live = {holders[0].instance_id: set(eps.values())}
        async with first.ckpt.snapshot(path) as snap:
            if snap is not None:
                await snap.check_against_cut(StaticCut(live, set()))
        for r in run:  # turns after the snapshot: lost in the crash
            await first.turn(r, eps[r.rollout_id])
    finally:
        await first.end(crash=True)

    second = Job(root, namespace, env)
    try:
        await second.start()
        assert second.client is not None
        async with second.ckpt.restored(path) as restored:
            continued = {rid: att for _, rid, att in restored.continued_attempts}
        outcome = Outcome({}, {})
        for k in range(rollouts):
            r = Rollout(f"r{k}")
            if r.rollout_id in continued:
                ep = EnvironmentEpisode(r.rollout_id, continued[r.rollout_id] + 1)
                record = await second.client.get(ep)
                assert record.container is not None
                second.containers[r.rollout_id] = record.container
                r.answers = [t.decode() for t in record.turns]
                outcome.continued += 1
            else:  # restart-only here (no CRIU): RL starts it over
                ep = await second.open(r)
                outcome.restarted += 1
            while len(r.answers) < turns:
                await second.turn(r, ep)
            outcome.answers[r.rollout_id] = r.answers
            outcome.disks[r.rollout_id] = second.disk(second.containers[r.rollout_id])
        return outcome
    finally:
        await second.end(crash=False)
        for name in second.containers.values():
            second.podman.remove(name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--snapshot-at", type=int, default=4, help="turns before the snapshot")
    p.add_argument("--no-criu", action="store_true",
                   help="run the holders with a PATH that finds no CRIU, as on a machine "
                        "where it does not work")
    args = p.parse_args(argv)
    if not 0 < args.snapshot_at < args.turns or args.rollouts < 1:
        p.error("need --rollouts >= 1 and 0 < --snapshot-at < --turns")
    env = {k: os.environ[k] for k in ("CONTAINERS_CONF", "PATH") if k in os.environ}
    if args.no_criu:
        env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    podman = Podman(env=env)
    problem = podman.available()
    if problem is not None:
        print(f"container demo: {problem} (make demo-containers installs the runtime)")
        return 1
    criu = podman.criu_problem()
    print("container demo: " + ("CRIU works here: the restore continues each container's "
                                "processes from their memory" if criu is None else
                                f"no CRIU here ({criu}): containers that need their "
                                f"memory are restart-only, started over after the crash"))
    import ray

    logging.basicConfig(level=logging.ERROR)
    # "local": a Ray instance of its own, even where RAY_ADDRESS names a cluster.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    work = Path(tempfile.mkdtemp(prefix="container-recovery-"))
    try:
        crashed = asyncio.run(crashed_and_restored(work / "crashed", args.rollouts,
                                                   args.turns, args.snapshot_at, env))
        reference = asyncio.run(crash_free(work / "clean", args.rollouts, args.turns, env))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    same = crashed.answers == reference.answers and crashed.disks == reference.disks
    print(f"container demo: crashed after turn {args.snapshot_at + 1} of {args.turns} "
          f"(snapshot at turn {args.snapshot_at}); {crashed.continued} rollout(s) continued "
          f"from their saved turn with their files and memory, {crashed.restarted} started "
          f"over (restart-only)")
    for rid in sorted(reference.answers):
        if crashed.answers.get(rid) != reference.answers[rid]:
            print(f"  {rid}: answers {crashed.answers.get(rid)} != {reference.answers[rid]}")
        if crashed.disks.get(rid) != reference.disks[rid]:
            print(f"  {rid}: disk {crashed.disks.get(rid)!r} != {reference.disks[rid]!r}")
    print(f"container demo: {'VERIFIED' if same else 'DIFFERENT'}: every rollout's answers "
          f"(from its server's memory) and files equal a crash-free run's")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
