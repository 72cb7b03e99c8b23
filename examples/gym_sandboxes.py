#!/usr/bin/env python3
"""NeMo Gym's own sandboxes, crashed hard and recovered with their rollouts
(``make demo-gym``).

Each rollout's tools run through Gym's ``AsyncSandbox`` on nemo-ckpt's provider, selected
by name through Gym's registry: ``nemo_ckpt_docker`` (Gym's ``docker`` provider on
podman, with Gym's defaults, ``--init`` among them) or ``nemo_ckpt_local`` (Gym's
``local`` provider, a directory per sandbox). Each turn the policy sends a request; with
``docker`` a tool server answers it from its shell's memory (a counter and a running
digest) and the turn writes the answer to the sandbox's disk; with ``local`` the answer
is a digest of the sandbox's log file, which the turn extends.

The job (with each provider's sandboxes, by default) runs as a child process with a
Ray instance of its own. It snapshots mid-run,
runs one more turn per rollout, and is then killed (SIGKILL, its Ray with it); the node
goes too (its sandboxes removed). A fresh job restores: each sandbox comes back with its
files and, for ``docker`` where CRIU works, its processes' memory, and Gym's
``AsyncSandbox.connect`` hands it to the rollout, which runs to its end. The answers and
files are compared with a crash-free run: VERIFIED when they are the same. Exit 1 when
they differ.

    python -m tests.container_runtime -- python examples/gym_sandboxes.py
    python examples/gym_sandboxes.py --provider local --rollouts 3 --turns 6
"""

from __future__ import annotations

# nemo-ckpt before NeMo Gym: Gym's import moves the working directory behind
# site-packages on sys.path (and replaces print), so it is imported in the job only.
import argparse
import asyncio
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

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.integrations import nemo_gym as ours
from nemo_ckpt.integrations.nemo_gym_docker import NemoCkptDockerProvider
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.testing.data_plane import StaticCut

IMAGE = "localhost/nemo-ckpt-busybox:1"
PROVIDERS: dict[str, type[ours.RolloutSandboxProvider]] = {
    "local": ours.NemoCkptLocalProvider, "docker": NemoCkptDockerProvider}
# The docker sandbox's tool server: its counter and digest live in its shell's memory
# only; a request through /tmp/req is answered on /tmp/rep with "<count> <digest>".
SERVER = ("mkfifo /tmp/req /tmp/rep; n=0; acc=start; "
          "while true; do read cmd < /tmp/req; n=$((n+1)); "
          "acc=$(echo \"$acc $cmd\" | md5sum | cut -c1-12); echo \"$n $acc\" > /tmp/rep; done")
READY = "crash-ready.json"  # the job's note that it may be killed now


# --- the job (a child process: ``--job first|second``) -----------------------------


class Job:
    """One life of the job: its checkpoint, a holder, Gym's provider by name."""

    def __init__(self, provider: str, root: Path, namespace: str) -> None:
        self.kind = provider
        self.root = root
        env = {k: os.environ[k] for k in ("CONTAINERS_CONF", "PATH") if k in os.environ}
        self.ckpt = RayEnvironmentCheckpoint(CheckpointConfig(
            namespace=namespace, checkpoint_root=root / "ckpt",
            sandbox_root=root / "sandboxes", containers=provider == "docker",
            container_env=env, drain_timeout_s=5.0, turn_timeout_s=120.0))
        self.boxes: dict[str, Any] = {}  # rollout -> Gym's AsyncSandbox

    async def start(self) -> None:
        from nemo_gym.sandbox import create_provider, list_providers, register_provider

        (self.root / "sandboxes").mkdir(parents=True, exist_ok=True)
        await self.ckpt.check_startup()
        self.instance = (await self.ckpt.holders())[0].instance_id
        self.client = await SessionClient.connect(self.instance,
                                                  namespace=self.ckpt.config.namespace)
        cls = PROVIDERS[self.kind]
        if cls.name not in list_providers():  # a venv installed before its entry points
            register_provider(cls.name, cls)
        options: dict[str, Any] = {"namespace": self.ckpt.config.namespace}
        if self.kind == "local":
            options["sandbox_root"] = str(self.root / "sandboxes")
        self.provider = create_provider({cls.name: options})  # as a Gym config selects it

    async def open(self, rollout: str, episode: Ep) -> None:
        """A fresh sandbox for ``episode``, its session opened by the provider."""
        from nemo_gym.sandbox import AsyncSandbox, SandboxSpec

        meta = ours.sandbox_metadata(episode, self.instance)
        spec = SandboxSpec(image=IMAGE, metadata=meta, entrypoint=["sh", "-c", SERVER]) \
            if self.kind == "docker" else SandboxSpec(metadata=meta,
                                                      files={"task.txt": f"{rollout}\n"})
        self.boxes[rollout] = await AsyncSandbox(self.provider, spec,
                                                 owns_provider=False).start()

    async def adopt(self, rollout: str, episode: Ep, instance: str) -> list[str]:
        """Gym's handle on the restored sandbox of ``episode``; its committed answers."""
        from nemo_gym.sandbox import AsyncSandbox

        self.boxes[rollout] = await AsyncSandbox.connect(
            ours.sandbox_descriptor(episode, instance, PROVIDERS[self.kind].name),
            provider=self.provider, owns_provider=False)
        record = await self.client.get(episode)
        return [t.decode() for t in record.turns]

    async def turn(self, rollout: str, episode: Ep, answers: list[str]) -> None:
        box = self.boxes[rollout]
        t = len(answers) + 1
        request = f"{rollout}-step-{t}"  # what the policy sends (both runs the same)
        async with self.client.turn(episode) as turn:
            if self.kind == "docker":
                asked = await box.exec(f"echo '{request}' > /tmp/req; cat /tmp/rep")
                answer = asked.stdout.strip()
                wrote = await box.exec(f"echo 'turn {t}: {answer}' >> /work/log")
            else:
                asked = await box.exec(f"echo '{request}' >> log.txt && "
                                       f"md5sum log.txt | cut -c1-12")
                answer = asked.stdout.strip()
                wrote = await box.exec(f"echo 'turn {t}: {answer}' >> notes.txt")
            if asked.return_code or wrote.return_code:
                raise RuntimeError(f"{rollout} turn {t}: {asked.stderr}{wrote.stderr}")
            turn.complete(answer.encode(), str(t).encode())
        answers.append(answer)

    async def files(self, rollout: str) -> str:
        what = "cat /work/log" if self.kind == "docker" else "cat task.txt log.txt notes.txt"
        return str((await self.boxes[rollout].exec(what)).stdout)

    async def close(self, rollout: str, episode: Ep) -> None:
        await self.boxes.pop(rollout).stop()
        await self.client.finish(episode, b"done")


