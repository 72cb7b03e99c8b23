"""``make demo-containers``: the container demo, as the Makefile runs it (its own local
Ray instance, in a process of its own), with CRIU and without."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.container_runtime import ensure

ROOT = Path(__file__).resolve().parents[2]


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    setup = ensure()
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "container_recovery.py"),
         "--rollouts", "1", "--turns", "4", "--snapshot-at", "2", *args],
        capture_output=True, text=True, timeout=240, env={**os.environ, **setup.env})


@pytest.mark.timeout(300)
def test_the_container_demo_continues_each_containers_memory_and_files_verified() -> None:
    done = _demo()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "CRIU works here" in done.stdout
    assert "1 rollout(s) continued from their saved turn with their files and memory, " \
           "0 started over" in done.stdout
    assert "VERIFIED" in done.stdout


@pytest.mark.timeout(300)
def test_without_criu_the_demo_starts_restart_only_containers_over_and_still_verifies() -> None:
    done = _demo("--no-criu")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "no CRIU here" in done.stdout
    assert "0 rollout(s) continued from their saved turn with their files and memory, " \
           "1 started over (restart-only)" in done.stdout
    assert "VERIFIED" in done.stdout


def test_a_bad_demo_option_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "container_recovery.py"),
         "--snapshot-at", "9", "--turns", "5"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "need --rollouts >= 1 and 0 < --snapshot-at < --turns" in done.stderr
