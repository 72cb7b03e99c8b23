"""The Gymnasium-style text-environment adapter (``nemo_ckpt.adapters``) on SkyRL-gym's
own environments (``gsm8k_multi_turn``, ``text2sql`` over a SQLite database the test
makes, ``rlm`` with its live REPL), on the real local Ray cluster: rollouts crashed
mid-rollout (holders and coordinator killed) and restored end exactly as a crash-free
run; a replay that diverges starts its rollout over with a warning and a count in the
next snapshot's metrics; an environment with the state export is rebuilt from its state."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import ray
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt import RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.adapters import AdaptedRollout, StepOutput, TurnRecord, trajectory_of
from nemo_ckpt.adapters.replay import compare
from nemo_ckpt.adapters.skyrl_gym import SkyRLGym
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.errors import EnvironmentAdapterError
from nemo_ckpt.testing.text_envs import (
    SQL_DB_ID,
    TextTask,
    gsm8k_task,
    make_sql_database,
    reference_outputs,
    rlm_task,
    sql_task,
)

pytestmark = pytest.mark.timeout(180)


async def clients_of(ckpt: RayEnvironmentCheckpoint) -> dict[str, SessionClient]:
    return {h.instance_id: await SessionClient.connect(h.instance_id,
                                                       namespace=ckpt.config.namespace)
            for h in await ckpt.holders()}


async def run_steps(rollout: AdaptedRollout, task: TextTask, until: int | None = None) -> None:
    """Step ``rollout`` with its task's policy until it is done or has ``until`` steps."""
    while not rollout.done and (until is None or len(rollout.records) - 1 < until):
        await rollout.step(task.policy(len(rollout.records)))


def plain_outputs(outputs: list[StepOutput]) -> list[dict[str, Any]]:
    return [o.as_plain() for o in outputs]


async def crash_and_restore(ckpt: RayEnvironmentCheckpoint, path: Path
                            ) -> tuple[RayEnvironmentCheckpoint, frozenset[tuple[str, str, int]]]:
    """Kill the job's holders and coordinator (a preemption), then restore ``path`` as a
    new job; the new job's checkpoint and the continued attempts."""
    for h in await ckpt.holders():
        ray.kill(ray.get_actor(HOLDER_NAME_PREFIX + h.instance_id,
                               namespace=ckpt.config.namespace), no_restart=True)
    ray.kill(ray.get_actor(ckpt.config.coordinator_name, namespace=ckpt.config.namespace),
             no_restart=True)
    fresh = RayEnvironmentCheckpoint(ckpt.config)
    await fresh.shutdown(wait=True)
    await fresh.ensure_holders()
    async with fresh.restored(path) as restored:
        continued = restored.continued_attempts
    return fresh, continued


async def test_skyrl_rollouts_crashed_mid_rollout_and_restored_equal_a_crash_free_run(
        ckpt: RayEnvironmentCheckpoint, tmp_path: Path) -> None:
    db_root = tmp_path / "sql"
    make_sql_database(db_root)
    tasks = {t.rollout_id: t for t in
             [gsm8k_task(f"gsm-{i}", seed=3, max_turns=6) for i in range(4)]
             + [sql_task(f"sql-{i}", seed=3, db_root=db_root, max_turns=6) for i in range(4)]
             + [rlm_task(f"rlm-{i}", seed=3) for i in range(3)]}
    clients = await clients_of(ckpt)
    instances = sorted(clients)
    placed = {r: instances[k % len(instances)] for k, r in enumerate(sorted(tasks))}
    rollouts = {}
    for r, task in tasks.items():
        rollouts[r] = await AdaptedRollout.start(clients[placed[r]], Ep(r, 0), task.framework,
                                                 task.prompt)
        await run_steps(rollouts[r], task, until=2)
    path = tmp_path / "ckpt" / "step-1"
    async with ckpt.snapshot(path):
        pass
    running = sorted(r for r, rollout in rollouts.items() if not rollout.done)
    assert len(running) >= 6, "the seeded policies end most rollouts after the snapshot"
    assert {r for r in running if r.startswith("rlm-")} == {"rlm-0", "rlm-1", "rlm-2"}
    for r in running:  # a turn more each: work the crash loses
        await rollouts[r].step(tasks[r].policy(len(rollouts[r].records)))
        rollouts[r].close()

    fresh, continued = await crash_and_restore(ckpt, path)
    try:
        assert {(i, r) for i, r, _ in continued} == {(placed[r], r) for r in tasks}
        clients = await clients_of(fresh)
        for instance, r, attempt in sorted(continued):
            task = tasks[r]
            rollout = await AdaptedRollout.resume(clients[instance],
                                                  Ep(r, attempt).next_attempt(), task.framework)
            assert rollout.rebuilt_by == "replay" and rollout.restarts == 0
            await run_steps(rollout, task)
            assert plain_outputs(rollout.outputs) == plain_outputs(reference_outputs(task)), r
            result = await rollout.finish()
            assert [rec.given for rec in trajectory_of(result)[1:]] == [
                task.policy(t) for t in range(1, len(rollout.records))]
    finally:
        fresh.shutdown()


