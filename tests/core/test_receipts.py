"""Completion receipts (``nemo_ckpt.receipts``): finished rollouts handed to the backend,
kept until RL acknowledges them, captured by snapshots and handed back by restores, with
no lock between finishing and snapshotting. Run in-process on the simulated world
(``actors.sim``), under virtual time."""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import logging
from typing import Any

import pytest

from nemo_ckpt.catalog.verification import verify_snapshot
from nemo_ckpt.cut import check_capture_against_cut
from nemo_ckpt.errors import RolloutFinishedError, SnapshotInProgressError, SnapshotMismatchError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.storage.manifest import FORMAT_VERSION, Manifest
from nemo_ckpt.storage.snapshot_files import read_manifest, read_snapshot
from nemo_ckpt.testing.data_plane import StaticCut
from tests.harness import World, cut_of

pytestmark = pytest.mark.timeout(60)


def recorded(live: dict[str, list[Ep]], done: Ep, turns: int = 2) -> StaticCut:
    """RL's cut once it recorded ``done`` as finished: not expected, its rows moved out."""
    rest = {i: [ep for ep in eps if ep != done] for i, eps in live.items()}
    rows = {f"{ep.capture_key}/row{t}" for eps in rest.values() for ep in eps
            for t in range(turns)}
    return StaticCut({i: set(eps) for i, eps in rest.items()}, rows)


def test_a_finished_result_recorded_by_rl_survives_a_crash_and_comes_back_not_rerun(
        world: World) -> None:
    path = world.path("ckpt")
    done = Ep("holder-0-r0", 0)

    async def scenario() -> None:
        live = await world.populate()
        client = await world.client("holder-0")
        await client.finish(done, b"result-r0")
        async with world.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(recorded(live, done))  # RL recorded it already
        assert snap.metrics(0.0)["finished_rollouts"] == 1.0
        manifest = read_manifest(path)
        assert manifest.format_version == FORMAT_VERSION
        assert sum(s.finished or 0 for s in manifest.shards) == 1
        # The tools read it: the finished session with its result, the rest as before.
        assert verify_snapshot(path).ok
        held = {r.episode: r for rs in read_snapshot(path).sessions.values() for r in rs}
        assert held[done].result == b"result-r0" and held[done].finished
        assert not held[Ep("holder-0-r1", 0)].finished and len(held) == 6
        # The job crashes: every holder goes, and a new job restores the snapshot.
        world.ckpt.shutdown()
        await world.ckpt.ensure_holders()
        async with world.ckpt.restored(path) as restored:
            results = world.ckpt.restored_results
            continued = restored.continued_attempts
            keys = restored.staging_keys
        assert results == (FinishedRollout("holder-0", done, b"result-r0"),)
        assert ("holder-0", done.rollout_id, 0) not in continued
        assert len(continued) == 5  # every other rollout continues
        assert {"holder-0-r0/row0", "holder-0-r0/row1"} <= keys
        # Live again, finished, at its attempt: no turn runs; acknowledging drops it.
        client = await world.client("holder-0")
        session = await client.get(done)
        assert session.result == b"result-r0" and len(session.turns) == 2
        with pytest.raises(RolloutFinishedError):
            async with client.turn(done) as turn:
                turn.complete(b"t", b"s")
        assert await world.ckpt.acknowledge([done]) == ["holder-0-r0"]
        assert done.rollout_id not in {r.episode.rollout_id for r in await client.sessions()}

    world.run(scenario())


def test_a_finish_during_a_snapshot_waits_for_the_pause_and_the_snapshot_holds_it_unfinished(
        world: World) -> None:
    path = world.path("ckpt")
    done = Ep("holder-1-r1", 0)

    async def scenario() -> None:
        live = await world.populate()
        client = await world.client("holder-1")
        finishing: asyncio.Task[object] | None = None
        async with world.ckpt.snapshot(path) as snap:
            assert snap is not None
            finishing = asyncio.ensure_future(client.finish(done, b"late"))
            await asyncio.sleep(1.0)
            assert not finishing.done()  # held at the paused holder's gate
            await snap.check_against_cut(cut_of(live))  # RL has not recorded it either
        await finishing
        assert snap.metrics(0.0).get("finished_rollouts") == 0.0
        # The next snapshot meets it finished, whether or not RL has recorded it yet.
        async with world.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(cut_of(live))
        async with world.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(recorded(live, done))
        assert snap.metrics(0.0)["finished_rollouts"] == 1.0

    world.run(scenario())


