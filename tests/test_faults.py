"""Faults and bad input on a real local multi-node cluster.

For every case: a clear error of its own class (or success where survivable), no holder
left paused or restoring, the previously committed snapshot still restorable and
unchanged, and no acknowledged turn lost from the live sessions that survive.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient, SessionRecord
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.errors import (
    BackendUnavailableError,
    CheckpointPathError,
    ManifestInvalidError,
    ShardCorruptedError,
    SnapshotNotFoundError,
    SnapshotReadError,
    SnapshotWriteError,
    StateTooLargeError,
    TornSnapshotError,
    UnsafeShardNameError,
    UnsupportedFormatVersionError,
)
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage import environment_dir, read_manifest, read_snapshot, snapshot_rollouts
from nemo_ckpt.testing import StaticCut
from tests.conftest import alive_node_ids, remove_node_and_wait

pytestmark = pytest.mark.timeout(120)

INSTANCES = ("holder-0", "holder-1", "holder-2")


# --- helpers ---------------------------------------------------------------------------


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 15.0,
                     what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


def holder(ckpt: RayEnvironmentCheckpoint, instance: str) -> Any:
    return ray.get_actor(HOLDER_NAME_PREFIX + instance, namespace=ckpt.config.namespace)


async def client(ckpt: RayEnvironmentCheckpoint, instance: str) -> SessionClient:
    return await SessionClient.connect(instance, namespace=ckpt.config.namespace)


async def populate(ckpt: RayEnvironmentCheckpoint, instances: tuple[str, ...] = INSTANCES,
                   state: bytes = b"s") -> dict[str, list[Ep]]:
    """Two rollouts per instance, two committed turns each."""
    live: dict[str, list[Ep]] = {}
    for inst in instances:
        c = await client(ckpt, inst)
        live[inst] = [Ep(f"{inst}-r{k}", 0) for k in range(2)]
        for ep in live[inst]:
            await c.open(ep, state)
            for t in range(2):
                async with c.turn(ep) as turn:
                    turn.complete(f"t{t}".encode(), state, [f"{ep.capture_key}/row{t}"])
    return live


def cut_of(live: dict[str, list[Ep]]) -> StaticCut:
    rows = {f"{ep.capture_key}/row{t}" for eps in live.values() for ep in eps for t in range(2)}
    return StaticCut({i: set(eps) for i, eps in live.items()}, rows)


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


async def sessions_of(ckpt: RayEnvironmentCheckpoint, instances: Any
                      ) -> dict[str, list[SessionRecord]]:
    return {i: await (await client(ckpt, i)).sessions() for i in instances}


async def all_running(ckpt: RayEnvironmentCheckpoint) -> bool:
    return all(h.state is HolderState.RUNNING for h in await ckpt.holders())


async def assert_recovered(ckpt: RayEnvironmentCheckpoint, path: Path, baseline: dict[str, bytes],
                           survivors: dict[str, list[SessionRecord]]) -> None:
    """No holder paused; the committed snapshot unchanged; survivors kept every turn."""
    await wait_until(lambda: all_running(ckpt), 15, "every holder running")
    env = environment_dir(path)
    try:
        await wait_until(lambda: _async(tree(env) == baseline), 15, "partial files removed")
    except AssertionError:
        raise AssertionError(
            f"files now {sorted(tree(env))}, committed {sorted(baseline)}") from None
    read_snapshot(path)  # still restorable
    assert await sessions_of(ckpt, survivors) == survivors
    for inst, records in survivors.items():  # and they keep running turns
        if not records:
            continue
        c = await client(ckpt, inst)
        ep = records[0].episode
        async with c.turn(ep) as turn:
            turn.complete(b"after", b"s", [])


async def commit_baseline(ckpt: RayEnvironmentCheckpoint, path: Path) -> dict[str, bytes]:
    """Commit a snapshot at ``path`` and return its files, to compare after a fault."""
    async with ckpt.snapshot(path):
        pass
    return tree(environment_dir(path))


async def _async(value: bool) -> bool:
    return value


async def snapshot_in_background(ckpt: RayEnvironmentCheckpoint, path: Path
                                 ) -> asyncio.Future[None]:
    async def run() -> None:
        async with ckpt.snapshot(path):
            pass
    return asyncio.ensure_future(run())


# --- actor and node faults ---------------------------------------------------------------


@pytest.mark.parametrize("phase", ["pause", "capture", "persist", "finish_persist"])
async def test_a_holder_killed_in_a_snapshot_phase_fails_it_cleanly(
    ckpt: Any, tmp_path: Path, phase: str
) -> None:
    live = await populate(ckpt)
    path = tmp_path / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    await holder(ckpt, "holder-1").inject_delay.remote(phase, 30)
    task = await snapshot_in_background(ckpt, path)
    await asyncio.sleep(1.5)
    assert not task.done()
    ray.kill(holder(ckpt, "holder-1"))
    with pytest.raises(BackendUnavailableError, match="holder-1") as err:
        await asyncio.wait_for(task, 30)
    assert ckpt.is_unavailable(err.value)
    survivors = await sessions_of(ckpt, ["holder-0", "holder-2"])
    await assert_recovered(ckpt, path, baseline, survivors)

    # The next snapshot works; the lost instance's rollouts are reported, not dropped.
    async with ckpt.snapshot(tmp_path / "next") as snap:
        await snap.check_against_cut(cut_of(live))
    lost = {("holder-1", ep) for ep in live["holder-1"]}
    assert snap.check_result.not_held == lost
    assert snap.metrics(0)["not_held_rollouts"] == 2


async def test_a_holder_killed_during_restore_leaves_nothing_and_the_snapshot_restores_later(
    ckpt: Any, tmp_path: Path
) -> None:
    await populate(ckpt)
    path = tmp_path / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    expected = {(i, f"{i}-r{k}", 0) for i in INSTANCES for k in range(2)}
    ckpt.shutdown()  # a new job restores

    fresh = RayEnvironmentCheckpoint(ckpt.config)
    try:
        await fresh.ensure_holders()
        await holder(fresh, "holder-1").inject_delay.remote("prepare_restore", 30)

        async def restore() -> None:
            async with fresh.restored(path):
                pass

        task = asyncio.ensure_future(restore())
        await asyncio.sleep(1.5)
        ray.kill(holder(fresh, "holder-1"))
        with pytest.raises(BackendUnavailableError, match="holder-1"):
            await asyncio.wait_for(task, 30)
        holders = await fresh.holders()
        assert {(h.instance_id, h.state, h.sessions) for h in holders} == {
            ("holder-0", HolderState.RUNNING, 0), ("holder-2", HolderState.RUNNING, 0)}
        assert tree(environment_dir(path)) == baseline
        async with fresh.restored(path) as restored:
            assert restored.continued_attempts == expected
        assert sorted(h.sessions for h in await fresh.holders()) == [2, 2, 2]
    finally:
        fresh.shutdown()


@pytest.fixture
def extra_node(cluster: Any) -> Iterator[Any]:
    """A worker node added for this test and removed (if still there) afterwards."""
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield node
    finally:
        if node in cluster.worker_nodes:
            remove_node_and_wait(cluster, node)


async def instance_on(ckpt: RayEnvironmentCheckpoint, node_id: str) -> str:
    (inst,) = [h.instance_id for h in await ckpt.ensure_holders() if h.node_id == node_id]
    return inst


async def test_a_node_removed_during_a_snapshot_fails_it_and_the_next_reports_the_loss(
    ckpt: Any, cluster: Any, extra_node: Any, tmp_path: Path
) -> None:
    victim = await instance_on(ckpt, extra_node.node_id)
    live = await populate(ckpt, (*INSTANCES, victim))
    path = tmp_path / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    await holder(ckpt, victim).inject_delay.remote("capture", 30)
    task = await snapshot_in_background(ckpt, path)
    await asyncio.sleep(1.5)
    cluster.remove_node(extra_node, allow_graceful=False)
    with pytest.raises(BackendUnavailableError, match=victim) as err:
        await asyncio.wait_for(task, 40)
    assert ckpt.is_unavailable(err.value)
    survivors = await sessions_of(ckpt, INSTANCES)
    await assert_recovered(ckpt, path, baseline, survivors)

    await wait_until(lambda: _async(extra_node.node_id not in alive_node_ids()), 20,
                     "the node to be declared dead")
    await ckpt.check_startup()  # every alive node still has its holder
    async with ckpt.snapshot(tmp_path / "next") as snap:
        await snap.check_against_cut(cut_of(live))
    assert snap.check_result.not_held == {(victim, ep) for ep in live[victim]}


async def test_a_node_removed_between_snapshots_is_reported_and_a_new_node_gets_a_holder(
    ckpt: Any, cluster: Any, extra_node: Any, tmp_path: Path
) -> None:
    victim = await instance_on(ckpt, extra_node.node_id)
    live = await populate(ckpt, ("holder-0", victim))
    async with ckpt.snapshot(tmp_path / "before") as snap:
        await snap.check_against_cut(cut_of(live))
    cluster.remove_node(extra_node, allow_graceful=False)
    await wait_until(lambda: _async(extra_node.node_id not in alive_node_ids()), 20,
                     "the node to be declared dead")
    await ckpt.check_startup()
    async with ckpt.snapshot(tmp_path / "after") as snap:
        await snap.check_against_cut(cut_of(live))
    assert snap.check_result.not_held == {(victim, ep) for ep in live[victim]}
    after = tmp_path / "after"
    assert {r.instance_id for r in snapshot_rollouts(after, read_manifest(after))[0]} == {
        "holder-0"}

    replacement = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        await ckpt.check_startup()
        assert replacement.node_id in {h.node_id for h in await ckpt.holders()}
    finally:
        remove_node_and_wait(cluster, replacement)


async def test_a_coordinator_killed_mid_snapshot_is_retriable_and_a_new_one_takes_over(
    ckpt: Any, tmp_path: Path
) -> None:
    await populate(ckpt)
    path = tmp_path / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    survivors = await sessions_of(ckpt, INSTANCES)
    with pytest.raises(BackendUnavailableError, match="coordinator") as err:
        async with ckpt.snapshot(path):
            ray.kill(ray.get_actor(ckpt.config.coordinator_name,
                                   namespace=ckpt.config.namespace))
            await asyncio.sleep(0.5)
    assert ckpt.is_unavailable(err.value)
    await assert_recovered(ckpt, path, baseline, survivors)
    async with ckpt.snapshot(tmp_path / "next") as snap:
        assert snap is not None and snap.captured_rollouts == 6


async def test_a_driver_that_dies_inside_the_snapshot_leaves_holders_resuming_by_lease(
    ckpt: Any, cluster: Any, tmp_path: Path
) -> None:
    await populate(ckpt)
    survivors = await sessions_of(ckpt, INSTANCES)
    path = tmp_path / "ckpt"
    script = f"""