async def test_a_replay_that_diverges_starts_the_rollout_over_with_a_warning_and_a_count(
        ckpt: RayEnvironmentCheckpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db_root = tmp_path / "sql"
    db = make_sql_database(db_root)
    task = sql_task("sql-drift", seed=5, db_root=db_root, max_turns=5)
    instance, client = sorted((await clients_of(ckpt)).items())[0]
    rollout = await AdaptedRollout.start(client, Ep(task.rollout_id, 0), task.framework,
                                         task.prompt)
    await run_steps(rollout, task, until=2)
    path = tmp_path / "ckpt" / "step-1"
    async with ckpt.snapshot(path):
        pass
    rollout.close()
    # A side effect outside the sandbox: the database changes under the rollout, so the
    # replayed queries see other rows than the model saw.
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO orders VALUES (1000, 50, 999)")

    fresh, continued = await crash_and_restore(ckpt, path)
    try:
        ((_, rid, attempt),) = continued
        client = (await clients_of(fresh))[instance]
        with caplog.at_level(logging.WARNING, logger="nemo_ckpt.adapters"):
            resumed = await AdaptedRollout.resume(client, Ep(rid, attempt).next_attempt(),
                                                  task.framework)
        warned = [r.getMessage() for r in caplog.records if r.name == "nemo_ckpt.adapters"]
        assert len(warned) == 1 and "sql-drift-a1" in warned[0] and "starts over" in warned[0]
        assert "observations" in warned[0]
        assert resumed.rebuilt_by == "restarted" and resumed.restarts == 1
        assert len(resumed.records) == 1 and resumed.records[0].restarted is not None
        await run_steps(resumed, task)
        # The restarted trajectory is a fresh run over the database as it is now.
        assert plain_outputs(resumed.outputs) == plain_outputs(reference_outputs(task))
        session = await client.get(Ep(rid, attempt).next_attempt())
        assert len(session.turns) == 3 + len(resumed.records)  # the old turns are kept
        async with fresh.snapshot(tmp_path / "ckpt" / "step-2") as snap:
            assert snap is not None
            assert snap.metrics(0.0)["replay_restarted_rollouts"] == 1.0
    finally:
        fresh.shutdown()


class NonceCounterEnv(BaseTextEnv):
    """A text environment a replay cannot rebuild (its observations carry a nonce drawn
    at init) that offers the state export instead."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.max_turns = 4
        self.total = 0
        self.nonce = ""

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        self.nonce = os.urandom(8).hex()
        return [{"role": "user", "content": f"session {self.nonce}: count"}], {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        self.total += len(action)
        done = self.turns >= self.max_turns
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": f"{self.nonce}: {self.total}"}],
            reward=float(self.total), done=done, metadata={})

    def get_state(self) -> bytes:
        return json.dumps([self.turns, self.total, self.nonce]).encode()

    def set_state(self, data: bytes) -> None:
        self.turns, self.total, self.nonce = json.loads(data)


@pytest.fixture
def nonce_env() -> Any:
    skyrl_gym.register(id="nemo_ckpt_test_nonce_counter", entry_point=NonceCounterEnv)
    try:
        yield SkyRLGym("nemo_ckpt_test_nonce_counter")
    finally:
        skyrl_gym.envs.deregister("nemo_ckpt_test_nonce_counter")


async def test_an_environment_with_the_state_export_is_rebuilt_from_its_state(
        ckpt: RayEnvironmentCheckpoint, tmp_path: Path, nonce_env: SkyRLGym) -> None:
    instance, client = sorted((await clients_of(ckpt)).items())[0]
    rollout = await AdaptedRollout.start(client, Ep("count", 0), nonce_env,
                                         [{"role": "user", "content": "go"}])
    for action in ("a", "bb"):
        await rollout.step(action)
    path = tmp_path / "ckpt" / "step-1"
    async with ckpt.snapshot(path):
        pass
    before = plain_outputs(rollout.outputs)
    rollout.close()

    fresh, continued = await crash_and_restore(ckpt, path)
    try:
        ((_, rid, attempt),) = continued
        client = (await clients_of(fresh))[instance]
        resumed = await AdaptedRollout.resume(client, Ep(rid, attempt).next_attempt(),
                                              nonce_env)
        assert resumed.rebuilt_by == "state" and resumed.restarts == 0
        assert plain_outputs(resumed.outputs) == before
        nonce = before[0]["observations"][0]["content"].split()[1].rstrip(":")
        out = await resumed.step("ccc")
        assert out.observations == [{"role": "user", "content": f"{nonce}: 6"}]
        assert out.reward == 6.0
    finally:
        fresh.shutdown()


async def test_a_step_after_the_episode_is_done_is_refused_with_what_to_do(
        ckpt: RayEnvironmentCheckpoint) -> None:
    task = gsm8k_task("gsm-done", seed=1, max_turns=2)
    client = next(iter((await clients_of(ckpt)).values()))
    rollout = await AdaptedRollout.start(client, Ep(task.rollout_id, 0), task.framework,
                                         task.prompt)
    await run_steps(rollout, task)
    with pytest.raises(EnvironmentAdapterError, match="finish it with AdaptedRollout.finish"):
        await rollout.step("one more")
    assert len((await client.get(Ep(task.rollout_id, 0))).turns) == len(rollout.records)


def test_the_sql_database_the_tests_make_is_where_text2sql_looks(tmp_path: Path) -> None:
    db = make_sql_database(tmp_path)
    assert db == tmp_path / "spider" / "database" / SQL_DB_ID / f"{SQL_DB_ID}.sqlite"
    outputs = reference_outputs(sql_task("s", seed=0, db_root=tmp_path))
    assert "Error" not in json.dumps([o.as_plain() for o in outputs])




@pytest.mark.timeout(150)
def test_the_example_crashes_mid_run_restores_and_verifies_every_rollout(cluster: Any) -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "adapter_recovery.py"),
         "--address", cluster.address, "--rollouts", "8", "--seed", "2"],
        capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "VERIFIED: 8 rollouts of gsm8k_multi_turn, text2sql and rlm" in proc.stdout
    assert "2 start over" in proc.stdout and "NOT VERIFIED" not in proc.stdout


async def test_a_step_whose_turn_did_not_commit_is_not_applied_twice(
        ckpt: RayEnvironmentCheckpoint) -> None:
    task = gsm8k_task("gsm-abort", seed=4, max_turns=6)
    client = next(iter((await clients_of(ckpt)).values()))
    rollout = await AdaptedRollout.start(client, Ep(task.rollout_id, 0), task.framework,
                                         task.prompt)
    await rollout.step(task.policy(1))

    async def failing_staging(turn: int) -> list[str]:
        raise RuntimeError("RL's data plane refused the row")

    # The environment steps, then the turn aborts: the session has no such turn.
    with pytest.raises(RuntimeError, match="refused the row"):
        await rollout.step(task.policy(2), failing_staging)
    assert len((await client.get(Ep(task.rollout_id, 0))).turns) == 2
    await run_steps(rollout, task)
    assert rollout.rebuilt_by == "replay"  # rebuilt from the session before the step
    assert plain_outputs(rollout.outputs) == plain_outputs(reference_outputs(task))


async def test_a_staging_argument_of_the_wrong_type_is_a_type_error_saying_what_it_takes(
        ckpt: RayEnvironmentCheckpoint) -> None:
    task = gsm8k_task("gsm-staging", seed=4, max_turns=6)
    client = next(iter((await clients_of(ckpt)).values()))
    ep = Ep(task.rollout_id, 0)
    with pytest.raises(TypeError, match=r"staging must be an async function of the turn's "
                                        r"index .* or None; got list"):
        await AdaptedRollout.start(client, ep, task.framework, task.prompt,
                                   staging=["row"])  # type: ignore[arg-type]
    assert [s.episode for s in await client.sessions()] == []  # refused before the open

    async def staging(turn: int) -> list[str]:
        return [f"{ep.capture_key}/row{turn}"]

    rollout = await AdaptedRollout.start(client, ep, task.framework, task.prompt,
                                         staging=staging)
    with pytest.raises(TypeError, match=r"staging\(1\) returned list, not an awaitable: "
                                        r"make it an async function"):
        await rollout.step(task.policy(1), lambda turn: [f"row{turn}"])  # type: ignore

    async def one_key(turn: int) -> str:
        return f"row{turn}"

    with pytest.raises(TypeError, match="must be a collection of strings, not one str"):
        await rollout.step(task.policy(1), one_key)  # type: ignore[arg-type]
    assert len((await client.get(ep)).turns) == 1  # neither wrong step committed
    await rollout.step(task.policy(1), staging)
    session = await client.get(ep)
    assert len(session.turns) == 2
    assert session.staging_keys == {f"{ep.capture_key}/row0", f"{ep.capture_key}/row1"}


async def test_resuming_a_session_the_adapter_did_not_write_is_refused_naming_it(
        ckpt: RayEnvironmentCheckpoint) -> None:
    task = gsm8k_task("gsm-foreign", seed=4)
    client = next(iter((await clients_of(ckpt)).values()))
    foreign, empty = Ep("hand-written", 0), Ep("never-initialized", 0)
    await client.open(foreign, state=b"s0")
    async with client.turn(foreign) as turn:
        turn.complete(b'{"turn": 0}', b"s1")
    await client.open(empty)
    with pytest.raises(EnvironmentAdapterError, match="turn 0 of hand-written"):
        await AdaptedRollout.resume(client, foreign, task.framework)
    with pytest.raises(EnvironmentAdapterError, match="pass prompt="):
        await AdaptedRollout.resume(client, empty, task.framework)
    resumed = await AdaptedRollout.resume(client, empty, task.framework, prompt=task.prompt)
    assert plain_outputs(resumed.outputs) == plain_outputs(reference_outputs(task)[:1])


def test_a_replay_compares_every_part_of_an_output_exactly_and_names_what_differs() -> None:
    recorded = TurnRecord.of("step", "a", StepOutput(
        [{"role": "user", "content": "x"}], float("nan"), False,
        {"metadata": {"n": 1}, "handle": object()}))
    same = StepOutput([{"content": "x", "role": "user"}], float("nan"), False,
                      {"handle": object(), "metadata": {"n": 1}})
    assert compare(recorded, same, 3) is None  # NaN equals itself; an object, its type
    other = StepOutput([{"role": "user", "content": "x"}], 0.5, False, {
        "metadata": {"n": 2}, "handle": object()})
    divergence = compare(recorded, other, 3)
    assert divergence is not None
    assert (divergence.turn, divergence.fields) == (3, ("reward", "extra"))
    assert "recorded 'nan', replayed 0.5" in divergence.detail
    assert compare(recorded, StepOutput([], float("nan"), True, same.extra), 3).fields == (
        "observations", "done")


def test_the_adapters_import_without_skyrl_gym_and_say_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['skyrl_gym'] = None\n"
        "import nemo_ckpt, nemo_ckpt.adapters\n"
        "from nemo_ckpt.adapters.skyrl_gym import SkyRLGym\n"
        "from nemo_ckpt.errors import EnvironmentAdapterError\n"
        "try:\n"
        "    SkyRLGym('gsm8k_multi_turn').make(None)\n"
        "except EnvironmentAdapterError as exc:\n"
        "    print('refused:', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "refused: SkyRL-gym is not installed here" in proc.stdout
    assert "pip install 'nemo-ckpt[skyrl]'" in proc.stdout


class NotebookEnv(BaseTextEnv):
    """A text environment that keeps its notes in the rollout's sandbox directory (so a
    replay would write them twice) and offers the state export for the rest."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.notes = Path((extras or {})["directory"]) / "notes.txt"
        self.max_turns = 4

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        return [{"role": "user", "content": "write notes"}], {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        with open(self.notes, "a") as f:
            f.write(action + "\n")
        lines = self.notes.read_text().splitlines()
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": f"{len(lines)} notes: {lines}"}],
            reward=0.0, done=self.turns >= self.max_turns, metadata={})

    def get_state(self) -> bytes:
        return str(self.turns).encode()

    def set_state(self, data: bytes) -> None:
        self.turns = int(data)