def test_acknowledge_during_an_open_snapshot_waits_for_its_end_where_retire_refuses(
        world: World) -> None:
    path = world.path("ckpt")
    done = Ep("holder-2-r0", 0)

    async def scenario() -> None:
        live = await world.populate()
        client = await world.client("holder-2")
        await client.finish(done, b"r")
        acknowledged: asyncio.Task[list[str]] | None = None
        async with world.ckpt.snapshot(path) as snap:
            assert snap is not None
            with pytest.raises(SnapshotInProgressError):
                await world.ckpt.retire([done])
            acknowledged = asyncio.ensure_future(world.ckpt.acknowledge([done]))
            await asyncio.sleep(1.0)
            assert not acknowledged.done()
            await snap.check_against_cut(recorded(live, done))
        assert await acknowledged == ["holder-2-r0"]
        async with world.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(recorded(live, done))
        assert snap.metrics(0.0)["finished_rollouts"] == 0.0
        assert snap.captured_rollouts == 5

    world.run(scenario())


def test_a_second_finish_with_another_result_is_refused_and_the_first_stays(
        world: World) -> None:
    done = Ep("holder-0-r1", 0)

    async def scenario() -> None:
        await world.populate()
        client = await world.client("holder-0")
        await client.finish(done, b"first")
        assert (await client.finish(done, b"first")).result == b"first"  # a retry
        with pytest.raises(RolloutFinishedError):
            await client.finish(done, b"second")
        assert (await client.get(done)).result == b"first"

    world.run(scenario())


