#!/usr/bin/env python3
"""An asynchronous GRPO loop shaped like NeMo RL's, crashed and recovered turn by turn.

The controller dispatches prompt groups ahead of the trainer (turn-level groups and
sibling-level ones, mixed) to Gym replicas; each sibling's rollout runs its turns in a
nemo-ckpt session on its replica's holder, writing one token-capture staging row per
turn; a finished sibling is sealed in NeMo RL's ``RolloutRecoveryLedger``; a group whose
siblings are all sealed is published as NeMo RL's controller does (it leaves the ledger,
its rows stay staged), and a trainer step trains its prompts' published groups. Rollout
snapshots come between trainer checkpoints through ``RolloutCheckpointManager`` (an
interval counted in turns) and, anchored, just before each trainer checkpoint; the ledger,
``DataPlaneCheckpointBarrier`` and staging partition are NeMo RL's test double
(``nemo_ckpt.testing.nemo_rl``), plugged in by ``NemoRlEnvironmentCheckpoint``.

The job crashes at the point asked (``--crash-at``): during a snapshot, between an
anchored snapshot and its trainer checkpoint, during retention, or after a snapshot's
folder was renamed; or it is preempted between two trainer checkpoints, its final
snapshot anchored to the trainer checkpoint it saves at the stop
(``save_trainer_checkpoint``); or at one of them picked by ``--seed``. Every actor of the job is
killed and every in-memory object dropped; the restarted job loads its newest trainer
checkpoint and restores the rollout snapshot anchored to it
(``restore_mode="trainer_checkpoint"``), continues the turn-level rollouts from their
saved turns, starts the others over, and trains to the end. A crash-free run of the same
seed gives the reference: the run prints VERIFIED when the trained weights and every
trained trajectory are equal and every rollout was trained exactly once.

    python examples/grpo_recovery.py                       # every crash point
    python examples/grpo_recovery.py --crash-at during-retention --seed 3
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_ckpt import (
    CheckpointConfig,
    RayEnvironmentCheckpoint,
    RlFiles,
    RolloutCheckpointConfig,
    RolloutCheckpointManager,
    SessionClient,
    TrainerCheckpoint,
)
from nemo_ckpt.integrations.nemo_rl import NemoRlEnvironmentCheckpoint
from nemo_ckpt.interfaces import EnvironmentEpisode, RestoredEnvironmentRollouts
from nemo_ckpt.testing.nemo_rl import (
    DataPlaneCheckpointBarrier,
    DataPlaneMutationCut,
    NemoRlState,
    PromptGroupStatus,
    RecoveryTargetLevel,
    RolloutAttemptStatus,
    publish_group,
)

CRASH_POINTS = ("during-snapshot", "between-snapshot-and-trainer-checkpoint",
                "during-retention", "after-rename", "preempted")
PROMPTS = 16
GROUPS_PER_STEP = 2
GENERATIONS = 2
STEPS = PROMPTS // GROUPS_PER_STEP
CHECKPOINT_EVERY = 2  # trainer steps
AHEAD = 2  # trainer steps of prompts dispatched ahead of the trainer
REPLICAS = ("tools/replica-0", "tools/replica-1")
CONTROLLER_FILE = "controller.json"
CONTROLLER_MAX_BYTES = 4096  # {"next_prompt": n}: anything larger is not the controller's


class Crash(BaseException):
    """The job dies here (raised past every handler, as a kill would end it)."""


def turns_of(prompt: int) -> int:
    return 3 + prompt % 4


def level_of(prompt: int) -> RecoveryTargetLevel:
    return RecoveryTargetLevel.TURN if prompt % 3 else RecoveryTargetLevel.SIBLING


def prompt_payload(prompt: int) -> dict[str, Any]:
    """The dataset's sample: the ledger saves only its index, as NeMo RL's does."""
    return {"idx": prompt, "message_log": [{"role": "user", "content": f"prompt {prompt}"}]}


def next_token(state: bytes, prompt: int, generation: int, turn: int) -> bytes:
    """One turn of the policy and the tool: a pure function of what came before."""
    return hashlib.sha256(state + f"{prompt}/{generation}/{turn}".encode()).digest()[:16]


def row_turn(key: str) -> int:
    return int(key.rsplit("/t", 1)[1])


class Controller(NemoRlState):
    """RL's half of each rollout snapshot: NeMo RL's ledger and staging (the double's),
    and the controller's own position in the dataset."""

    def __init__(self, integration: Any, barrier: DataPlaneCheckpointBarrier) -> None:
        super().__init__(integration, barrier)
        self.next_prompt = 0
        self.on_save: Callable[[], None] = lambda: None
        self.on_remove: Callable[[str], None] = lambda path: None

    def files(self, path: str) -> RlFiles:
        """The controller's own files in a snapshot's path (a folder or a bucket),
        written and read as the job's checkpoint runs file work."""
        return RlFiles(path, run_blocking=self.integration.run_blocking)

    async def save(self, cut: DataPlaneMutationCut, path: str) -> None:
        self.on_save()
        await super().save(cut, path)
        await self.files(path).write_json_async(CONTROLLER_FILE,
                                                {"next_prompt": self.next_prompt})

    async def restore(self, path: str, restored: RestoredEnvironmentRollouts) -> None:
        await super().restore(path, restored)
        saved = await self.files(path).read_json_async(CONTROLLER_FILE,
                                                       max_bytes=CONTROLLER_MAX_BYTES)
        self.next_prompt = int(saved["next_prompt"])
        # The loaded ledger names its prompts only: bind them again from the dataset.
        async with self.barrier.mutation("recovery_restore") as cut:
            for record in self.ledger.groups():
                self.ledger.bind_runtime_prompt(cut, record.group_id,
                                                prompt_payload(int(record.prompt_id)))

    async def remove(self, path: str) -> None:
        self.on_remove(path)
        await super().remove(path)
        await self.files(path).remove_async([CONTROLLER_FILE])  # none there: no error


@dataclass
class Outcome:
    weights: str
    trained: list[tuple[str, int, list[str]]] = field(default_factory=list)
    restored_from: str | None = None
    continued: int = 0


class Life:
    """One life of the job: a driver with its checkpoint, manager, controller, trainer."""

    env: NemoRlEnvironmentCheckpoint
    rl: Controller
    manager: RolloutCheckpointManager

    def __init__(self, root: Path, namespace: str, seed: int, crash_at: str | None,
                 trained: list[tuple[str, int, list[str]]]) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.crash_at = crash_at
        self.config = CheckpointConfig(namespace=namespace, checkpoint_root=root,
                                       drain_timeout_s=2.0)
        self.ray_ckpt = RayEnvironmentCheckpoint(self.config)
        self.barrier = DataPlaneCheckpointBarrier()
        self.owners: dict[str, str] = {}
        self.trained = trained
        self.turns = 0
        self.snapshots = 0
        self.weights = b"init"
        self.step = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.clients: dict[str, SessionClient] = {}

    async def start(self) -> None:
        await self.ray_ckpt.check_startup()
        holders = sorted(h.instance_id for h in await self.ray_ckpt.holders())
        self.owners = {r: holders[k % len(holders)] for k, r in enumerate(REPLICAS)}
        self.env = NemoRlEnvironmentCheckpoint(
            self.ray_ckpt, ledger=lambda: self.rl.ledger,
            staging=lambda: self.rl.staging.list_keys(), owners=self.owners)
        self.rl = Controller(self.env, self.barrier)
        self.rl.on_save = self._on_save
        self.rl.on_remove = self._on_remove
        self.manager = RolloutCheckpointManager(
            self.env, self.barrier, self.rl,
            RolloutCheckpointConfig(root=str(self.root), snapshot_attempt_interval_s=6,
                                    keep_latest_k=2, restore_mode="trainer_checkpoint"),
            fingerprint={"environment_adapters": ["grpo-toy"], "prompts": PROMPTS},
            clock=lambda: float(self.turns), on_event=self._on_event)
        for replica, instance in self.owners.items():
            self.clients[replica] = await SessionClient.connect(
                instance, namespace=self.config.namespace)

    # --- crashes ----------------------------------------------------------------------

    def _on_save(self) -> None:
        self.snapshots += 1
        if self.crash_at == "during-snapshot" and self.step >= 3:
            raise Crash("during a snapshot")

    def _on_event(self, event: str, path: str) -> None:
        if self.crash_at == "after-rename" and event == "renamed" and self.step >= 3:
            raise Crash(f"after {Path(path).name} was renamed")

    def _on_remove(self, path: str) -> None:
        # Retention removed the environment's half of ``path``, not yet RL's.
        if self.crash_at == "during-retention" and self.step >= 4:
            raise Crash(f"while retention removed {Path(path).name}")

    # --- the loop ---------------------------------------------------------------------

    async def run(self, restore: bool) -> Outcome:
        outcome = Outcome(weights="")
        if restore:
            outcome.restored_from, outcome.continued = await self._restore()
        else:
            await self._trainer_checkpoint()  # step 0: where a crash-free start begins
        try:
            while self.step < STEPS:
                await self._dispatch_ahead()
                await self._wait_for_step(self.step + 1)
                await self._train(self.step + 1)
                if self.step % CHECKPOINT_EVERY == 0:
                    await self._trainer_checkpoint()
                elif self.crash_at == "preempted" and self.step == 3:
                    await self._preempted()
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        outcome.weights = self.weights.hex()
        outcome.trained = list(self.trained)
        return outcome

    async def _dispatch_ahead(self) -> None:
        limit = min(PROMPTS, (self.step + 1 + AHEAD) * GROUPS_PER_STEP)
        while self.rl.next_prompt < limit:
            prompt = self.rl.next_prompt
            group = f"p{prompt:03d}"
            async with self.barrier.mutation() as cut:
                self.rl.ledger.reserve_group(
                    cut, group_id=group, prompt_id=str(prompt),
                    prompt_payload=prompt_payload(prompt), expected_generations=GENERATIONS,
                    target_step=prompt // GROUPS_PER_STEP + 1,
                    start_weight_version=self.step, restore_level=level_of(prompt))
                self.rl.next_prompt += 1
            for gen in range(GENERATIONS):
                await self._dispatch(group, gen)

    async def _dispatch(self, group: str, gen: int) -> None:
        """Dispatch a reserved sibling: its restored session if a restore continued it
        (back on its owner), else a fresh one on the replica the prompt maps to."""
        prompt = int(group[1:])
        attempt = self.rl.ledger.get_group(group).siblings[gen].current_attempt
        replica = attempt.gym_instance_id or REPLICAS[(prompt + gen) % len(REPLICAS)]
        async with self.barrier.mutation() as cut:
            self.rl.ledger.mark_group_dispatched(cut, group, generation_indices=[gen],
                                                 gym_instance_id=replica)
        ep = EnvironmentEpisode(*self.rl.ledger.get_group(group).gym_episode(gen))
        client = self.clients[replica]
        if ep.attempt == 0:
            await client.open(ep, b"")
        task = asyncio.create_task(self._rollout(group, gen, replica, ep))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _rollout(self, group: str, gen: int, replica: str, ep: EnvironmentEpisode
                       ) -> None:
        prompt = int(group[1:])
        client = self.clients[replica]
        done = len((await client.get(ep)).turns)
        step = prompt // GROUPS_PER_STEP + 1  # the trainer step that trains it
        for turn_index in range(done, turns_of(prompt)):
            # Off-policy by at most one step, as async GRPO bounds it: the second half of
            # a rollout waits for the step before its own (so at every trainer
            # checkpoint, the rollouts two steps ahead are mid-way).
            while turn_index >= turns_of(prompt) // 2 and self.step < step - 1:
                await asyncio.sleep(0.01)
            async with client.turn(ep) as turn:
                token = next_token(turn.state, prompt, gen, turn_index)
                key = f"{ep.capture_key}/t{turn_index}"
                async with self.barrier.mutation() as cut:
                    self.rl.staging.put(cut, key, token)
                turn.complete(token, token, [key])
            self.turns += 1
            await asyncio.sleep(self.rng.uniform(0.0, 0.01))
        record = await client.close(ep)
        keys = sorted(record.staging_keys, key=row_turn)
        async with self.barrier.mutation() as cut:
            gate = self.rl.ledger.get_group(group).gate_rollout_id(gen)
            self.rl.ledger.mark_sibling_sealed(
                cut, group, generation_index=gen, gate_rollout_id=gate,
                receipt={"rollout_id": gate,
                         "manifest": [{"staging_key": k} for k in keys]},
                reward=1.0, mask_sample=False)
            # The group's last sibling: published for training, it leaves the ledger;
            # its rows stay staged until the train step.
            if self.rl.ledger.get_group(group).status is PromptGroupStatus.READY_TO_FINALIZE:
                publish_group(cut, self.rl.ledger, self.rl.published, group)

    async def _wait_for_step(self, step: int) -> None:
        groups = [f"p{p:03d}" for p in range((step - 1) * GROUPS_PER_STEP,
                                             step * GROUPS_PER_STEP)]
        while not all(g in self.rl.published.groups for g in groups):
            await self.manager.maybe_snapshot()
            await asyncio.sleep(0.02)

    async def _train(self, step: int) -> None:
        for prompt in range((step - 1) * GROUPS_PER_STEP, step * GROUPS_PER_STEP):
            group = f"p{prompt:03d}"
            async with self.barrier.mutation() as cut:
                rows = self.rl.published.take(cut, group)
                for generation_index, keys in enumerate(rows):
                    tokens = [self.rl.staging.rows[k].hex() for k in keys]
                    self.weights = hashlib.sha256(
                        self.weights + "".join(tokens).encode()).digest()
                    self.trained.append((group, generation_index, tokens))
                    self.rl.staging.clear(cut, keys)
        self.step = step

    async def _trainer_checkpoint(self) -> None:
        await self.manager.snapshot_at_trainer_checkpoint(self.step)
        if self.crash_at == "between-snapshot-and-trainer-checkpoint" and self.step == 4:
            raise Crash("between the anchored snapshot and the trainer checkpoint")
        self._write_trainer()
        await self.manager.trainer_checkpoint_saved(self.step)

    def _write_trainer(self) -> str:
        folder = RlFiles(self.root / "trainer")
        name = f"step-{self.step:04d}.json"
        folder.write_json(name, {"step": self.step, "weights": self.weights.hex(),
                                 "trained": self.trained})
        return folder.describe(name)

    async def _preempted(self) -> None:
        """Told to stop between two trainer checkpoints (``manager.preemption()`` runs
        this final snapshot on SIGTERM): the trainer's checkpoint is saved inside it, and
        anchors it, so the restart restores trainer and rollouts in step."""

        async def save_trainer(within_s: float) -> TrainerCheckpoint:
            return TrainerCheckpoint(self.step, self._write_trainer())

        running = list(self.tasks)  # their turns meet the stop (JobStoppedError)
        final = await self.manager.final_snapshot(20.0, save_trainer_checkpoint=save_trainer)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)  # as the job goes
        raise Crash(f"preempted at trainer step {self.step}: the final snapshot "
                    f"{Path(final.path).name} anchored to trainer step {final.anchor_step}")

    async def _restore(self) -> tuple[str | None, int]:
        """The newest trainer checkpoint, and the rollout snapshot anchored to it."""
        saved = [json.loads(p.read_text()) for p in (self.root / "trainer").glob("*.json")]
        newest = max(saved, key=lambda s: s["step"])
        self.step = newest["step"]
        self.weights = bytes.fromhex(newest["weights"])
        self.trained[:] = [(g, i, list(t)) for g, i, t in newest["trained"]]
        chosen = await self.manager.restore(trainer_step=self.step)
        assert chosen is not None
        continued = 0
        for record in self.rl.ledger.groups():
            if record.status is not PromptGroupStatus.GENERATING:
                continue
            if any(s.current_attempt.status in (RolloutAttemptStatus.ABANDONED,
                                                RolloutAttemptStatus.FAILED)
                   for s in record.siblings):
                async with self.barrier.mutation() as cut:
                    record = self.rl.ledger.prepare_incomplete_retry(cut, record.group_id)
            for sibling in record.siblings:
                attempt = sibling.current_attempt
                if attempt.status is RolloutAttemptStatus.RESERVED:
                    continued += attempt.gym_attempt > 0
                    await self._dispatch(record.group_id, sibling.generation_index)
        return chosen.path, continued


