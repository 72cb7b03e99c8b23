"""The GRPO-shaped example (``examples/grpo_recovery.py``) on the test cluster: a job
crashed at each named point restarts from its newest trainer checkpoint and the rollout
snapshot anchored to it, and ends equal to a crash-free run, every rollout trained once;
and its command line starts a Ray instance of its own beside another one."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.examples import load_example

ROOT = Path(__file__).resolve().parents[2]


EXAMPLE = load_example("grpo_recovery")


REFERENCE: list[Any] = []  # the crash-free run, made once for every crash point

# What a NeMo RL job may import of nemo-ckpt: the package's public names, the
# integration, the contract's types, and the double that stands in for NeMo RL here.
PUBLIC_MODULES = {"nemo_ckpt", "nemo_ckpt.integrations.nemo_rl", "nemo_ckpt.interfaces",
                  "nemo_ckpt.testing.nemo_rl"}


def test_the_example_keeps_rls_files_through_public_names_only() -> None:
    """A user copies the example's controller: it writes and reads RL's own files in a
    snapshot's path with ``RlFiles``, not nemo-ckpt's internal folders
    (``nemo_ckpt.storage``) or a base class's private helper (``_blocking``)."""
    tree = ast.parse((ROOT / "examples" / "grpo_recovery.py").read_text())
    imported = {node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module
                and node.module.split(".")[0] == "nemo_ckpt"}
    assert imported <= PUBLIC_MODULES, sorted(imported - PUBLIC_MODULES)
    inherited = sorted({node.attr for node in ast.walk(tree)
                        if isinstance(node, ast.Attribute) and node.attr == "_blocking"})
    assert inherited == []
    assert "RlFiles" in {alias.name for node in ast.walk(tree)
                         if isinstance(node, ast.ImportFrom) and node.module == "nemo_ckpt"
                         for alias in node.names}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("crash_at", EXAMPLE.CRASH_POINTS)
async def test_a_grpo_job_crashed_at_each_point_ends_like_the_crash_free_run(
        cluster: Any, tmp_path: Path, crash_at: str) -> None:
    if not REFERENCE:
        REFERENCE.append(await EXAMPLE.run_reference(tmp_path / "ref", 5, "t-grpo"))
    report = await EXAMPLE.run_grpo(tmp_path, crash_at, seed=5,
                                    namespace=f"t-grpo-{crash_at}", reference=REFERENCE[0])
    assert report["verified"], report
    assert report["weights"] == report["reference_weights"]
    # The restart continued turn-level rollouts from their saved turns, not from zero.
    assert report["continued_rollouts"] > 0
    restored = Path(report["restored_from"])
    assert restored.name.startswith("rollout-") and not restored.name.endswith(".partial")
    # Retention left no folder a committed snapshot does not own.
    crashed = tmp_path / "crashed"
    left = sorted(p.name for p in crashed.iterdir() if p.name.startswith("rollout-"))
    assert all((crashed / name / "environment" / "manifest.json").exists() for name in left)


@pytest.mark.timeout(150)
def test_the_example_starts_a_ray_of_its_own_where_another_runs(cluster: Any) -> None:
    """Case 17 of issue 50: ``ray.init(num_cpus=2)`` joined the Ray instance already
    running ("When connecting to an existing cluster, num_cpus and num_gpus must not be
    provided"). The test cluster runs, and ``RAY_ADDRESS`` names it, as inside a job."""
    script = textwrap.dedent(f"""
        import importlib.util
        import sys

        import ray
        spec = importlib.util.spec_from_file_location(
            "grpo_recovery", {str(ROOT / "examples" / "grpo_recovery.py")!r})
        example = sys.modules["grpo_recovery"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        example.start_own_ray()
        try:
            print("joined", ray.get_runtime_context().gcs_address)
            print("cpus", ray.cluster_resources().get("CPU"))
        finally:
            ray.shutdown()
    """)
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert said["joined"] != cluster.address and said["cpus"] == "2.0"
