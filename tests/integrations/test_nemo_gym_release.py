"""Every sandbox NeMo Gym makes through our provider (``nemo_ckpt.integrations.nemo_gym``)
is removed exactly once, whatever happens: a create whose open's answer was lost, a
rollout RL retires or drops, a job killed mid-rollout and restored. Against the real
NeMo Gym 0.7.0 in worker processes of their own (``tests/integrations/gym_worker.py``),
on the session's Ray cluster."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt.sandboxes.provided import ProvidedSandboxes
from tests.integrations.test_nemo_gym_local import ROOT, run_worker

pytestmark = pytest.mark.timeout(300)


def on_disk(root: Path) -> list[str]:
    """The sandboxes under ``root`` (nemo-ckpt's own folder aside)."""
    return sorted(p.name for p in root.iterdir() if p.name != ".nemo-ckpt")


def start_killable(args: dict[str, Any], cwd: Path
                   ) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """The ``kill-start`` worker, running mid-rollout once it printed ``READY``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integrations.gym_worker", "kill-start",
         json.dumps(args)], cwd=cwd, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # the test's timeout bounds this
        if line.startswith("READY "):
            made: dict[str, str] = json.loads(line.removeprefix("READY "))
            return proc, made
    proc.wait(timeout=30)
    raise AssertionError(f"the worker exited ({proc.returncode}) before it was ready")


async def _run(address: str, config: CheckpointConfig, tmp: Path) -> dict[str, Any]:
    root = Path(str(config.sandbox_root))
    path = tmp / "ckpt" / "step-1"
    seen: dict[str, Any] = {}
    ckpt = RayEnvironmentCheckpoint(config)
    try:
        await ckpt.ensure_holders()
        instances = sorted(h.instance_id for h in await ckpt.holders())
        args = {"address": address, "namespace": config.namespace,
                "sandbox_root": str(root), "instance_id": instances[0],
                "instances": instances}
        seen["lost"] = await asyncio.to_thread(run_worker, "lost", args, tmp)
        proc, made = await asyncio.to_thread(start_killable, args, tmp)
        try:
            seen["made"] = made
            seen["before_rl"] = on_disk(root)
            await ckpt.acknowledge([Ep(f"k-{i}-done", 0) for i in instances])
            await ckpt.forget([Ep(f"k-{i}-dropped", 0) for i in instances])
            seen["after_rl"] = on_disk(root)
            async with ckpt.snapshot(path) as snap:
                seen["restarting"] = sorted(ep.rollout_id for eps in
                                            snap.restarting().values() for ep in eps)
        finally:
            proc.kill()  # the crash: the worker mid-turn, then every holder
            proc.wait(timeout=30)
    finally:
        await ckpt.shutdown(wait=True)
    seen["after_crash"] = on_disk(root)
    fresh = RayEnvironmentCheckpoint(config)
    try:
        holders = await fresh.ensure_holders()
        seen["removed_at_start"] = sum(h.sandboxes_removed_at_start for h in holders)
        seen["after_start"] = on_disk(root)
        async with fresh.restored(path) as restored:
            continued = sorted((rollout, instance)
                               for instance, rollout, _ in restored.continued_attempts)
        seen["continued"] = continued
        seen["after_restore"] = on_disk(root)
        # Gym reconnects to all but the last holder's; RL then drops every one.
        seen["resumed"] = await asyncio.to_thread(
            run_worker, "kill-resume", {**args, "continued": continued[:-1]}, tmp)
        await fresh.forget([Ep(rollout, 1) for rollout, _ in continued])  # RL drops them
        seen["after_forget"] = on_disk(root)
        seen["marked"] = [m for i in instances for m in ProvidedSandboxes(
            root, config.namespace, i).marked()]
    finally:
        await fresh.shutdown(wait=True)
    seen["instances"] = instances
    return seen


@pytest.fixture(scope="module")
def run(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("gym-release")
    (tmp / "sandboxes").mkdir()
    config = CheckpointConfig(allow_unchecked_snapshots=True,
                              namespace=f"t-{uuid.uuid4().hex[:10]}",
                              checkpoint_root=tmp / "ckpt", sandbox_root=tmp / "sandboxes",
                              drain_timeout_s=1.0, lease_s=6.0, phase_timeout_s=10.0,
                              persist_timeout_s=30.0)
    return asyncio.run(_run(cluster.address, config, tmp))


def test_a_create_whose_answer_was_lost_keeps_its_sandbox_and_a_retry_adopts_it(
        run: dict[str, Any]) -> None:
    lost = run["lost"]
    assert lost["answer_lost"] == {"same": True, "kept": "kept\n",
                                   "session_directory": lost["answer_lost"][
                                       "session_directory"]}
    assert lost["answer_lost"]["session_directory"].endswith("/sandboxes/lost-answer")
    # The open never reached the holder: asked, it says so, and the directory went.
    assert lost["never_arrived"] == ["BackendUnavailableError",
                                     "the call never reached the holder"]
    assert lost["never_arrived_left"] is False
    # Neither the answer nor the holder: nothing is guessed, the directory stays...
    kind, message = lost["unknown"]
    assert kind == "SandboxError"
    assert "the session of unknown may or may not have opened" in message
    assert "for a retried create to adopt, or for the holder's next start to remove" \
        in message
    assert lost["unknown_left"] is True
    # ...and the retried create, told it had not opened, made it anew.
    assert lost["unknown_retried"] == ""  # empty: nothing of the failed create's
    assert lost["left"] == [] and lost["marked"] == []  # each closed once, twice = no-op


def test_rl_retiring_or_dropping_a_rollout_removes_its_sandbox(run: dict[str, Any]) -> None:
    instances = run["instances"]
    every = sorted(f"k-{i}-{kind}" for i in instances
                   for kind in ("idle", "done", "dropped", "mid"))
    assert run["before_rl"] == every
    assert run["after_rl"] == sorted(f"k-{i}-{kind}" for i in instances
                                     for kind in ("idle", "mid"))


def test_a_job_killed_mid_rollout_restores_or_removes_every_sandbox_and_leaks_none(
        run: dict[str, Any]) -> None:
    instances = run["instances"]
    assert len(instances) >= 2  # sandboxes on every holder of a multi-node job
    assert run["restarting"] == sorted(f"k-{i}-mid" for i in instances)
    assert run["after_crash"] == sorted(f"k-{i}-{kind}" for i in instances
                                        for kind in ("idle", "mid"))
    # The next start removed the dead incarnation's sandboxes, and said how many.
    assert run["removed_at_start"] == 2 * len(instances)
    assert run["after_start"] == []
    assert run["continued"] == sorted((f"k-{i}-idle", i) for i in instances)
    assert run["after_restore"] == sorted(f"k-{i}-idle-a1" for i in instances)
    assert run["resumed"] == {f"k-{i}-idle": "turn-0\nturn-1\n" for i in instances[:-1]}
    # Removed as RL dropped them, reconnected to by Gym or not.
    assert run["after_forget"] == [] and run["marked"] == []
