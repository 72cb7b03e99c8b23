"""NeMo Gym's own sandboxes on our provider (``nemo_ckpt.integrations.nemo_gym``),
against the real NeMo Gym 0.7.0 package (``make install`` installs it) on the session's
Ray cluster: a Gym ``AsyncSandbox`` whose rollout's turns write files, a snapshot, a crash
(every holder killed, the sandbox's directory gone with its node's disk), a restore, and
Gym's handle on the restored sandbox. NeMo Gym is imported only in the worker processes
of ``tests/integrations/gym_worker.py``: its import changes ``sys.path``, ``print`` and
``HF_HOME``, which must not reach this process."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import tomllib

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt.integrations.nemo_gym import PROVIDER_NAME, sandbox_descriptor

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
GROUP = "nemo_gym.sandbox_providers"
ROLLOUT = "gym-r0"


def run_worker(phase: str, args: dict[str, Any], cwd: Path,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """``tests/integrations/gym_worker.py``'s ``phase`` in a process of its own (with
    ``env`` added to this one's; this checkout first on its path, so Gym's entry points,
    which the installed package declares, load this checkout's providers): what it
    printed as its result."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.gym_worker", phase, json.dumps(args)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


async def _crash_and_restore(address: str, config: CheckpointConfig, tmp: Path
                             ) -> dict[str, Any]:
    path = tmp / "ckpt" / "step-1"
    ckpt = RayEnvironmentCheckpoint(config)
    try:
        await ckpt.ensure_holders()
        instance = sorted(h.instance_id for h in await ckpt.holders())[1]
        args = {"address": address, "namespace": config.namespace, "rollout_id": ROLLOUT,
                "sandbox_root": str(config.sandbox_root), "instance_id": instance}
        before = await asyncio.to_thread(run_worker, "start", args, tmp)
        async with ckpt.snapshot(path):
            pass
    finally:
        ckpt.shutdown()  # the crash: every holder killed, the worker long gone
    shutil.rmtree(before["directory"])  # its node's disk went with it
    fresh = RayEnvironmentCheckpoint(config)
    try:
        async with fresh.restored(path) as restored:
            continued = set(restored.continued_attempts)
        after = await asyncio.to_thread(
            run_worker, "resume", {**args, "old_descriptor": before["descriptor"]}, tmp)
    finally:
        fresh.shutdown()
    return {"before": before, "after": after, "continued": continued,
            "instance": instance}


