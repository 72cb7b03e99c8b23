"""``RolloutCheckpointManager`` on the in-process job (``tests.harness``) with NeMo RL's
test double (``nemo_ckpt.testing.nemo_rl``): interval and anchored snapshots numbered by
commit, retention, the failure budget, the restore modes and the fingerprint."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt import ManagedSnapshot, RolloutCheckpointConfig, RolloutCheckpointManager
from nemo_ckpt.errors import (
    BackendUnavailableError,
    CheckpointPathBusyError,
    FingerprintMismatchError,
    RolloutCheckpointFailedError,
    SnapshotMismatchError,
    SnapshotNotFoundError,
)
from nemo_ckpt.integrations.nemo_rl import NemoRlEnvironmentCheckpoint
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.testing.nemo_rl import (
    STATE_FILE,
    DataPlaneCheckpointBarrier,
    NemoRlState,
    RecoveryGranularity,
    RecoveryTargetLevel,
)
from tests.harness import World

pytestmark = pytest.mark.timeout(90)

OWNERS = {"replica-0": "holder-0", "replica-1": "holder-1"}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Job:
    def __init__(self, world: World, root: Path, **overrides: Any) -> None:
        self.world = world
        self.root = root
        self.overrides = dict(overrides)
        self.clock = Clock()
        self.barrier = DataPlaneCheckpointBarrier()
        self.env = NemoRlEnvironmentCheckpoint(
            world.ckpt, ledger=lambda: self.rl.ledger,
            staging=lambda: self.rl.staging.list_keys(), owners=OWNERS)
        self.rl = NemoRlState(self.env, self.barrier)
        settings: dict[str, Any] = dict(root=str(root), snapshot_attempt_interval_s=60.0,
                                        keep_latest_k=2, max_consecutive_failures=3)
        settings.update(overrides.pop("settings", {}))
        self.manager = RolloutCheckpointManager(
            self.env, self.barrier, self.rl, RolloutCheckpointConfig(**settings),
            clock=self.clock, **overrides)

    async def rollout(self, group: str, owner: str, turns: int,
                      granularity: RecoveryGranularity = RecoveryGranularity.SIBLING) -> Ep:
        async with self.barrier.mutation() as cut:
            # The dataset's index of the group's prompt: any stable integer per group.
            prompt = int(hashlib.sha256(group.encode()).hexdigest()[:8], 16)
            record = self.rl.ledger.reserve_group(
                cut, group_id=group, prompt_id=str(prompt), prompt_payload={"idx": prompt},
                expected_generations=1, target_step=1, start_weight_version=0,
                recovery_granularity=granularity, restore_level=RecoveryTargetLevel.TURN)
            self.rl.ledger.mark_group_dispatched(cut, group, gym_instance_id=owner)
        ep = Ep(*record.gym_episode(0))
        client = await self.world.client(OWNERS[owner])
        await client.open(ep, b"s0")
        for n in range(turns):
            await self.turn(owner, ep, n)
        return ep

    def restarted(self) -> Job:
        """The job after a crash: a new process, its ledger and staging empty."""
        return Job(self.world, self.root, **self.overrides)

    async def crashed(self) -> Job:
        """The job crashes, its actors with it: holders start again, and the job after
        it (``restarted``) is returned."""
        self.world.ckpt.shutdown()
        await self.world.ckpt.ensure_holders()
        return self.restarted()

    async def two_snapshots(self, group: str) -> tuple[Ep, ManagedSnapshot, ManagedSnapshot]:
        """A rollout of ``group`` on replica-0 snapshotted after its first turn (older)
        and its second (newer)."""
        ep = await self.rollout(group, "replica-0", 1)
        older = await self.manager.snapshot()
        await self.turn("replica-0", ep, 1)
        newer = await self.manager.snapshot()
        assert older is not None and newer is not None
        return ep, older, newer

    async def turn(self, owner: str, ep: Ep, n: int) -> None:
        client = await self.world.client(OWNERS[owner])
        async with client.turn(ep) as turn:
            key = f"{ep.capture_key}/row{n}"
            async with self.barrier.mutation() as cut:
                self.rl.staging.put(cut, key, b"tokens")
            turn.complete(f"t{n}".encode(), f"s{n + 1}".encode(), [key])


def damage_a_shard(snapshot: ManagedSnapshot) -> None:
    """Zero one shard of ``snapshot``'s environment half: it no longer verifies."""
    shard = next(p for p in (Path(snapshot.path) / "environment").iterdir()
                 if p.name != "manifest.json")
    shard.write_bytes(b"\0" * shard.stat().st_size)


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def test_snapshots_come_on_the_interval_numbered_by_commit_and_retention_keeps_the_anchor(
        rooted_world: World) -> None:
    root = rooted_world.root / "ckpt"
    job = Job(rooted_world, root)

    async def scenario() -> tuple[list[Any], list[Any]]:
        await rooted_world.ckpt.ensure_holders()
        ep = await job.rollout("g1", "replica-0", 1)
        assert await job.manager.maybe_snapshot() is None  # the interval has not passed
        anchored = await job.manager.snapshot_at_trainer_checkpoint(7)
        taken = [anchored]
        for n in range(1, 4):
            await job.turn("replica-0", ep, n)
            job.clock.now += 61.0
            taken.append(await job.manager.maybe_snapshot())
        return taken, await job.manager.snapshots()

    taken, kept = rooted_world.run(scenario())
    numbers = [t.number for t in taken]
    assert numbers == sorted(numbers) and len(set(numbers)) == 4
    # The two newest, and the one trainer step 7 anchors.
    assert [s.path for s in kept] == [taken[3].path, taken[2].path, taken[0].path]
    assert kept[2].anchor_step == 7
    # The removed one is gone from disk whole: no empty environment/ folder left.
    assert not Path(taken[1].path).exists()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("rollout-")) == sorted(
        Path(t.path).name for t in (taken[0], taken[2], taken[3]))


