"""NeMo Gym 0.7.0's own ``docker`` sandbox provider on this machine's podman, through the
project's ``docker`` command (``tests/container_runtime.py`` writes it; it runs
``podman "$@"``): what the provider that wraps Gym's ``docker`` one will stand on. Gym is
imported only in a process of its own (its import changes ``sys.path``, ``print`` and
``HF_HOME``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_ckpt.containers.podman import Podman
from tests.container_runtime import SHIM_DIR, Setup, docker_shim, ensure

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
GYM_PREFIX = "nemo-gym-"  # Gym's docker provider names its containers so

# Gym's docker provider with its defaults but --init: podman's --init needs catatonit,
# which Debian 12's podman does not ship (the wrapping provider's part of issue 53).
SCRIPT = """
import asyncio, json, sys
from pathlib import Path
from nemo_gym.sandbox import AsyncSandbox, SandboxSpec

async def main():
    image, tmp = sys.argv[1], Path(sys.argv[2])
    config = {"docker": {"create": {"use_init": False}}}
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
