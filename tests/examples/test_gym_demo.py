"""``make demo-gym``: NeMo Gym's sandboxes on nemo-ckpt's providers, the job killed hard
and restored, as the Makefile runs it (each job life a process of its own with its own
Ray instance), with each provider's sandboxes in the same job: ``local`` and ``docker``
(podman, CRIU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.container_runtime import ensure

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(500)
def test_the_gym_demo_restores_a_killed_jobs_local_and_docker_sandboxes_verified() -> None:
    setup = ensure()
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gym_sandboxes.py"), "--provider", "both",
         "--rollouts", "1", "--turns", "2", "--snapshot-at", "1", "--timeout", "200"],
        capture_output=True, text=True, timeout=450, env={**os.environ, **setup.env})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for provider, declared in (("local", "files_only"), ("docker", "snapshot_with_memory")):
        assert f"gym demo ({provider}): killed the job after turn 2 of 2 (snapshot at turn " \
               f"1); its sandboxes declared ['{declared}']" in done.stdout
        assert f"gym demo ({provider}): restored; 1 rollout(s) continued from their saved " \
               f"turn through Gym's AsyncSandbox.connect, 0 started over" in done.stdout
    assert "gym demo (local): VERIFIED: every rollout's answers and its sandbox's files " \
           "equal a crash-free run's" in done.stdout
    assert "gym demo (docker): VERIFIED: every rollout's answers (from its server's " \
           "memory) and its sandbox's files equal a crash-free run's" in done.stdout


def test_a_bad_gym_demo_option_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gym_sandboxes.py"), "--snapshot-at", "4",
         "--turns", "4"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "need --rollouts >= 1 and 0 < --snapshot-at < --turns" in done.stderr