def test_a_snapshot_with_rows_no_session_references_warns_what_that_usually_means(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        cut = cut_of(live)
        leaked = StaticCut(cut.expected_episodes(), cut.staging_keys() | {"r9/row0"})
        async with world.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(leaked)
        assert snap.metrics(0.0)["orphan_staging_rows"] == 1.0

    with caplog.at_level(logging.WARNING, logger="nemo_ckpt"):
        world.run(scenario())
    warning = [r.getMessage() for r in caplog.records if "no captured session" in
               r.getMessage()]
    assert len(warning) == 1
    assert "r9/row0" in warning[0] and "move its rows out of staging" in warning[0]


# --- the cut check on finished sessions ----------------------------------------------------


def test_the_cut_accepts_a_finished_session_rl_no_longer_expects_without_its_rows() -> None:
    done, running = Ep("r0", 0), Ep("r1", 0)
    cut = StaticCut({"holder-0": {running}}, {"r1/t0"})
    result = check_capture_against_cut(
        cut, {"holder-0": {done: frozenset({"r0/t0"}), running: frozenset({"r1/t0"})}},
        finished={"holder-0": frozenset({done})})
    assert result.finished == frozenset({("holder-0", done)})
    assert not result.not_held and not result.orphan_staging_keys


def test_a_finished_session_rl_has_not_recorded_keeps_its_rows_from_being_orphans() -> None:
    done = Ep("r0", 0)
    cut = StaticCut({"holder-0": {done}}, {"r0/t0", "r0/t1"})
    result = check_capture_against_cut(
        cut, {"holder-0": {done: frozenset({"r0/t0", "r0/t1"})}},
        finished={"holder-0": frozenset({done})})
    assert result.finished == frozenset({("holder-0", done)})
    assert not result.orphan_staging_keys and not result.not_held


def test_the_cut_refuses_a_finished_session_whose_rollout_rl_expects_elsewhere() -> None:
    done = Ep("r0", 0)
    cut = StaticCut({"holder-1": {Ep("r0", 1)}}, set())
    with pytest.raises(SnapshotMismatchError) as raised:
        check_capture_against_cut(cut, {"holder-0": {done: frozenset()}},
                                  finished={"holder-0": frozenset({done})})
    assert [d.kind for d in raised.value.differences] == ["unexpected_episode"]


def test_the_cut_still_refuses_an_unfinished_session_rl_no_longer_expects() -> None:
    running = Ep("r0", 0)
    with pytest.raises(SnapshotMismatchError):
        check_capture_against_cut(StaticCut({}, {"r0/t0"}),
                                  {"holder-0": {running: frozenset({"r0/t0"})}})


# --- the format --------------------------------------------------------------------------


def _manifest(version: int, finished: int | None) -> dict[str, object]:
    shard: dict[str, object] = {"file": "shard-a.msgpack", "bytes": 1, "sessions": 2,
                                "instance_id": "holder-0", "content_hash": "sha256:" + "0" * 64}
    if finished is not None:
        shard["finished"] = finished
    return {"format_version": version, "snapshot_id": "s", "created_at": "2026-12-03T00:00:00Z",
            "instances": ["holder-0"], "shards": [shard], "restarted_rollouts": 0,
            "metrics": {}}


def test_format_5_names_its_finished_sessions_and_no_older_format_may() -> None:
    def read(data: dict[str, object]) -> Manifest:
        return Manifest.model_validate_json(json.dumps(data))

    assert read(_manifest(5, 1)).shards[0].finished == 1
    for bad in (_manifest(5, None), _manifest(3, 1), _manifest(5, 3)):
        with pytest.raises(ValueError):
            read(bad)
    assert read(_manifest(3, None)).format_version == 3


# --- crashes at every point of a rollout's cycle, on the simulated world -------------------


class Ledger:
    """RL's half, in memory: the ledger, staging rows, recorded trajectories."""

    def __init__(self) -> None:
        self.entries: dict[str, list[Any]] = {}  # rollout -> [instance, attempt, status]
        self.staging: dict[str, str] = {}
        self.done: dict[str, list[bytes]] = {}
        self.recorded = 0  # how many finishes were recorded, over every life

    def dispatch(self, rollout_id: str, instance_id: str) -> Ep:
        entry = self.entries.get(rollout_id)
        attempt = 0 if entry is None else entry[1] + 1
        self.entries[rollout_id] = [instance_id, attempt, "dispatched"]
        return Ep(rollout_id, attempt)

    def finish(self, episode: Ep, records: list[bytes]) -> None:
        entry = self.entries[episode.rollout_id]
        if entry[2] == "finished":
            return
        entry[2] = "finished"
        self.done[episode.rollout_id] = list(records)
        self.recorded += 1
        attempts = {Ep(episode.rollout_id, a).capture_key for a in range(episode.attempt + 1)}
        for key in [k for k in self.staging if k.split("/", 1)[0] in attempts]:
            del self.staging[key]

    def cut(self) -> StaticCut:
        expected: dict[str, set[Ep]] = {}
        for rollout_id, (instance_id, attempt, status) in self.entries.items():
            if status == "dispatched":
                expected.setdefault(instance_id, set()).add(Ep(rollout_id, attempt))
        return StaticCut(expected, set(self.staging))

    def restore(self, saved: Ledger, continued_attempts: frozenset[tuple[str, str, int]],
                staging_keys: frozenset[str], results: tuple[FinishedRollout, ...]
                ) -> tuple[list[tuple[str, Ep]], list[str]]:
        self.entries = copy.deepcopy(saved.entries)
        self.staging = {k: v for k, v in saved.staging.items() if k in staging_keys}
        self.done = copy.deepcopy(saved.done)
        continued = []
        for instance_id, rollout_id, attempt in sorted(continued_attempts):
            assert self.entries[rollout_id][:2] == [instance_id, attempt]
            self.entries[rollout_id][1] = attempt + 1
            continued.append((instance_id, Ep(rollout_id, attempt + 1)))
        for result in results:
            self.finish(result.episode, [r.encode() for r in json.loads(result.result)])
        continued_ids = {r for _, r, _ in continued_attempts}
        restart = sorted(r for r, e in self.entries.items()
                         if e[2] == "dispatched" and r not in continued_ids)
        return continued, restart


CYCLE = ["dispatch", "turn", "finish", "record", "acknowledge"]


@pytest.mark.parametrize("crash_after", CYCLE)
def test_a_crash_after_any_step_of_a_rollout_loses_no_finished_rollout_and_runs_none_twice(
        world: World, crash_after: str) -> None:
    path = world.path("ckpt")
    turns_run: collections.Counter[str] = collections.Counter()
    rl = Ledger()

    async def run(instance_id: str, episode: Ep, fresh: bool, turns: int = 2) -> list[bytes]:
        client = await world.client(instance_id)
        if fresh:
            await client.open(episode, b"s0")
        session = await client.get(episode)
        for t in range(len(session.turns), turns):
            async with client.turn(episode) as turn:
                key = f"{episode.capture_key}/t{t}"
                rl.staging[key] = "row"  # inside the turn
                turns_run[episode.rollout_id] += 1
                turn.complete(f"t{t}".encode(), f"s{t + 1}".encode(), [key])
        return list((await client.get(episode)).turns)

    async def hand_in(instance_id: str, episode: Ep, records: list[bytes]) -> None:
        client = await world.client(instance_id)
        await client.finish(episode, json.dumps([r.decode() for r in records]).encode())

    async def record(episode: Ep) -> None:
        rl.finish(episode, [b"t0", b"t1"])

    async def to_the_end(instance_id: str, episode: Ep, fresh: bool) -> None:
        records = await run(instance_id, episode, fresh)
        await hand_in(instance_id, episode, records)
        rl.finish(episode, records)
        await world.ckpt.acknowledge([episode])

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        background = rl.dispatch("b", "holder-1")
        await run("holder-1", background, fresh=True, turns=1)
        episode = rl.dispatch("s", "holder-0")
        steps = {
            "turn": lambda: run("holder-0", episode, fresh=True),
            "finish": lambda: hand_in("holder-0", episode, [b"t0", b"t1"]),
            "record": lambda: record(episode),
            "acknowledge": lambda: world.ckpt.acknowledge([episode]),
        }
        for step in CYCLE[1:CYCLE.index(crash_after) + 1]:
            await steps[step]()
        async with world.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(rl.cut())
            saved = copy.deepcopy(rl)
        ran_before = dict(turns_run)
        # The crash: every holder goes; a new job restores both halves.
        world.ckpt.shutdown()
        await world.ckpt.ensure_holders()
        async with world.ckpt.restored(path) as restored:
            results = world.ckpt.restored_results
            continued, restart = rl.restore(saved, restored.continued_attempts,
                                            restored.staging_keys, results)
        await world.ckpt.acknowledge([r.episode for r in results])
        assert bool(results) == (crash_after in ("finish", "record"))  # unacknowledged
        await asyncio.gather(*(to_the_end(i, ep, fresh=False) for i, ep in continued),
                             *(to_the_end("holder-0" if r == "s" else "holder-1",
                                          rl.dispatch(r, "holder-0" if r == "s"
                                                      else "holder-1"), fresh=True)
                               for r in restart))
        # Not lost: recorded once, whole. Not run twice: no turn of it ran again.
        assert rl.done["s"] == [b"t0", b"t1"]
        assert turns_run["s"] - ran_before.get("s", 0) == (2 if crash_after == "dispatch"
                                                          else 0)
        assert not rl.staging  # every finished rollout's rows left staging
        assert not [s for s in await (await world.client("holder-0")).sessions()]

    world.run(scenario())


def test_a_restore_whose_block_raises_hands_no_result_back_and_installs_nothing(
        world: World) -> None:
    path = world.path("ckpt")
    done = Ep("holder-1-r0", 0)

    async def scenario() -> None:
        live = await world.populate()
        await (await world.client("holder-1")).finish(done, b"r")
        async with world.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(cut_of(live))
        world.ckpt.shutdown()
        await world.ckpt.ensure_holders()
        with pytest.raises(RuntimeError, match="RL's restore failed"):
            async with world.ckpt.restored(path):
                assert len(world.ckpt.restored_results) == 1
                raise RuntimeError("RL's restore failed")
        assert world.ckpt.restored_results == ()
        assert await (await world.client("holder-1")).sessions() == []

    world.run(scenario())
