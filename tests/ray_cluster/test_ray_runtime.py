"""The Ray runtime on a real local multi-node cluster: holders, snapshot, restore."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nemo_ckpt import (
    CheckpointConfig,
    RayEnvironmentCheckpoint,
    SessionClient,
)
from nemo_ckpt import (
    EnvironmentEpisode as Ep,
)
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.errors import (
    BackendUnavailableError,
    CaptureKeyCollisionError,
    LeaseExpiredError,
    RestoreConflictError,
    RetiredAttemptError,
    SnapshotInProgressError,
    SnapshotMismatchError,
    SnapshotNotFoundError,
    StartupCheckError,
    UncheckedSnapshotError,
)
from nemo_ckpt.phases import HolderState
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.storage.checkpoint_folder import environment_dir, prepare_environment_dir
from nemo_ckpt.storage.manifest import Manifest, RolloutEntry
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.shards import write_shard
from nemo_ckpt.storage.snapshot_files import (
    read_manifest,
    read_snapshot,
    snapshot_rollouts,
    write_manifest,
)
from nemo_ckpt.testing import StaticCut
from tests.conftest import alive_node_ids

pytestmark = pytest.mark.timeout(90)


async def client(ckpt: RayEnvironmentCheckpoint, instance: str) -> SessionClient:
    return await SessionClient.connect(instance, namespace=ckpt.config.namespace)


async def play(c: SessionClient, ep: Ep, turns: int, start_state: bytes = b"s0") -> None:
    """Open ``ep`` and run ``turns`` turns, each writing one staging row."""
    await c.open(ep, start_state)
    for t in range(turns):
        async with c.turn(ep) as turn:
            turn.complete(f"{ep.rollout_id}:t{t}".encode(), f"state{t + 1}".encode(),
                          [f"{ep.capture_key}/row{t}"])


async def states(ckpt: RayEnvironmentCheckpoint) -> dict[str, HolderState]:
    return {h.instance_id: h.state for h in await ckpt.holders()}


def expected_cut(live: dict[str, list[Ep]], rows: set[str]) -> StaticCut:
    return StaticCut({i: set(eps) for i, eps in live.items()}, rows)


# --- holders ---------------------------------------------------------------------------


async def test_one_holder_per_node_pinned_there_and_reserving_no_cpu(ckpt: Any) -> None:
    holders = await ckpt.holders()
    assert {h.node_id for h in holders} == alive_node_ids()
    assert sorted(h.instance_id for h in holders) == ["holder-0", "holder-1", "holder-2"]
    assert all(h.state is HolderState.RUNNING for h in holders)
    # Their creation took no CPU: every CPU of the cluster is still available.
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]


async def test_a_worker_connects_to_the_holder_on_its_own_node(ckpt: Any) -> None:
    ns = ckpt.config.namespace

    @ray.remote(num_cpus=0)
    class Worker:
        async def run(self) -> tuple[str, str, int]:
            c = await SessionClient.connect(namespace=ns)
            ep = Ep("w", 0)
            await c.open(ep, b"")
            async with c.turn(ep) as turn:
                turn.complete(b"t0", b"s1", ["w/0"])
            return c.instance_id, ray.get_runtime_context().get_node_id(), \
                len((await c.get(ep)).turns)

    holders = {h.node_id: h.instance_id for h in await ckpt.holders()}
    for node_id, instance in holders.items():
        w = Worker.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        got_instance, got_node, turns = await w.run.remote()
        assert (got_instance, got_node, turns) == (instance, node_id, 1)
        ray.kill(w)


async def test_a_turn_that_raises_records_nothing(ckpt: Any) -> None:
    c = await client(ckpt, "holder-0")
    ep = Ep("r", 0)
    await c.open(ep, b"s0")
    with pytest.raises(RuntimeError, match="tool failed"):
        async with c.turn(ep):
            raise RuntimeError("tool failed")
    with pytest.raises(ValueError, match="without turn.complete"):
        async with c.turn(ep):
            pass
    s = await c.get(ep)
    assert (s.turns, s.state, s.staging_keys) == ((), b"s0", frozenset())


async def test_colliding_capture_keys_are_refused_through_the_client(ckpt: Any) -> None:
    c = await client(ckpt, "holder-1")
    await c.open(Ep("r", 1))
    with pytest.raises(CaptureKeyCollisionError, match="capture key 'r-a1'"):
        await c.open(Ep("r-a1", 0))


# --- snapshot --------------------------------------------------------------------------


async def test_snapshot_commits_shards_and_manifest_equal_to_live_sessions(
    ckpt: Any, tmp_path: Path
) -> None:
    live = {"holder-0": [Ep("a", 0), Ep("b", 2)], "holder-2": [Ep("c", 0)]}
    rows: set[str] = set()
    for inst, eps in live.items():
        c = await client(ckpt, inst)
        for n, ep in enumerate(eps):
            await play(c, ep, n + 2)
            rows |= {f"{ep.capture_key}/row{t}" for t in range(n + 2)}
    path = tmp_path / "step-10"
    async with ckpt.snapshot(path) as snap:
        assert snap is not None
        assert set((await states(ckpt)).values()) == {HolderState.PAUSED}
        await snap.check_against_cut(expected_cut(live, rows | {"orphan"}))
    assert set((await states(ckpt)).values()) == {HolderState.RUNNING}

    loaded = read_snapshot(path)
    for inst in ("holder-0", "holder-1", "holder-2"):
        c = await client(ckpt, inst)
        assert loaded.sessions[inst] == await c.sessions()
    m = loaded.manifest
    assert m.instances == ["holder-0", "holder-1", "holder-2"]
    rollouts, _ = snapshot_rollouts(path, m)
    assert {(r.instance_id, r.rollout_id, r.attempt, r.turns) for r in rollouts} == {
        ("holder-0", "a", 0, 2), ("holder-0", "b", 2, 3), ("holder-2", "c", 0, 2)}
    metrics = snap.metrics(0.5)
    for key in ("paused_seconds", "drain_seconds", "capture_seconds", "persist_seconds",
                "bytes_written", "captured_rollouts", "restarted_rollouts", "holders"):
        assert key in metrics, key
    assert metrics["captured_rollouts"] == 3 and metrics["holders"] == 3
    assert metrics["bytes_written"] == sum(s.bytes for s in m.shards) > 0
    assert metrics["orphan_staging_rows"] == 1 and metrics["not_held_rollouts"] == 0
    assert m.metrics["bytes_written"] == metrics["bytes_written"]


async def test_an_empty_backend_yields_none_but_commits_an_empty_manifest(
    ckpt: Any, tmp_path: Path
) -> None:
    async with ckpt.snapshot(tmp_path / "empty") as snap:
        assert snap is None
    m = read_manifest(tmp_path / "empty")
    assert (m.rollouts, m.shards, m.restarted_rollouts) == ([], [], 0)
    async with ckpt.restored(tmp_path / "empty") as restored:
        assert restored.continued_attempts == frozenset()
    with pytest.raises(SnapshotNotFoundError):
        async with ckpt.restored(tmp_path / "never-written"):
            pass


async def test_new_turns_wait_while_the_snapshot_is_open(ckpt: Any, tmp_path: Path) -> None:
    c = await client(ckpt, "holder-0")
    ep = Ep("r", 0)
    await c.open(ep)

    async def one_turn() -> None:
        async with c.turn(ep) as turn:
            turn.complete(b"t", b"s", [])

    async with ckpt.snapshot(tmp_path / "s"):
        pending = asyncio.ensure_future(one_turn())
        await asyncio.sleep(0.5)
        assert not pending.done(), "a turn ran while the backend was paused"
    await asyncio.wait_for(pending, 10)
    assert len((await c.get(ep)).turns) == 1
    assert read_snapshot(tmp_path / "s").sessions["holder-0"][0].turns == ()


async def test_a_session_mid_turn_at_the_drain_deadline_restarts(ckpt: Any, tmp_path: Path) -> None:
    c = await client(ckpt, "holder-1")
    busy, idle = Ep("busy", 0), Ep("idle", 0)
    await c.open(busy)
    await c.open(idle)
    release = asyncio.Event()

    async def long_turn() -> None:
        async with c.turn(busy) as turn:
            await release.wait()
            turn.complete(b"t", b"s", [])

    task = asyncio.ensure_future(long_turn())
    await asyncio.sleep(0.3)
    async with ckpt.snapshot(tmp_path / "s") as snap:
        assert snap.restarted_rollouts == 1
        await snap.check_against_cut(expected_cut({"holder-1": [busy, idle]}, set()))
        release.set()
    await task
    m = read_manifest(tmp_path / "s")
    assert [r.rollout_id for r in snapshot_rollouts(tmp_path / "s", m)[0]] == ["idle"]
    assert m.restarted_rollouts == 1
    assert snap.metrics(0)["restarted_rollouts"] == 1


async def test_a_mismatch_aborts_the_snapshot_and_keeps_the_previous_one(
    ckpt: Any, tmp_path: Path
) -> None:
    c = await client(ckpt, "holder-0")
    await play(c, Ep("a", 0), 1)
    path = tmp_path / "same-folder"
    async with ckpt.snapshot(path) as snap:
        await snap.check_against_cut(expected_cut({"holder-0": [Ep("a", 0)]}, {"a/row0"}))
    before = {p.name: p.read_bytes() for p in environment_dir(path).iterdir()}

    await play(c, Ep("b", 0), 1)
    with pytest.raises(SnapshotMismatchError, match="unexpected_episode: holder-0/b"):
        async with ckpt.snapshot(path) as snap:
            await snap.check_against_cut(expected_cut({"holder-0": [Ep("a", 0)]}, {"a/row0"}))
    assert set((await states(ckpt)).values()) == {HolderState.RUNNING}
    after = {p.name: p.read_bytes() for p in environment_dir(path).iterdir()}
    assert after == before, "the failed snapshot left files or changed the committed one"
    assert [s.episode.rollout_id for s in read_snapshot(path).sessions["holder-0"]] == ["a"]


async def test_a_rollout_held_by_two_instances_never_commits_even_unchecked(
    ckpt: Any, tmp_path: Path
) -> None:
    # Without check_against_cut nothing names the duplicate before the commit, but a
    # manifest listing one rollout twice could never be restored: the commit refuses it.
    await play(await client(ckpt, "holder-0"), Ep("twice", 0), 1)
    await play(await client(ckpt, "holder-1"), Ep("twice", 0), 1)
    path = tmp_path / "dup"
    with pytest.raises(ValueError, match=r"rollouts captured twice: \['twice'\]: each was "
                                         r"captured by more than one instance"):
        async with ckpt.snapshot(path):
            pass
    assert set((await states(ckpt)).values()) == {HolderState.RUNNING}
    assert list(environment_dir(path).iterdir()) == []


async def test_by_default_a_snapshot_nobody_checked_against_a_cut_is_refused(
    ckpt: Any, tmp_path: Path
) -> None:
    strict = RayEnvironmentCheckpoint(ckpt.config.model_copy(
        update={"allow_unchecked_snapshots": False}))
    await play(await client(ckpt, "holder-0"), Ep("a", 0), 1)
    path = tmp_path / "unchecked"
    with pytest.raises(UncheckedSnapshotError, match="never called"):
        async with strict.snapshot(path) as snap:
            assert snap is not None
    assert set((await states(ckpt)).values()) == {HolderState.RUNNING}
    assert not (environment_dir(path) / "manifest.json").exists()
    assert [p for p in environment_dir(path).iterdir() if not p.name.startswith(".")] == []


async def test_a_snapshot_into_an_occupied_folder_replaces_it_atomically(
    ckpt: Any, tmp_path: Path
) -> None:
    c = await client(ckpt, "holder-2")
    await play(c, Ep("a", 0), 1)
    path = tmp_path / "p"
    async with ckpt.snapshot(path):
        pass
    await play(c, Ep("b", 0), 2)
    async with ckpt.snapshot(path):
        pass
    loaded = read_snapshot(path)
    assert sorted(s.episode.rollout_id for s in loaded.sessions["holder-2"]) == ["a", "b"]
    names = sorted(p.name for p in environment_dir(path).iterdir())
    assert names == sorted(["manifest.json", *(s.file for s in loaded.manifest.shards)])


async def test_a_second_snapshot_while_one_is_open_is_refused(ckpt: Any, tmp_path: Path) -> None:
    async with ckpt.snapshot(tmp_path / "one"):
        with pytest.raises(SnapshotInProgressError, match="while snap-"):
            async with ckpt.snapshot(tmp_path / "two"):
                pass
        for op in (ckpt.retire, ckpt.forget):
            with pytest.raises(SnapshotInProgressError):
                await op([Ep("x", 0)])
    assert not (tmp_path / "two" / "environment" / "manifest.json").exists()


async def test_a_lapsed_lease_resumes_holders_and_the_commit_is_refused(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    # Drive the coordinator by hand and never renew: as if the driver froze.
    config = CheckpointConfig(allow_unchecked_snapshots=True,
                              namespace=namespace, lease_s=1.0, drain_timeout_s=0.2)
    ckpt = RayEnvironmentCheckpoint(config)
    try:
        await ckpt.ensure_holders()
        c = await client(ckpt, "holder-0")
        await play(c, Ep("a", 0), 1)
        coord = ray.get_actor(config.coordinator_name, namespace=namespace)
        path = str(tmp_path / "lapsed")
        await coord.begin_snapshot.remote("snap-x", path)
        assert set((await states(ckpt)).values()) == {HolderState.PAUSED}
        await asyncio.sleep(1.6)
        assert set((await states(ckpt)).values()) == {HolderState.RUNNING}
        with pytest.raises(LeaseExpiredError, match="lease of snap-x lapsed"):
            await ckpt._coordinator.commit_snapshot("snap-x", path, {}, 0)
        assert not (Path(path) / "environment" / "manifest.json").exists()
        assert list((Path(path) / "environment").glob("shard-*")) == []
        async with c.turn(Ep("a", 0)) as turn:  # turns flow again
            turn.complete(b"t1", b"s", [])
    finally:
        ckpt.shutdown()


async def test_shutdown_with_wait_returns_once_ray_has_released_every_name(ckpt: Any) -> None:
    await ckpt.ensure_holders()
    namespace = ckpt.config.namespace
    await ckpt.shutdown(wait=True)
    assert [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == namespace] == []
    await ckpt.check_startup()  # a new coordinator and holders take the names at once
    assert len(await ckpt.holders()) == 3


# --- restore ---------------------------------------------------------------------------


async def test_restore_continues_each_rollout_on_its_instance_as_the_next_attempt(
    ckpt: Any, cluster: Any, tmp_path: Path
) -> None:
    live = {"holder-0": [Ep("a", 0)], "holder-1": [Ep("b", 1)], "holder-2": [Ep("c", 0)]}
    for inst, eps in live.items():
        for ep in eps:
            await play(await client(ckpt, inst), ep, 2)
    path = tmp_path / "ckpt"
    async with ckpt.snapshot(path):
        pass
    before = {inst: await (await client(ckpt, inst)).sessions() for inst in live}
    ckpt.shutdown()  # the job dies: holders and coordinator gone, sessions lost

    fresh = RayEnvironmentCheckpoint(ckpt.config)
    assert fresh.last_restore_metrics is None
    async with fresh.restored(path) as restored:
        assert restored.continued_attempts == {
            ("holder-0", "a", 0), ("holder-1", "b", 1), ("holder-2", "c", 0)}
        assert fresh.last_restore_metrics is None, "not live yet"
        assert restored.staging_keys == {"a/row0", "a/row1", "b-a1/row0", "b-a1/row1",
                                         "c/row0", "c/row1"}
        assert {h.state for h in await fresh.holders()} == {HolderState.RESTORING}
    figures = fresh.last_restore_metrics
    assert figures is not None
    assert figures["bytes_read"] == sum(s.bytes for s in read_manifest(path).shards)
    assert figures["continued_rollouts"] == 3
    assert 0 < figures["read_seconds"] < figures["restore_seconds"]
    holders = await fresh.holders()
    assert len({h.node_id for h in holders}) == 3, "one instance per node, as before"
    for inst, old in before.items():
        (new,) = await (await client(fresh, inst)).sessions()
        (was,) = old
        assert new.episode == was.episode.next_attempt()
        assert (new.turns, new.state, new.staging_keys) == (was.turns, was.state,
                                                            was.staging_keys)
        assert new.earlier_capture_keys == (*was.earlier_capture_keys, was.episode.capture_key)
    # The continued rollout runs its next turn under its new capture key.
    c = await client(fresh, "holder-1")
    async with c.turn(Ep("b", 2)) as turn:
        turn.complete(b"t2", b"s3", ["b-a2/row2"])
    fresh.shutdown()


def write_fake_snapshot(path: Path, instances: list[str]) -> None:
    """A committed snapshot with one rollout per instance, as an earlier job left it."""
    directory = prepare_environment_dir(path)
    shards, rollouts = [], []
    for n, inst in enumerate(instances):
        rec = SessionRecord(inst, Ep(f"r{n}", 0), (b"t0",), b"s", frozenset({f"r{n}/row0"}))
        entry = write_shard(directory, shard_file_name("old", inst), inst, [rec])
        shards.append(entry.model_copy(update={"chunks": None}))  # format 2 had none
        rollouts.append(RolloutEntry(instance_id=inst, rollout_id=f"r{n}", attempt=0,
                                     turns=1, staging_keys=[f"r{n}/row0"], shard=entry.file))
    write_manifest(directory, Manifest(
        format_version=2, snapshot_id="old", created_at=datetime.now(timezone.utc),
        instances=instances, shards=shards, rollouts=rollouts, restarted_rollouts=0,
        metrics={}))


async def test_restore_onto_fewer_nodes_puts_several_instances_on_a_node(
    ckpt: Any, tmp_path: Path
) -> None:
    instances = [f"holder-{k}" for k in range(5)]  # taken on a 5-node cluster
    write_fake_snapshot(tmp_path / "c", instances)
    async with ckpt.restored(tmp_path / "c") as restored:
        assert {i for i, _, _ in restored.continued_attempts} == set(instances)
    holders = await ckpt.holders()
    per_node: dict[str, list[str]] = {}
    for h in holders:
        per_node.setdefault(h.node_id, []).append(h.instance_id)
    assert sorted(len(v) for v in per_node.values()) == [1, 2, 2]
    for n, inst in enumerate(instances):
        (s,) = await (await client(ckpt, inst)).sessions()
        assert s.episode == Ep(f"r{n}", 1) and s.instance_id == inst


async def test_restore_onto_more_nodes_gives_new_nodes_empty_instances(
    ckpt: Any, tmp_path: Path
) -> None:
    write_fake_snapshot(tmp_path / "c", ["holder-0"])  # taken on a 1-node cluster
    async with ckpt.restored(tmp_path / "c") as restored:
        assert restored.continued_attempts == {("holder-0", "r0", 0)}
    sessions = {h.instance_id: h.sessions for h in await ckpt.holders()}
    assert sessions == {"holder-0": 1, "holder-1": 0, "holder-2": 0}


async def test_an_exception_inside_restored_drops_every_restored_session(
    ckpt: Any, tmp_path: Path
) -> None:
    write_fake_snapshot(tmp_path / "c", ["holder-0", "holder-1"])
    with pytest.raises(RuntimeError, match="RL restore failed"):
        async with ckpt.restored(tmp_path / "c"):
            raise RuntimeError("RL restore failed")
    holders = await ckpt.holders()
    assert {h.instance_id: (h.sessions, h.state) for h in holders} == {
        f"holder-{k}": (0, HolderState.RUNNING) for k in range(3)}


async def test_a_restore_of_rollouts_that_are_live_is_refused(ckpt: Any, tmp_path: Path) -> None:
    write_fake_snapshot(tmp_path / "c", ["holder-0"])
    c = await client(ckpt, "holder-2")
    await c.open(Ep("r0", 3))
    with pytest.raises(RestoreConflictError,
                       match=r"on 1 holder\(s\), holder-2 \(holder-2: r0\)"):
        async with ckpt.restored(tmp_path / "c"):
            pass
    sessions = {h.instance_id: (h.sessions, h.state) for h in await ckpt.holders()}
    assert sessions == {"holder-0": (0, HolderState.RUNNING), "holder-1": (0, HolderState.RUNNING),
                        "holder-2": (1, HolderState.RUNNING)}


# --- ledger operations, startup, classification ---------------------------------------------


async def test_retire_drops_sessions_and_refuses_late_turns_forget_clears(ckpt: Any) -> None:
    c = await client(ckpt, "holder-0")
    ep = Ep("r", 0)
    await play(c, ep, 1)
    assert await ckpt.retire([ep]) == ["r"]
    with pytest.raises(RetiredAttemptError, match="retired"):
        async with c.turn(ep):
            pass
    assert await ckpt.forget([ep]) == []
    await c.open(ep)  # forgotten: it may run again


async def test_a_holder_started_after_a_retire_refuses_the_retired_attempt(ckpt: Any) -> None:
    """On Ray too, the coordinator starts a dead holder's successor with RL's retire
    marks: a worker's open of a retired attempt, retried across the death, is refused
    there (simulation seed 800362)."""
    c = await client(ckpt, "holder-1")
    ep = Ep("r-retired", 0)
    await c.open(ep)
    assert await ckpt.retire([ep]) == ["r-retired"]
    dead = ray.get_actor(HOLDER_NAME_PREFIX + "holder-1", namespace=ckpt.config.namespace)
    ray.kill(dead)
    with pytest.raises(ray.exceptions.RayActorError):  # dead: a holder-1 from now is new
        await dead.info.remote()
    deadline = asyncio.get_running_loop().time() + 60
    while "holder-1" not in {h.instance_id for h in await ckpt.ensure_holders()}:
        assert asyncio.get_running_loop().time() < deadline, "no successor of holder-1"
        await asyncio.sleep(0.5)  # until Ray has released the dead one's name
    successor = await client(ckpt, "holder-1")
    with pytest.raises(RetiredAttemptError, match="attempt r-retired was retired by RL"):
        await successor.open(ep)
    await successor.open(ep.next_attempt())


async def test_check_startup_passes_on_a_shared_writable_root(ckpt: Any, tmp_path: Path) -> None:
    await ckpt.check_startup()
    assert not (tmp_path / ".nemo_ckpt_probe").exists(), "probe files were left behind"


async def test_check_startup_refuses_a_root_the_holders_cannot_write(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ckpt = RayEnvironmentCheckpoint(CheckpointConfig(allow_unchecked_snapshots=True,
                                                     namespace=namespace,
                                                     checkpoint_root=blocker / "root"))
    try:
        with pytest.raises(StartupCheckError, match="holder-0 cannot write under") as err:
            await ckpt.check_startup()
        assert str(err.value).count("cannot write under") == 3
    finally:
        ckpt.shutdown()


def test_config_refuses_deadlines_that_cannot_work() -> None:
    with pytest.raises(ValueError, match="must be shorter than lease_s"):
        CheckpointConfig(drain_timeout_s=10, lease_s=5)
    with pytest.raises(ValueError, match="at most half of lease_s"):
        CheckpointConfig(lease_s=10, lease_renew_interval_s=6, drain_timeout_s=0.1)
    with pytest.raises(ValueError):
        CheckpointConfig(lease_s=-1)


async def test_is_unavailable_only_for_unreachable_or_late_actors(ckpt: Any) -> None:
    from ray.exceptions import ActorDiedError, GetTimeoutError

    assert ckpt.is_unavailable(BackendUnavailableError("late"))
    assert ckpt.is_unavailable(GetTimeoutError("late"))
    assert ckpt.is_unavailable(ActorDiedError())
    assert not ckpt.is_unavailable(SnapshotMismatchError(()))
    assert not ckpt.is_unavailable(ValueError("bad input"))
    assert not ckpt.is_unavailable(OSError(28, "No space left on device"))


async def test_holder_names_live_in_the_configured_namespace(ckpt: Any) -> None:
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == ckpt.config.namespace}
    assert names == {ckpt.config.coordinator_name,
                     *(f"{HOLDER_NAME_PREFIX}holder-{k}" for k in range(3))}


async def test_a_block_longer_than_the_lease_still_commits_thanks_to_renewals(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    ckpt = RayEnvironmentCheckpoint(CheckpointConfig(allow_unchecked_snapshots=True,
                                                     namespace=namespace, lease_s=1.0,
                                                     drain_timeout_s=0.2))
    try:
        await ckpt.ensure_holders()
        await play(await client(ckpt, "holder-0"), Ep("a", 0), 1)
        async with ckpt.snapshot(tmp_path / "long") as snap:
            await asyncio.sleep(2.5)  # RL's own save takes longer than one lease
            assert set((await states(ckpt)).values()) == {HolderState.PAUSED}
        assert snap is not None and snap.captured_rollouts == 1
        manifest = read_manifest(tmp_path / "long")
        assert [r.rollout_id for r in snapshot_rollouts(tmp_path / "long", manifest)[0]] == [
            "a"]
    finally:
        ckpt.shutdown()


async def test_a_corrupt_shard_refuses_the_restore_before_any_holder_changes(
    ckpt: Any, tmp_path: Path
) -> None:
    from nemo_ckpt.errors import ShardCorruptedError

    write_fake_snapshot(tmp_path / "c", ["holder-0", "holder-1"])
    shard = environment_dir(tmp_path / "c") / shard_file_name("old", "holder-1")
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptedError, match="xxh3-128"):
        async with ckpt.restored(tmp_path / "c"):
            pytest.fail("the block ran although a shard is corrupt")
    assert {h.instance_id: (h.sessions, h.state) for h in await ckpt.holders()} == {
        f"holder-{k}": (0, HolderState.RUNNING) for k in range(3)}
