"""NeMo Gym 0.7.0's ``docker`` sandboxes on this machine's podman, through the project's
``docker`` command (``tests/container_runtime.py`` writes it; it runs ``podman "$@"``):
Gym's own provider, then ours over it (``nemo_ckpt.integrations.nemo_gym_docker``) on the
session's Ray cluster: a sandbox whose shell keeps a counter in memory, a snapshot, a crash
(every holder killed, the container gone with its node), a restore, and Gym's handle on
the restored container, whose counter goes on. Gym is imported only in processes of their
own (its import changes ``sys.path``, ``print`` and ``HF_HOME``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.integrations.nemo_gym import sandbox_descriptor
from nemo_ckpt.integrations.nemo_gym_docker import DOCKER_PROVIDER_NAME as DOCKER
from nemo_ckpt.sandboxes.provided import provided_label
from tests.container_runtime import SHIM_DIR, Setup, docker_shim, ensure
from tests.integrations.test_nemo_gym_local import run_worker

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parents[2]
GYM_PREFIX = "nemo-gym-"  # Gym's docker provider names its containers so
ROLLOUT = "gym-c0"

# Gym's docker provider with its defaults, --init among them (podman's needs catatonit,
# which the runtime's setup installs).
SCRIPT = """
import asyncio, json, sys
from pathlib import Path
from nemo_gym.sandbox import AsyncSandbox, SandboxSpec

async def main():
    image, tmp = sys.argv[1], Path(sys.argv[2])
    config = {"docker": {}}
    spec = SandboxSpec(image=image, env={"GREETING": "hi"}, files={"/work/task.txt": "the task"})
    async with await AsyncSandbox(config, spec).start() as box:
        ran = await box.exec("echo $GREETING; cat /work/task.txt; echo made > /work/out.txt")
        await box.download("/work/out.txt", tmp / "out.txt")
        seen = {"stdout": ran.stdout, "code": ran.return_code,
                "downloaded": (tmp / "out.txt").read_text(), "name": box._handle.sandbox_id,
                "status": (await box.status()).value}
    seen["after_stop"] = (await box.status()).value
    sys.stdout.write("RESULT " + json.dumps(seen) + "\\n")

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def runtime() -> Iterator[Setup]:
    setup = ensure()
    yield setup
    podman = Podman(env=setup.env)
    left = podman.text("ps", "-a", "--filter", f"name=^{GYM_PREFIX}", "--format",
                       "{{.Names}}").split()
    assert left == [], f"Gym's containers left behind: {left}"