def test_transient_failures_are_retried_and_the_budget_ends_in_an_error(
        rooted_world: World, caplog: pytest.LogCaptureFixture) -> None:
    job = Job(rooted_world, rooted_world.root / "ckpt")
    saves = job.rl.save

    async def unreachable(cut: Any, path: str) -> None:
        raise BackendUnavailableError("the data plane's store did not answer")

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        await job.rollout("g1", "replica-0", 1)
        job.rl.save = unreachable  # type: ignore[method-assign]
        assert await job.manager.snapshot() is None
        assert await job.manager.snapshot() is None
        job.rl.save = saves  # type: ignore[method-assign]
        assert await job.manager.snapshot() is not None  # a success resets the count
        assert job.manager.consecutive_failures == 0
        job.rl.save = unreachable  # type: ignore[method-assign]
        for _ in range(2):
            assert await job.manager.snapshot() is None
        await job.manager.snapshot()

    with caplog.at_level(logging.WARNING, logger="nemo_ckpt"), \
            pytest.raises(RolloutCheckpointFailedError, match="3 rollout snapshots failed"):
        rooted_world.run(scenario())
    assert "1 of 3 failures in a row" in caplog.text
    # Nothing of the failed ones is left: only the committed snapshot's folder.
    assert len([p for p in (rooted_world.root / "ckpt").iterdir()
                if p.name.startswith("rollout-")]) == 1


def test_a_failure_that_is_not_transient_raises_at_once(rooted_world: World) -> None:
    job = Job(rooted_world, rooted_world.root / "ckpt")

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        ep = await job.rollout("g1", "replica-0", 1)
        client = await rooted_world.client("holder-0")
        await client.close(ep)
        await client.open(ep.next_attempt(), b"")  # RL's ledger expects attempt 0
        await job.manager.snapshot()

    with pytest.raises(SnapshotMismatchError, match="wrong_attempt"):
        rooted_world.run(scenario())
    assert job.manager.consecutive_failures == 1


def test_restore_by_trainer_step_continues_the_anchored_rollouts(rooted_world: World) -> None:
    root = rooted_world.root / "ckpt"
    job = Job(rooted_world, root, settings={"restore_mode": "trainer_checkpoint"})

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        ep = await job.rollout("g1", "replica-0", 2)
        await job.manager.snapshot_at_trainer_checkpoint(4)
        await job.turn("replica-0", ep, 2)
        await job.manager.snapshot()  # newer, but not the trainer's
        restarted = await job.crashed()
        with pytest.raises(SnapshotNotFoundError, match=r"anchored steps: \[4\]"):
            await restarted.manager.restore(trainer_step=5)
        chosen = await restarted.manager.restore(trainer_step=4)
        assert chosen is not None and chosen.anchor_step == 4
        attempt = restarted.rl.ledger.get_group("g1").siblings[0].current_attempt
        assert attempt.gym_attempt == 1
        record = await (await rooted_world.client("holder-0")).get(ep.next_attempt())
        assert record.turns == (b"t0", b"t1")  # as the anchored snapshot held it
        # RL's half is the anchored snapshot's too: its rows, all kept.
        assert set(restarted.rl.staging.rows) == {
            f"{ep.capture_key}/row{n}" for n in range(2)}
        assert restarted.rl.cleared == frozenset()

    rooted_world.run(scenario())