@pytest.fixture(scope="module")
def gym(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The whole run, once for the module's tests: what each worker saw."""
    tmp = tmp_path_factory.mktemp("gym")
    (tmp / "sandboxes").mkdir()
    config = CheckpointConfig(allow_unchecked_snapshots=True,
                              namespace=f"t-{uuid.uuid4().hex[:10]}",
                              checkpoint_root=tmp / "ckpt", sandbox_root=tmp / "sandboxes",
                              drain_timeout_s=1.0, lease_s=6.0, phase_timeout_s=10.0,
                              persist_timeout_s=30.0)
    run = asyncio.run(_crash_and_restore(cluster.address, config, tmp))
    run["sandbox_root"] = tmp / "sandboxes"
    return run


def test_a_gym_sandbox_comes_back_after_a_crash_with_what_its_committed_turns_wrote(
        gym: dict[str, Any]) -> None:
    before, after = gym["before"], gym["after"]
    committed = {"./README.md": "the task\n", "./log.txt": "turn-0\nturn-1\n",
                 "./src/main.py": "v2\n"}
    # Written after the last turn's commit: in the sandbox then, not in the snapshot.
    assert before["files"] == {**committed, "./after.txt": "not-committed\n"}
    assert gym["continued"] == {(gym["instance"], ROLLOUT, 0)}
    assert after["files"] == committed
    assert after["downloaded"] == "v2\n"  # Gym's download, through our provider
    assert (after["turns"], after["state"]) == (2, "s2")
    assert after["directory"] == str(gym["sandbox_root"] / f"{ROLLOUT}-a1")
    assert before["directory"] == str(gym["sandbox_root"] / ROLLOUT)


def test_gyms_handle_reaches_the_restored_sandbox_under_its_new_name_and_runs_its_turns(
        gym: dict[str, Any]) -> None:
    before, after, instance = gym["before"], gym["after"], gym["instance"]
    assert before["descriptor"] == {**sandbox_descriptor(Ep(ROLLOUT, 0), instance),
                                    "workdir": None}
    assert after["descriptor"] == {**sandbox_descriptor(Ep(ROLLOUT, 1), instance),
                                   "workdir": None}
    assert after["log_after_turn"] == "turn-0\nturn-1\nturn-2\n"
    kind, message = after["old_descriptor"]  # the attempt the crash ended
    assert kind == "SessionNotFoundError"
    assert f"{ROLLOUT} is not live on {instance}: its rollout continues as attempt 1" \
        in message and "sandbox_descriptor(" in message


def test_the_provider_is_selected_by_name_through_gyms_registry_and_declares_files_only(
        gym: dict[str, Any]) -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert declared["project"]["entry-points"][GROUP] == {
        PROVIDER_NAME: "nemo_ckpt.integrations.nemo_gym:NemoCkptLocalProvider",
        "nemo_ckpt_docker": "nemo_ckpt.integrations.nemo_gym_docker:NemoCkptDockerProvider"}
    before = gym["before"]
    assert before["nemo_ckpt_from"] == str(ROOT)  # this checkout's code, not another
    assert before["listed"] and before["class_by_name"]
    assert before["connectable"] and before["pause_resume"]
    assert before["recovery"] == "files_only"  # its files, never its processes' memory
    kind, message = before["without_rollout"]
    assert kind == "SandboxError"
    assert "names no rollout attempt" in message and "sandbox_metadata(episode)" in message


def test_what_would_leave_the_captured_directory_is_refused_in_one_line(
        gym: dict[str, Any]) -> None:
    before, after = gym["before"], gym["after"]
    kind, message = before["with_workdir"]
    assert kind == "SandboxError" and "SandboxSpec.workdir (/tmp) is not supported" in message
    # Refused before anything was made: the same rollout's sandbox was made next.
    assert before["directory"] == str(gym["sandbox_root"] / ROLLOUT)
    refused = after["refused"]
    for what in ("cwd", "upload"):
        kind, message = refused[what]
        assert kind == "SandboxError" and "only its directory is captured" in message, what
    assert not (gym["sandbox_root"] / "escaped.py").exists()
    kind, message = refused["foreign"]
    assert kind == "SandboxError" and "was not made by nemo_ckpt_local" in message
    kind, message = refused["attempt"]
    assert kind == "SandboxError" and "names no rollout attempt" in message
    assert "attempt=True" in message and "sandbox_descriptor(episode, instance_id)" in message
    kind, message = refused["instance"]
    assert kind == "SandboxError" and "instance_id must be a string, not 7" in message
    kind, message = before["without_root"]
    assert kind == "SandboxError" and "give sandbox_root" in message


def test_a_paused_sandbox_says_so_and_refuses_commands_until_resumed(
        gym: dict[str, Any]) -> None:
    after = gym["after"]
    assert (after["running"], after["paused"], after["resumed"]) == (
        "running", "paused", "running")
    kind, message = after["exec_while_paused"]
    assert kind == "SandboxError" and "it is paused; resume() it first" in message
    assert "while-paused" not in after["log_after_turn"]


def test_closing_an_already_closed_sandbox_is_a_no_op(gym: dict[str, Any]) -> None:
    after = gym["after"]
    assert after["directory_after_stop"] is False  # the first close removed it
    assert after["provider_closes"] == ["ok", "ok", "ok"]
    assert after["status_after_close"] == ["stopped", "stopped"]


def test_importing_the_integration_imports_no_part_of_nemo_gym(tmp_path: Path) -> None:
    code = ("import sys, nemo_ckpt, nemo_ckpt.integrations.nemo_gym as m, "
            "nemo_ckpt.integrations.nemo_gym_docker as d; "
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'nemo_gym'), "
            "m.NemoCkptLocalProvider.recovery.value, d.NemoCkptDockerProvider.recovery.value)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[]", "files_only", "snapshot_with_memory"]
