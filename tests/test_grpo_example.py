"""The GRPO-shaped example (``examples/grpo_recovery.py``) on the test cluster: a job
crashed at each named point restarts from its newest trainer checkpoint and the rollout
snapshot anchored to it, and ends equal to a crash-free run, every rollout trained once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("grpo_recovery",
                                                  ROOT / "examples" / "grpo_recovery.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["grpo_recovery"] = module
    spec.loader.exec_module(module)
    return module


EXAMPLE = load_example()


REFERENCE: list[Any] = []  # the crash-free run, made once for every crash point


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