import asyncio, os, ray
from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
ray.init(address={cluster.address!r}, log_to_driver=False)
config = CheckpointConfig.model_validate_json({ckpt.config.model_dump_json()!r})
async def main():
    async with RayEnvironmentCheckpoint(config).snapshot({str(path)!r}):
        print("inside", flush=True)
        os._exit(3)  # killed: no exit handler, no abort, no more lease renewals
asyncio.run(main())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 3 and "inside" in proc.stdout, proc.stderr[-2000:]
    paused = {h.state for h in await ckpt.holders()}
    assert paused == {HolderState.PAUSED}, "the holders should wait for their lease"
    await wait_until(lambda: all_running(ckpt), ckpt.config.lease_s + 5, "lease expiry")
    assert not (environment_dir(path) / "manifest.json").exists()
    assert await sessions_of(ckpt, INSTANCES) == survivors
    async with ckpt.snapshot(tmp_path / "next") as snap:
        assert snap is not None and snap.captured_rollouts == 6


# --- storage faults -------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Mount a small tmpfs (needs root, as on this project's machines and CI)."""
    mounted: list[Path] = []

    def mount(size: str = "4m") -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(point)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


async def test_a_read_only_checkpoint_folder_is_a_write_error_and_keeps_the_old_snapshot(
    ckpt: Any, tmpfs: Callable[..., Path]
) -> None:
    await populate(ckpt)
    path = tmpfs() / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    survivors = await sessions_of(ckpt, INSTANCES)
    subprocess.run(["mount", "-o", "remount,ro", str(path.parent)], check=True)
    with pytest.raises(SnapshotWriteError, match="read-only") as err:
        async with ckpt.snapshot(path):
            pass
    assert not ckpt.is_unavailable(err.value)
    await assert_recovered(ckpt, path, baseline, survivors)