def test_a_rollout_with_a_sandbox_directory_continues_in_its_restored_copy(
        tmp_path: Path) -> None:
    from nemo_ckpt.config import CheckpointConfig
    from nemo_ckpt.testing.data_plane import StaticCut
    from tests.harness import World

    skyrl_gym.register(id="nemo_ckpt_test_notebook", entry_point=NotebookEnv)
    made: list[Path | None] = []

    def configure(directory: Path | None) -> tuple[Any, dict[str, Any]]:
        made.append(directory)
        return None, {"directory": str(directory)}

    framework = SkyRLGym("nemo_ckpt_test_notebook", configure=configure)
    config = CheckpointConfig(namespace="job", drain_timeout_s=1.0, lease_s=6.0,
                              phase_timeout_s=3.0, persist_timeout_s=15.0,
                              turn_timeout_s=20.0, checkpoint_root=tmp_path / "ckpt",
                              sandbox_root=tmp_path / "sandboxes")
    path = tmp_path / "ckpt" / "step-1"
    sandboxes = tmp_path / "sandboxes"
    episode = Ep("notes", 0)
    job = World(tmp_path, nodes=1, config=config)
    try:
        async def first_life() -> None:
            await job.ckpt.ensure_holders()
            client = await job.client("holder-0")
            sandbox = sandboxes / "work" / "notes"
            sandbox.mkdir(parents=True)
            rollout = await AdaptedRollout.start(client, episode, framework,
                                                 [{"role": "user", "content": "go"}],
                                                 directory=sandbox)
            for action in ("first", "second"):
                await rollout.step(action)
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut({"holder-0": {episode}}, set()))
            await rollout.step("lost in the crash")

        job.run(first_life())
    finally:
        job.close()
        skyrl_gym.envs.deregister("nemo_ckpt_test_notebook")
    skyrl_gym.register(id="nemo_ckpt_test_notebook", entry_point=NotebookEnv)
    fresh = World(tmp_path, nodes=1, config=config, seed=1)
    try:
        async def second_life() -> tuple[AdaptedRollout, StepOutput, Path]:
            async with fresh.ckpt.restored(path):
                pass
            client = await fresh.client("holder-0")
            continued = episode.next_attempt()
            resumed = await AdaptedRollout.resume(client, continued, framework)
            out = await resumed.step("third")
            return resumed, out, sandboxes / continued.capture_key

        resumed, out, restored_dir = fresh.run(second_life())
    finally:
        fresh.close()
        skyrl_gym.envs.deregister("nemo_ckpt_test_notebook")
    assert resumed.rebuilt_by == "state" and made[-1] == restored_dir
    assert (restored_dir / "notes.txt").read_text() == "first\nsecond\nthird\n"
    assert out.observations == [
        {"role": "user", "content": "3 notes: ['first', 'second', 'third']"}]