async def first_life(args: argparse.Namespace, provider: str) -> dict[str, Any]:
    """Open ``provider``'s sandboxes, run ``snapshot_at`` turns, snapshot, run one more:
    what the crash must clean up and what its sandboxes declared."""
    root = args.root / provider
    job = Job(provider, root, f"{args.namespace}-{provider}")
    await job.start()
    rollouts = [f"r{k}" for k in range(args.rollouts)]
    answers: dict[str, list[str]] = {r: [] for r in rollouts}
    for r in rollouts:
        await job.open(r, Ep(r, 0))
    for _ in range(args.snapshot_at):
        for r in rollouts:
            await job.turn(r, Ep(r, 0), answers[r])
    live = {job.instance: {Ep(r, 0) for r in rollouts}}
    async with job.ckpt.snapshot(root / "ckpt" / "step-1") as snap:
        if snap is not None:
            await snap.check_against_cut(StaticCut(live, set()))
    for r in rollouts:  # after the snapshot: lost in the crash
        await job.turn(r, Ep(r, 0), answers[r])
    names = [job.boxes[r]._handle.raw.inner.sandbox_id for r in rollouts]
    return {"containers": names if provider == "docker" else [],
            "recovery": [job.provider.recovery_of(job.boxes[r]._handle).value
                         for r in rollouts]}


async def first_lives(args: argparse.Namespace) -> None:
    """Each provider's first life, in one job; then say so and wait to be killed."""
    note = {p: await first_life(args, p) for p in args.providers}
    (args.root / READY).write_text(json.dumps(note))
    await asyncio.sleep(3600)  # killed here


async def second_life(args: argparse.Namespace, provider: str) -> dict[str, Any]:
    """Restore, run every rollout to its end; then a crash-free run to compare with."""
    root, namespace = args.root / provider, f"{args.namespace}-{provider}"
    job = Job(provider, root, namespace)
    await job.start()
    async with job.ckpt.restored(root / "ckpt" / "step-1") as restored:
        continued = {rid: (inst, att) for inst, rid, att in restored.continued_attempts}
    out: dict[str, Any] = {"crashed": {}, "clean": {}, "continued": 0, "restarted": 0}
    for k in range(args.rollouts):
        r = f"r{k}"
        if r in continued:
            instance, attempt = continued[r]
            episode = Ep(r, attempt + 1)
            answers = await job.adopt(r, episode, instance)
            out["continued"] += 1
        else:  # restart-only (no CRIU here): RL starts it over
            episode, answers = Ep(r, 0), []
            await job.open(r, episode)
            out["restarted"] += 1
        while len(answers) < args.turns:
            await job.turn(r, episode, answers)
        out["crashed"][r] = [answers, await job.files(r)]
        await job.close(r, episode)
    await job.ckpt.shutdown(wait=True)

    clean = Job(provider, root / "clean", f"{namespace}-clean")
    await clean.start()
    for k in range(args.rollouts):
        r = f"r{k}"
        answers = []
        await clean.open(r, Ep(r, 0))
        while len(answers) < args.turns:
            await clean.turn(r, Ep(r, 0), answers)
        out["clean"][r] = [answers, await clean.files(r)]
        await clean.close(r, Ep(r, 0))
    await clean.ckpt.shutdown(wait=True)
    return out


