"""``make demo-gym``: NeMo Gym's sandboxes on nemo-ckpt's providers, the job killed hard
and restored, as the Makefile runs it (each job life a process of its own with its own
Ray instance), on each provider: ``local`` and ``docker`` (podman, CRIU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.container_runtime import ensure

ROOT = Path(__file__).resolve().parents[2]


def _demo(provider: str) -> subprocess.CompletedProcess[str]:
    setup = ensure()
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gym_sandboxes.py"), "--provider", provider,
         "--rollouts", "1", "--turns", "3", "--snapshot-at", "1", "--timeout", "200"],
        capture_output=True, text=True, timeout=450, env={**os.environ, **setup.env})


@pytest.mark.timeout(500)
def test_the_gym_demo_restores_a_killed_jobs_local_sandboxes_verified() -> None:
    done = _demo("local")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "gym demo (local): killed the job after turn 2 of 3 (snapshot at turn 1); its " \
           "sandboxes declared ['files_only']" in done.stdout
    assert "1 rollout(s) continued from their saved turn through Gym's " \
           "AsyncSandbox.connect, 0 started over" in done.stdout
    assert "gym demo (local): VERIFIED" in done.stdout


@pytest.mark.timeout(500)
def test_the_gym_demo_restores_a_killed_jobs_docker_sandboxes_with_memory_verified() -> None:
    done = _demo("docker")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "its sandboxes declared ['snapshot_with_memory']" in done.stdout
    assert "1 rollout(s) continued from their saved turn through Gym's " \
           "AsyncSandbox.connect, 0 started over" in done.stdout
    assert "gym demo (docker): VERIFIED: every rollout's answers (from its server's " \
           "memory) and its sandbox's files equal a crash-free run's" in done.stdout


def test_a_bad_gym_demo_option_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gym_sandboxes.py"), "--snapshot-at", "4",
         "--turns", "4"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "need --rollouts >= 1 and 0 < --snapshot-at < --turns" in done.stderr