def test_a_restore_under_a_changed_fingerprint_is_refused_and_changes_nothing(
        rooted_world: World) -> None:
    root = rooted_world.root / "ckpt"
    job = Job(rooted_world, root, fingerprint={"environment_adapters": ["gsm8k"],
                                        "rl_config": "abc"})

    async def scenario() -> str:
        await rooted_world.ckpt.ensure_holders()
        await job.rollout("g1", "replica-0", 2)
        await job.manager.snapshot()
        before = tree(root)
        rooted_world.ckpt.shutdown()
        await rooted_world.ckpt.ensure_holders()
        changed = Job(rooted_world, root, fingerprint={"environment_adapters": ["gsm8k", "sql"],
                                                "rl_config": "abd"})
        with pytest.raises(FingerprintMismatchError) as caught:
            await changed.manager.restore()
        assert tree(root) == before  # byte for byte
        assert set(caught.value.changed) == {"environment_adapters", "rl_config"}
        assert await (await rooted_world.client("holder-0")).sessions() == []
        # Allowed by the caller, the same restore goes through.
        allowed = Job(rooted_world, root, fingerprint={"environment_adapters": ["gsm8k", "sql"],
                                                "rl_config": "abd"},
                      settings={"allow_changed": frozenset({"environment_adapters",
                                                            "rl_config"})})
        assert await allowed.manager.restore() is not None
        return str(caught.value)

    message = rooted_world.run(scenario())
    assert "existing checkpoint state was not modified" in message
    assert 'environment_adapters: saved ["gsm8k"], now ["gsm8k","sql"]' in message
    assert 'rl_config: saved "abc", now "abd"' in message


def test_restore_latest_skips_a_damaged_snapshot_and_a_fresh_root_restores_nothing(
        rooted_world: World, caplog: pytest.LogCaptureFixture) -> None:
    root = rooted_world.root / "ckpt"
    job = Job(rooted_world, root, settings={"keep_latest_k": 3})

    async def scenario() -> None:
        assert await job.manager.restore() is None  # nothing yet: a fresh start
        await rooted_world.ckpt.ensure_holders()
        ep, older, newer = await job.two_snapshots("g1")
        damage_a_shard(newer)
        chosen = await (await job.crashed()).manager.restore()
        assert chosen is not None and chosen.path == older.path
        record = await (await rooted_world.client("holder-0")).get(ep.next_attempt())
        assert record.turns == (b"t0",)

    with caplog.at_level(logging.WARNING, logger="nemo_ckpt"):
        rooted_world.run(scenario())
    assert "does not verify" in caplog.text


def test_retention_keeps_the_saved_trainer_checkpoints_anchor_until_a_newer_one_is_saved(
        rooted_world: World) -> None:
    events: list[tuple[str, str]] = []
    job = Job(rooted_world, rooted_world.root / "ckpt", settings={"keep_latest_k": 1},
              on_event=lambda event, path: events.append((event, Path(path).name)))

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        await job.rollout("g1", "replica-0", 1)
        two = await job.manager.snapshot_at_trainer_checkpoint(2)
        await job.manager.trainer_checkpoint_saved(2)
        four = await job.manager.snapshot_at_trainer_checkpoint(4)  # its checkpoint: not yet
        newest = await job.manager.snapshot()
        assert two and four and newest
        kept = [s.path for s in await job.manager.snapshots()]
        assert kept == [newest.path, four.path, two.path]
        removed = await job.manager.trainer_checkpoint_saved(4)
        assert removed == [two.path]
        assert [s.anchor_step for s in await job.manager.snapshots()] == [None, 4]
        assert ("removing", Path(two.path).name) in events
        assert ("committed", Path(newest.path).name + ".partial") in events
        assert ("renamed", Path(newest.path).name) in events

    rooted_world.run(scenario())