async def second_lives(args: argparse.Namespace) -> dict[str, Any]:
    return {p: await second_life(args, p) for p in args.providers}


def job_main(args: argparse.Namespace) -> int:
    import ray

    logging.basicConfig(level=logging.ERROR)
    # "local": a Ray instance of this process's own, killed with it.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        if args.job == "first":
            asyncio.run(first_lives(args))
            return 1  # never reached: killed while waiting
        result = asyncio.run(second_lives(args))
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")
        return 0
    finally:
        ray.shutdown()


# --- the demo (this process: starts the job, kills it, restarts it) -----------------


def _job(args: argparse.Namespace, phase: str, root: Path, namespace: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--job", phase, "--provider",
            args.provider, "--root", str(root), "--namespace", namespace,
            "--rollouts", str(args.rollouts), "--turns", str(args.turns),
            "--snapshot-at", str(args.snapshot_at)]


def _crash(args: argparse.Namespace, root: Path, namespace: str) -> dict[str, Any] | None:
    """The job's first life, killed (SIGKILL) once it has run past its snapshot: what
    it noted, or None (its log printed) when it did not get there."""
    log = root / "job.log"
    with log.open("w") as out:
        # Its own session: the kill below takes its Ray processes too.
        child = subprocess.Popen(_job(args, "first", root, namespace), stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + args.timeout
        while not (root / READY).exists() and child.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(child.pid, signal.SIGKILL)  # the crash
        child.wait()
    if not (root / READY).exists():
        print(f"gym demo: the job did not reach its crash point:\n{log.read_text()[-3000:]}")
        return None
    note: dict[str, Any] = json.loads((root / READY).read_text())
    return note


def run(args: argparse.Namespace, providers: list[str], podman: Podman) -> bool:
    namespace = f"demo-gym-{uuid.uuid4().hex[:6]}"
    root = Path(tempfile.mkdtemp(prefix="gym-sandboxes-"))
    try:
        note = _crash(args, root, namespace)
        if note is None:
            return False
        for p in providers:  # the node went with the job: its sandboxes too
            for name in note[p]["containers"]:
                podman.remove(name)
            shutil.rmtree(root / p / "sandboxes", ignore_errors=True)
            print(f"gym demo ({p}): killed the job after turn {args.snapshot_at + 1} of "
                  f"{args.turns} (snapshot at turn {args.snapshot_at}); its sandboxes "
                  f"declared {sorted(set(note[p]['recovery']))}")
        done = subprocess.run(_job(args, "second", root, namespace), capture_output=True,
                              text=True, timeout=args.timeout)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode != 0 or len(lines) != 1:
            print(f"gym demo: the restarted job failed:\n{done.stdout[-2000:]}"
                  f"{done.stderr[-3000:]}")
            return False
        results = json.loads(lines[0].removeprefix("RESULT "))
        ok = True
        for p in providers:
            result = results[p]
            print(f"gym demo ({p}): restored; {result['continued']} rollout(s) continued "
                  f"from their saved turn through Gym's AsyncSandbox.connect, "
                  f"{result['restarted']} started over")
            crashed, clean = result["crashed"], result["clean"]
            for r in sorted(clean):
                if crashed.get(r) != clean[r]:
                    print(f"  {r}: {crashed.get(r)} != {clean[r]}")
            same = crashed == clean
            memory = " (from its server's memory)" if p == "docker" else ""
            print(f"gym demo ({p}): {'VERIFIED' if same else 'DIFFERENT'}: every rollout's "
                  f"answers{memory} and its sandbox's files equal a crash-free run's")
            ok = ok and same
        return ok
    finally:
        if "docker" in providers and podman.available() is None:
            for name in podman.text("ps", "-a", "--filter", f"name=^nemo-ckpt-{namespace}",
                                    "--format", "{{.Names}}").split():
                podman.remove(name)
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--provider", choices=["docker", "local", "both"], default="both",
                   help="both: each provider's sandboxes in the same job")
    p.add_argument("--rollouts", type=int, default=3)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--snapshot-at", type=int, default=3, help="turns before the snapshot")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job life")
    p.add_argument("--job", choices=["first", "second"], help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--namespace", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 < args.snapshot_at < args.turns or args.rollouts < 1:
        p.error("need --rollouts >= 1 and 0 < --snapshot-at < --turns")
    args.providers = ["local", "docker"] if args.provider == "both" else [args.provider]
    if args.job:
        return job_main(args)
    env = {k: os.environ[k] for k in ("CONTAINERS_CONF", "PATH") if k in os.environ}
    podman = Podman(env=env)
    if "docker" in args.providers:
        problem = podman.available() or (None if shutil.which("docker") else
                                         "no `docker` command on PATH")
        if problem is not None:
            print(f"gym demo (docker): {problem} (make demo-gym installs the runtime)")
            return 1
    return 0 if run(args, args.providers, podman) else 1


if __name__ == "__main__":
    sys.exit(main())