async def run_life(root: Path, namespace: str, seed: int, crash_at: str | None,
                   restore: bool, trained: list[tuple[str, int, list[str]]]) -> Outcome:
    life = Life(root, namespace, seed, crash_at, trained)
    try:
        await life.start()
        return await life.run(restore)
    finally:
        await life.ray_ckpt.shutdown(wait=True)  # the crash: every actor of the job goes


async def run_reference(root: Path, seed: int, namespace: str) -> Outcome:
    """The crash-free run (its outcome does not depend on the seed: the policy's turns
    are pure functions, and only timing is seeded). Needs ``ray.init`` done."""
    clean = root / "clean"
    clean.mkdir(parents=True)
    return await run_life(clean, f"{namespace}-ref", seed + 2, None, False, [])


async def run_grpo(root: Path, crash_at: str, seed: int, namespace: str,
                   reference: Outcome | None = None) -> dict[str, Any]:
    """A crashed run, restarted, against a crash-free one (``reference``, or run here);
    their verdict. Needs ``ray.init`` done."""
    crashed = root / "crashed"
    crashed.mkdir(parents=True)
    trained: list[tuple[str, int, list[str]]] = []
    crash = None
    try:
        await run_life(crashed, namespace, seed, crash_at, False, trained)
    except Crash as exc:
        crash = str(exc)
    if crash is None:
        raise RuntimeError(f"the crash {crash_at!r} never came")
    after = await run_life(crashed, namespace, seed + 1, None, True, [])  # the restart
    if reference is None:
        reference = await run_reference(root, seed, namespace)
    once = sorted((g, i) for g, i, _ in after.trained)
    expected = sorted((f"p{p:03d}", i) for p in range(PROMPTS) for i in range(GENERATIONS))
    verified = (after.weights == reference.weights and after.trained == reference.trained
                and once == expected)
    return {"crash_at": crash_at, "crash": crash, "restored_from": after.restored_from,
            "continued_rollouts": after.continued, "weights": after.weights,
            "reference_weights": reference.weights, "verified": verified}


def start_own_ray() -> None:
    """This process's own Ray instance (2 CPUs), even where another runs on this machine
    or ``RAY_ADDRESS`` names one: ``ray.init(num_cpus=...)`` would join that one and
    refuse the CPU count."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crash-at", choices=(*CRASH_POINTS, "random", "all"),
                        default="all")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    points = list(CRASH_POINTS) if args.crash_at == "all" else [
        random.Random(args.seed).choice(CRASH_POINTS) if args.crash_at == "random"
        else args.crash_at]
    import ray

    logging.basicConfig(level=logging.WARNING)
    start_own_ray()
    work = Path(tempfile.mkdtemp(prefix="grpo-recovery-"))
    failed = 0
    try:
        for k, point in enumerate(points):
            report = asyncio.run(run_grpo(work / point, point, args.seed, f"grpo-{k}"))
            print(f"crash {report['crash_at']} ({report['crash']}): restored from "
                  f"{Path(report['restored_from']).name}, {report['continued_rollouts']} "
                  f"rollout(s) continued from their saved turns; "
                  f"{'VERIFIED' if report['verified'] else 'DIFFERENT'} against the "
                  f"crash-free run (weights {report['weights'][:12]})")
            failed += not report["verified"]
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