async def test_a_full_disk_is_a_write_error_and_leaves_no_partial_files(
    ckpt: Any, tmpfs: Callable[..., Path]
) -> None:
    await populate(ckpt, ("holder-0",))
    path = tmpfs("1m") / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    c = await client(ckpt, "holder-1")
    for k in range(4):  # 4 x 400 KiB does not fit in what is left of 1 MiB
        await c.open(Ep(f"big{k}", 0), os.urandom(400 << 10))
    survivors = await sessions_of(ckpt, INSTANCES)
    with pytest.raises(SnapshotWriteError, match="filesystem is full") as err:
        async with ckpt.snapshot(path):
            pass
    assert not ckpt.is_unavailable(err.value)
    await assert_recovered(ckpt, path, baseline, survivors)


async def test_a_folder_removed_mid_write_is_a_write_error(ckpt: Any, tmp_path: Path) -> None:
    await populate(ckpt)
    committed = tmp_path / "committed"
    baseline = await commit_baseline(ckpt, committed)
    survivors = await sessions_of(ckpt, INSTANCES)
    await holder(ckpt, "holder-0").inject_delay.remote("persist", 1.0)
    doomed = tmp_path / "doomed"
    with pytest.raises(SnapshotWriteError, match="disappeared") as err:
        async with ckpt.snapshot(doomed):
            shutil.rmtree(doomed)
    assert not ckpt.is_unavailable(err.value)
    await assert_recovered(ckpt, committed, baseline, survivors)