def test_a_rollout_snapshotted_before_its_init_turn_committed_resumes_without_a_prompt(
        tmp_path: Path) -> None:
    """A snapshot that pauses the holder after ``start`` opened a session and before its
    init turn began captures the session with no turns; the continued attempt resumes
    with the README's call, no ``prompt=``: ``init`` runs afresh (issue 56, case 1)."""
    import asyncio

    from nemo_ckpt.testing.data_plane import StaticCut
    from tests.harness import World

    task = gsm8k_task("gsm-window", seed=5)
    episode = Ep("gsm-window", 0)
    path = tmp_path / "ckpt" / "step-1"
    job = World(tmp_path, nodes=1)
    # The init turn's begin travels slowly: the snapshot's pause reaches the holder first.
    job.sim.message_delay = lambda target, method, reply: \
        2.0 if method == "begin_turn" and not reply else 0.001
    try:
        async def first_life() -> int:
            await job.ckpt.ensure_holders()
            client = await job.client("holder-0")
            starting = asyncio.ensure_future(AdaptedRollout.start(
                client, episode, task.framework, task.prompt))
            await asyncio.sleep(0.5)  # opened; its init turn's begin on its way
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None and snap.restarted_rollouts == 0
                await snap.check_against_cut(StaticCut({"holder-0": {episode}}, set()))
            rollout = await starting
            await run_steps(rollout, task, until=1)  # lost in the crash
            return len(rollout.records)

        assert job.run(first_life()) == 2
    finally:
        job.close()
    fresh = World(tmp_path, nodes=1, seed=1)
    try:
        async def second_life() -> tuple[int, AdaptedRollout]:
            async with fresh.ckpt.restored(path) as restored:
                continued = restored.continued_attempts
            assert continued == frozenset({("holder-0", "gsm-window", 0)})
            client = await fresh.client("holder-0")
            captured = await client.get(episode.next_attempt())
            resumed = await AdaptedRollout.resume(client, episode.next_attempt(),
                                                  task.framework)
            await run_steps(resumed, task)
            return len(captured.turns), resumed

        captured_turns, resumed = fresh.run(second_life())
    finally:
        fresh.close()
    assert captured_turns == 0
    assert resumed.rebuilt_by == "fresh" and resumed.records[0].given == task.prompt
    assert plain_outputs(resumed.outputs) == plain_outputs(reference_outputs(task))