def test_retention_keeps_the_newest_k_the_saved_steps_anchor_and_every_newer_anchor() -> None:
    from nemo_ckpt.manager.retention import retained

    def snap(path: str, step: int | None) -> ManagedSnapshot:
        return ManagedSnapshot(None, path, step, None)

    found = [snap("p7", None), snap("p6", 6), snap("p5", None), snap("p4", 4),
             snap("p3", 4), snap("p2", 2), snap("p1", None)]  # newest first
    assert retained(found, 1, trainer_step=4) == {"p7", "p6", "p4"}
    assert retained(found, 1, trainer_step=6) == {"p7", "p6"}
    # Told of no trainer checkpoint: the newest anchor stands for it.
    assert retained(found, 2, trainer_step=None) == {"p7", "p6"}
    assert retained([snap("p1", None)], 3, trainer_step=None) == {"p1"}


class SweptInside:
    """RL's barrier, running ``during`` at the end of each barrier section: after RL's
    half and the manager's record are written, before the environment commits."""

    def __init__(self, barrier: DataPlaneCheckpointBarrier,
                 during: Callable[[], Awaitable[Any]]) -> None:
        self.barrier = barrier
        self.during = during

    @contextlib.asynccontextmanager
    async def checkpoint(self) -> AsyncIterator[Any]:
        async with self.barrier.checkpoint() as cut:
            yield cut
            await self.during()


def test_a_second_managers_sweep_leaves_a_snapshot_inside_its_barrier_which_restores(
        rooted_world: World) -> None:
    root = rooted_world.root / "ckpt"
    a, b = Job(rooted_world, root), Job(rooted_world, root)  # two jobs, one root
    swept: list[list[str]] = []

    async def sweep() -> None:
        swept.append(await b.manager.apply_retention())

    a.manager.barrier = SweptInside(a.barrier, sweep)

    async def scenario() -> Any:
        nonlocal a
        await rooted_world.ckpt.ensure_holders()
        ep = await a.rollout("g1", "replica-0", 2)
        taken = await a.manager.snapshot()
        assert taken is not None
        assert [s.path for s in await a.manager.snapshots()] == [taken.path]
        a = await a.crashed()
        chosen = await a.manager.restore()
        record = await (await rooted_world.client("holder-0")).get(ep.next_attempt())
        return ep, taken, chosen, record

    ep, taken, chosen, record = rooted_world.run(scenario())
    assert swept == [[]]  # B's retention ran inside A's barrier, and removed nothing
    # A's snapshot is listed, and restores whole: the sessions and RL's half (its rows).
    assert chosen is not None and chosen.path == taken.path
    assert record.turns == (b"t0", b"t1")
    assert set(a.rl.staging.rows) == {f"{ep.capture_key}/row{n}" for n in range(2)}
    assert sorted(p.name for p in Path(taken.path).iterdir()) == [
        "environment", STATE_FILE, "rollout_checkpoint.json"]


def test_a_snapshot_whose_record_is_removed_before_its_commit_returns_is_not_reported(
        rooted_world: World) -> None:
    # What a sweep that ignored claims (a manager of an older release) did to it.
    job = Job(rooted_world, rooted_world.root / "ckpt")

    async def remove_record() -> None:
        next(Path(job.manager.config.root).glob(
            "rollout-*.partial/rollout_checkpoint.json")).unlink()

    job.manager.barrier = SweptInside(job.barrier, remove_record)

    async def scenario() -> list[Any]:
        await rooted_world.ckpt.ensure_holders()
        await job.rollout("g1", "replica-0", 1)
        with pytest.raises(CheckpointPathBusyError, match=r"^rollout snapshot .*/rollout-\S+ "
                           r"committed, but its record rollout_checkpoint.json was removed "
                           r"before the commit returned .* not reported as taken; give each "
                           r"job its own root"):
            await job.manager.snapshot()
        return await job.manager.snapshots()

    assert rooted_world.run(scenario()) == []
    assert job.manager.consecutive_failures == 1


def test_the_sweep_leaves_a_link_planted_as_a_partial_snapshot_and_what_it_points_at(
        rooted_world: World, caplog: pytest.LogCaptureFixture) -> None:
    root = rooted_world.root / "ckpt"
    root.mkdir(exist_ok=True)
    elsewhere = rooted_world.root / "elsewhere"
    (elsewhere / "environment").mkdir(parents=True)
    (elsewhere / STATE_FILE).write_text("RL's own")
    (elsewhere / "rollout_checkpoint.json").write_text("someone's")
    (root / "rollout-x.partial").symlink_to(elsewhere, target_is_directory=True)
    job = Job(rooted_world, root)

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        await job.rollout("g1", "replica-0", 1)
        assert await job.manager.snapshot() is not None  # its retention sweeps
        assert await job.manager.apply_retention() == []

    with caplog.at_level(logging.WARNING, logger="nemo_ckpt"):
        rooted_world.run(scenario())
    assert (elsewhere / STATE_FILE).read_text() == "RL's own"
    assert (elsewhere / "rollout_checkpoint.json").read_text() == "someone's"
    assert (root / "rollout-x.partial").is_symlink()
    warned = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
    assert warned == [f"rollout retention leaves {root / 'rollout-x.partial'} alone: a "
                      f"symbolic link where the manager makes only folders; remove the link "
                      f"itself if it is not wanted"]  # once, not at every retention


