"""Sandboxes a provider made for a holder's sessions (NeMo Gym's, marked through
``nemo_ckpt.sandboxes.provided``) are removed exactly once: with their session when RL
retires or forgets its rollout or its worker closes it, and, after a crash, by the next
holder of the instance as it starts, which says how many. A holder driven directly (no
Ray), on virtual time."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from actors.holder.actor import SessionHolder
from nemo_ckpt.driver.startup import Findings, holder_findings
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.sandboxes.provided import ProvidedSandboxes
from nemo_ckpt.testing.data_plane import StaticCut
from tests.sandboxes.test_sandbox_sessions import sandbox_job
from tests.virtual_time import on_virtual_time, virtual_runtime

pytestmark = pytest.mark.timeout(30)
NS, INSTANCE = "job", "holder-0"


class Gauges:
    """A holder's metrics, keeping each gauge's last value."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def observe(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        del name, value, tags

    def inc(self, name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        del name, value, tags

    def set_gauge(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        assert tags == {"instance": INSTANCE}
        self.values[name] = value


def holder(root: Path, gauges: Gauges | None = None) -> SessionHolder:
    runtime = virtual_runtime()
    if gauges is not None:
        runtime = dataclasses.replace(runtime, metrics=gauges)
    return SessionHolder(INSTANCE, node_id="node-a", runtime=runtime, sandbox_root=str(root),
                         namespace=NS)


def provided(root: Path, rollout: str) -> Path:
    """A directory made as the provider makes one: marked first."""
    directory = root / rollout
    ProvidedSandboxes(root, NS, INSTANCE).mark(Ep(rollout, 0).capture_key,
                                               directory=directory)
    directory.mkdir()
    (directory / "work.txt").write_text(rollout)
    return directory


def left(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != ".nemo-ckpt")


@on_virtual_time
async def test_a_provided_sandbox_goes_with_its_session_when_retired_forgotten_or_closed(
        tmp_path: Path) -> None:
    h = holder(tmp_path)
    for rollout in ("retired", "forgotten", "closed"):
        await h.open_session(Ep(rollout, 0), b"", str(provided(tmp_path, rollout)))
    (tmp_path / "users").mkdir()  # a worker's own directory: never the holder's to remove
    await h.open_session(Ep("users", 0), b"", str(tmp_path / "users"))
    assert left(tmp_path) == ["closed", "forgotten", "retired", "users"]
    await h.finish_session(Ep("retired", 0), b"done")
    assert left(tmp_path) == ["closed", "forgotten", "retired", "users"]  # until RL has it
    assert await h.retire([Ep("retired", 0), Ep("users", 0)]) == ["retired", "users"]
    assert await h.forget([Ep("forgotten", 0)]) == ["forgotten"]
    await h.finish_session(Ep("closed", 0), b"done")
    await h.close_session("closed")
    assert left(tmp_path) == ["users"]
    assert ProvidedSandboxes(tmp_path, NS, INSTANCE).marked() == []
    # Released once: a second release (the provider's close after the holder's) is a
    # no-op, and a forget of an attempt no longer live changes nothing.
    assert await h.forget([Ep("forgotten", 0)]) == []
    assert left(tmp_path) == ["users"]


@on_virtual_time
async def test_a_new_holder_removes_the_sandboxes_its_dead_predecessor_made_and_says_how_many(
        tmp_path: Path) -> None:
    dead = holder(tmp_path)
    for rollout in ("a", "b"):
        await dead.open_session(Ep(rollout, 0), b"", str(provided(tmp_path, rollout)))
    (tmp_path / "kept").mkdir()
    marks = ProvidedSandboxes(tmp_path, NS, INSTANCE)
    # A hostile mark naming a directory outside sandbox_root's top level is not followed.
    (tmp_path / "kept" / "inner").mkdir()
    (marks.folder / "hostile").write_text(json.dumps({"directory": str(tmp_path / "kept"
                                                                       / "inner")}))
    (marks.folder / "junk").write_text("not json")
    # Another job's holder of the same instance name keeps its own.
    other = ProvidedSandboxes(tmp_path, "other-job", INSTANCE)
    other.mark("theirs", directory=tmp_path / "theirs")
    (tmp_path / "theirs").mkdir()
    # The crash: the holder's process dies with its sessions; a successor starts.
    successor = holder(tmp_path)
    info = await successor.info()
    assert info.sandboxes_removed_at_start == 2
    assert left(tmp_path) == ["kept", "theirs"]
    assert (tmp_path / "kept" / "inner").is_dir()
    assert marks.marked() == [] and other.marked() == ["theirs"]
    assert (await holder(tmp_path).info()).sandboxes_removed_at_start == 0  # once


@on_virtual_time
async def test_the_sandboxes_gauge_counts_the_live_sessions_sandboxes(tmp_path: Path) -> None:
    gauges = Gauges()
    h = holder(tmp_path, gauges)
    await h._publish_sessions(0.0)
    assert gauges.values == {"sessions": 0.0, "sandboxes": 0.0}
    for rollout in ("a", "b"):
        await h.open_session(Ep(rollout, 0), b"", str(provided(tmp_path, rollout)))
    await h.open_session(Ep("no-sandbox", 0), b"")
    await h._publish_sessions(0.0)
    assert gauges.values == {"sessions": 3.0, "sandboxes": 2.0}
    await h.forget([Ep("a", 0)])
    await h._publish_sessions(0.0)
    assert gauges.values == {"sessions": 2.0, "sandboxes": 1.0}


def test_a_stop_snapshot_removes_provided_sandboxes_and_a_restore_here_marks_the_new_ones(
        tmp_path: Path) -> None:
    job = sandbox_job(tmp_path)
    path = tmp_path / "ckpt" / "final"
    namespace = job.config.namespace
    try:
        async def run() -> dict[str, list[str]]:
            await job.ckpt.ensure_holders()
            live: dict[str, set[Ep]] = {}
            for instance in sorted(job.holders()):
                client = await job.client(instance)
                ep = Ep(f"{instance}-r", 0)
                directory = job.sandboxes / ep.capture_key
                ProvidedSandboxes(job.sandboxes, namespace, instance).mark(
                    ep.capture_key, directory=directory, rollout_id=ep.rollout_id)
                directory.mkdir()
                await client.open(ep, b"s0", directory=directory)
                async with client.turn(ep) as turn:
                    (directory / "a.txt").write_text(instance)
                    turn.complete(b"t0", b"s1")
                live[instance] = {ep}
            seen = {"before": left(job.sandboxes)}
            async with job.ckpt.final_snapshot(path) as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut(live, set()))
            seen["parked"] = left(job.sandboxes)
            async with job.ckpt.restored(path):
                pass
            seen["restored"] = left(job.sandboxes)
            for instance in sorted(job.holders()):
                await (await job.client(instance)).close(Ep(f"{instance}-r", 1))
            seen["closed"] = left(job.sandboxes)
            return seen

        seen = job.run(run())
    finally:
        job.close()
    instances = sorted(f"{i}-r" for i in job.holders())
    assert seen["before"] == instances
    assert seen["parked"] == []  # the stopped job's sandboxes: removed with the park
    assert seen["restored"] == [f"{r}-a1" for r in instances]
    assert seen["closed"] == []  # marked by the restore: released with the session


@on_virtual_time
async def test_check_startup_says_how_many_sandboxes_a_dead_incarnation_left(
        tmp_path: Path) -> None:
    await holder(tmp_path).open_session(Ep("a", 0), b"", str(provided(tmp_path, "a")))
    info = await holder(tmp_path).info()  # the successor, on the same node
    found = Findings()
    holder_findings(found, [info], {"node-a"})
    assert found.warnings == [
        f"{INSTANCE} removed 1 sandboxes an earlier holder of its instance left (its "
        f"sessions died with it; their rollouts continue from the last snapshot, or start "
        f"over)"]