def test_the_projects_docker_command_runs_podman(runtime: Setup) -> None:
    shim = docker_shim()
    assert shim == SHIM_DIR / "docker" and os.access(shim, os.X_OK)
    assert shutil.which("docker", path=runtime.env["PATH"]) == str(shim)
    done = subprocess.run(["docker", "--version"], env={**os.environ, **runtime.env},
                          capture_output=True, text=True, timeout=60)
    podman = subprocess.run(["podman", "--version"], env={**os.environ, **runtime.env},
                            capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == podman.stdout
    assert done.stdout.startswith("podman version ")


def test_gyms_docker_provider_runs_a_sandbox_on_podman_and_removes_it(
        runtime: Setup, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, runtime.image, str(tmp_path)], cwd=tmp_path,
        env={**os.environ, **runtime.env, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    seen = json.loads(line.removeprefix("RESULT "))
    assert (seen["stdout"], seen["code"]) == ("hi\nthe task", 0)
    assert seen["downloaded"] == "made\n"
    assert (seen["status"], seen["after_stop"]) == ("running", "stopped")
    assert seen["name"].startswith(GYM_PREFIX)
    podman = Podman(env=runtime.env)
    assert podman.text("ps", "-a", "--filter", f"name=^{seen['name']}$", "--format",
                       "{{.Names}}") == ""  # Gym's close removed it


async def _crash_and_restore(address: str, config: CheckpointConfig, tmp: Path,
                             runtime: Setup) -> dict[str, Any]:
    path = tmp / "ckpt" / "step-1"
    podman = Podman(env=runtime.env)
    ckpt = RayEnvironmentCheckpoint(config)
    try:
        await ckpt.ensure_holders()
        instance = sorted(h.instance_id for h in await ckpt.holders())[0]
        args = {"address": address, "namespace": config.namespace, "rollout_id": ROLLOUT,
                "instance_id": instance, "image": runtime.image}
        before = await asyncio.to_thread(run_worker, "docker-start", args, tmp,
                                         runtime.env)
        async with ckpt.snapshot(path):
            pass
    finally:
        ckpt.shutdown()  # the crash: every holder killed, the worker long gone
    try:
        fresh = RayEnvironmentCheckpoint(config)
        try:
            # The dead incarnation's container: removed as its instance's next holder
            # starts, which says so.
            removed = sum(h.sandboxes_removed_at_start for h in await fresh.ensure_holders())
            old_left = podman.exists(before["container"])
            async with fresh.restored(path) as restored:
                continued = set(restored.continued_attempts)
            after = await asyncio.to_thread(run_worker, "docker-resume", args, tmp,
                                            runtime.env)
        finally:
            fresh.shutdown()
    finally:  # what the run left (nothing, when it passes), removed by name
        left = [name for prefix in (f"nemo-ckpt-{config.namespace}", before["container"])
                for name in podman.text("ps", "-a", "--filter", f"name=^{prefix}",
                                        "--format", "{{.Names}}").split()]
        for name in left:
            podman.remove(name)
    return {"before": before, "after": after, "continued": continued,
            "instance": instance, "left": left, "removed": removed, "old_left": old_left}


@pytest.fixture(scope="module")
def gym(cluster: Any, runtime: Setup, tmp_path_factory: pytest.TempPathFactory
        ) -> dict[str, Any]:
    """The whole run, once for the module's tests: what each worker saw."""
    tmp = tmp_path_factory.mktemp("gym-docker")
    (tmp / "sandboxes").mkdir()
    config = CheckpointConfig(allow_unchecked_snapshots=True,
                              namespace=f"t-{uuid.uuid4().hex[:10]}",
                              checkpoint_root=tmp / "ckpt", sandbox_root=tmp / "sandboxes",
                              containers=True, container_env=runtime.env,
                              drain_timeout_s=1.0, lease_s=6.0, phase_timeout_s=30.0,
                              persist_timeout_s=60.0)
    run = asyncio.run(_crash_and_restore(cluster.address, config, tmp, runtime))
    run["namespace"] = config.namespace
    return run


def test_a_gym_container_comes_back_running_with_its_memory_and_files_after_a_crash(
        gym: dict[str, Any]) -> None:
    before, after, instance = gym["before"], gym["after"], gym["instance"]
    assert before["counts"] == ["1", "2"]
    # A create repeated for the same attempt adopts its container, counter and all.
    assert before["retried"] == [before["container"], "3\n"]
    assert gym["continued"] == {(instance, ROLLOUT, 0)}
    assert after["container"] == f"nemo-ckpt-{gym['namespace']}-{ROLLOUT}-a1"
    assert after["count"] == "3"  # the counter went on from its memory (as committed)
    assert (gym["removed"], gym["old_left"]) == (1, False)  # the dead one's, removed
    assert after["log"] == "turn-0\nturn-1\n"
    # Gym's default --init: podman's init ran the sandbox, and runs the restored one.
    assert before["pid1"].startswith("/run/podman-init -- sh -c mkfifo")
    assert after["pid1"] == before["pid1"]
    assert before["descriptor"] == {**sandbox_descriptor(Ep(ROLLOUT, 0), instance, DOCKER),
                                    "workdir": None}
    assert after["descriptor"] == {**sandbox_descriptor(Ep(ROLLOUT, 1), instance, DOCKER),
                                   "workdir": None}


def test_the_docker_provider_declares_memory_and_refuses_what_a_restore_cannot_make(
        gym: dict[str, Any]) -> None:
    before = gym["before"]
    assert (before["declared"], before["recovery"]) == ("snapshot_with_memory",
                                                        "snapshot_with_memory")
    kind, message = before["with_volume"]
    assert kind == "SandboxError" and "provider_options['volumes'] is not supported" in message


def test_a_paused_gym_container_says_paused_and_a_second_close_is_a_no_op(
        gym: dict[str, Any]) -> None:
    after = gym["after"]
    assert (after["running"], after["paused"], after["resumed"]) == (
        "running", "paused", "running")
    kind, message = after["exec_while_paused"]
    assert kind == "SandboxError" and "it is paused; resume() it first" in message
    assert after["count_after_resume"] == "4"  # the refused command never reached it
    assert after["provider_closes"] == ["ok", "ok", "ok"]
    assert gym["left"] == []  # Gym's close removed the restored container


def test_a_labelled_container_its_provider_never_marked_is_removed_by_the_next_holder(
        runtime: Setup, tmp_path: Path) -> None:
    # The provider died between `docker run` and its mark: the container's label still
    # names its job and holder.
    from actors.holder.sandboxes import Sandboxes

    podman = Podman(env=runtime.env)
    name = f"{GYM_PREFIX}{uuid.uuid4().hex}"
    podman.run("run", "-d", "--name", name, "--label", provided_label("job", "holder-0"),
               runtime.image, "sleep", "600")
    other = f"{GYM_PREFIX}{uuid.uuid4().hex}"  # another job's, on the same node
    podman.run("run", "-d", "--name", other, "--label", provided_label("job2", "holder-0"),
               runtime.image, "sleep", "600")
    try:
        boxes = Sandboxes("holder-0", str(tmp_path), None, "job",
                          container_env=runtime.env)
        assert boxes.removed_at_start == 1
        assert (podman.exists(name), podman.exists(other)) == (False, True)
    finally:
        podman.remove(name)
        podman.remove(other)