@pytest.mark.parametrize("planted", ["nested", "fifo"])
def test_a_record_nested_100000_deep_is_passed_over_by_snapshot_and_restore(
        rooted_world: World, caplog: pytest.LogCaptureFixture, planted: str) -> None:
    # A FIFO in its place hung them (its open waited for a writer) as the nested one
    # raised RecursionError out of them.
    blocked = guarded(rooted_world)
    root = rooted_world.root / "ckpt"
    job = Job(rooted_world, root, settings={"keep_latest_k": 3})

    async def scenario() -> tuple[Any, Any, Any, Any]:
        await rooted_world.ckpt.ensure_holders()
        ep, older, newer = await job.two_snapshots("g1")
        plant(rooted_world, Path(newer.path) / "rollout_checkpoint.json", planted)
        later = await job.manager.snapshot()  # raised RecursionError after its commit
        assert later is not None
        assert [s.path for s in await job.manager.snapshots()] == [later.path, older.path]
        plant(rooted_world, Path(later.path) / "rollout_checkpoint.json", planted)
        chosen = await (await job.crashed()).manager.restore()
        record = await (await rooted_world.client("holder-0")).get(ep.next_attempt())
        return older, later, chosen, record

    with caplog.at_level(logging.WARNING, logger="nemo_ckpt"):
        older, later, chosen, record = rooted_world.run(scenario())
    # The newer ones do not read, so the restore takes the older, which verifies.
    assert chosen is not None and chosen.path == older.path
    assert record.turns == (b"t0",)
    assert ("rollout_checkpoint.json is JSON nested too deeply (more than 64 levels" if
            planted == "nested" else "rollout_checkpoint.json is a FIFO, not a regular file"
            ) in caplog.text
    assert "RecursionError" not in caplog.text
    assert blocked == []


def guarded(world: World) -> list[str]:
    """The blocking calls the in-process world's guard finds waiting (it then opens
    each FIFO ``plant`` made for writing, freeing them): a read that waits on one is
    reported, and fails the test, rather than hanging it."""
    blocked: list[str] = []
    world.sim.on_blocked = lambda actor, name, where: blocked.append(
        f"{name} of {actor.name}, blocked in {where}")
    return blocked


def plant(world: World, record: Path, kind: str) -> None:
    """A record nested 100,000 deep (200 KB: within its size bound), or a FIFO."""
    record.unlink()
    if kind == "fifo":
        os.mkfifo(record)
        world.sim.fifos.append(str(record))
    else:
        record.write_bytes(b'{"format": 1, "fingerprint": {"x": ' + b"[" * 100_000
                           + b"]" * 100_000 + b"}}")


def test_retention_never_removes_a_snapshot_reached_through_a_link(
        rooted_world: World, caplog: pytest.LogCaptureFixture) -> None:
    root = rooted_world.root / "ckpt"
    job = Job(rooted_world, root)  # keeps the newest 2
    moved = rooted_world.root / "elsewhere"

    async def scenario() -> list[str]:
        await rooted_world.ckpt.ensure_holders()
        ep = await job.rollout("g1", "replica-0", 1)
        first = await job.manager.snapshot()
        assert first is not None
        Path(first.path).rename(moved)  # another disk's snapshot, linked in
        Path(first.path).symlink_to(moved, target_is_directory=True)
        for n in (1, 2):
            await job.turn("replica-0", ep, n)
            assert await job.manager.snapshot() is not None
        return [s.path for s in await job.manager.snapshots()]

    with caplog.at_level(logging.WARNING, logger="nemo_ckpt"):
        listed = rooted_world.run(scenario())
    assert len(listed) == 3  # the third is past keep_latest_k, and left
    assert sorted(p.name for p in moved.iterdir()) == [
        "environment", STATE_FILE, "rollout_checkpoint.json"]
    assert (moved / "environment" / "manifest.json").is_file()
    assert f"rollout retention leaves {listed[2]}: it is reached through a symbolic link" \
        in caplog.text