async def test_a_persist_past_its_deadline_is_unavailable_and_cleans_up(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    ckpt = RayEnvironmentCheckpoint(CheckpointConfig(
        namespace=namespace, drain_timeout_s=0.5, lease_s=4, persist_timeout_s=1.0))
    try:
        await ckpt.ensure_holders()
        await populate(ckpt)
        path = tmp_path / "ckpt"
        async with ckpt.snapshot(path):
            pass
        baseline = tree(environment_dir(path))
        survivors = await sessions_of(ckpt, INSTANCES)
        await holder(ckpt, "holder-2").inject_delay.remote("persist", 3.0)
        with pytest.raises(BackendUnavailableError, match="within 1.0s") as err:
            async with ckpt.snapshot(path):
                pass
        assert ckpt.is_unavailable(err.value)
        await asyncio.sleep(3.0)  # the slow write finishes, then removes its own file
        await assert_recovered(ckpt, path, baseline, survivors)
    finally:
        ckpt.shutdown()


# --- bad input -------------------------------------------------------------------------------


def _flip(path: Path) -> None:
    shard = next(environment_dir(path).glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _edit_manifest(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    m = environment_dir(path) / "manifest.json"
    data = json.loads(m.read_text())
    edit(data)
    m.write_text(json.dumps(data))


def _escape(d: dict[str, Any]) -> None:
    old = d["shards"][0]["file"]
    d["shards"][0]["file"] = "../../outside.msgpack"
    for r in d.get("rollouts", []):
        if r["shard"] == old:
            r["shard"] = "../../outside.msgpack"


BAD_SNAPSHOTS: dict[str, tuple[Callable[[Path], Any], type[SnapshotReadError], str]] = {
    "no-snapshot": (lambda p: shutil.rmtree(p), SnapshotNotFoundError, "no environment snapshot"),
    "torn": (lambda p: next(environment_dir(p).glob("shard-*")).unlink(), TornSnapshotError,
             "torn"),
    "corrupt-shard": (_flip, ShardCorruptedError, "xxh3-128"),
    "future-version": (lambda p: _edit_manifest(p, lambda d: d.update(format_version=7)),
                       UnsupportedFormatVersionError, "format version 7"),
    "garbage-manifest": (lambda p: (environment_dir(p) / "manifest.json").write_bytes(b"\x00{"),
                         ManifestInvalidError, "not valid JSON"),
    "escaping-name": (lambda p: _edit_manifest(p, _escape), UnsafeShardNameError,
                      "not a plain file name"),
    "path-is-a-file": (lambda p: (shutil.rmtree(p), p.write_text("x")), CheckpointPathError,
                       "is a file"),
}


@pytest.mark.parametrize("case", sorted(BAD_SNAPSHOTS))
async def test_a_bad_snapshot_is_refused_and_no_holder_changes(
    ckpt: Any, tmp_path: Path, case: str
) -> None:
    await populate(ckpt, ("holder-0",))
    path = tmp_path / "ckpt"
    async with ckpt.snapshot(path):
        pass
    ckpt.shutdown()
    damage, error, needle = BAD_SNAPSHOTS[case]
    damage(path)
    fresh = RayEnvironmentCheckpoint(ckpt.config)
    try:
        await fresh.ensure_holders()
        with pytest.raises(error, match=needle) as err:
            async with fresh.restored(path):
                pytest.fail("the restore block ran on a bad snapshot")
        assert str(path) in str(err.value)
        assert not fresh.is_unavailable(err.value)
        assert {(h.state, h.sessions) for h in await fresh.holders()} == {
            (HolderState.RUNNING, 0)}
    finally:
        fresh.shutdown()


async def test_invalid_input_from_environment_workers_is_refused(
    cluster: Any, namespace: str
) -> None:
    ckpt = RayEnvironmentCheckpoint(CheckpointConfig(namespace=namespace, max_state_bytes=1024))
    try:
        await ckpt.ensure_holders()
        c = await client(ckpt, "holder-0")
        with pytest.raises(ValueError, match="rollout_id must not be empty"):
            Ep("", 0)
        with pytest.raises(TypeError, match="expected an EnvironmentEpisode"):
            await c.open(("r", 0), b"")  # type: ignore[arg-type]
        with pytest.raises(StateTooLargeError, match="2048 bytes, over the limit of 1024"):
            await c.open(Ep("big", 0), b"x" * 2048)
        await c.open(Ep("ok", 0), b"")
        with pytest.raises(StateTooLargeError):
            async with c.turn(Ep("ok", 0)) as turn:
                turn.complete(b"r", b"y" * 4096, [])
        assert (await c.get(Ep("ok", 0))).turns == ()
        with pytest.raises(TypeError, match="must be bytes"):
            async with c.turn(Ep("ok", 0)) as turn:
                turn.complete(b"r", "not bytes", [])  # type: ignore[arg-type]
    finally:
        ckpt.shutdown()
