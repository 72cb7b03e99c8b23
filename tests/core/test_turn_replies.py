"""A worker's calls whose answer is lost after they ran (issue 34, case 3): Ray delivers
a call at most once, and a connection reset leaves the caller not knowing whether it
ran. A turn's commit is resolved by asking its holder, never guessed; an open repeated
after a lost answer changes nothing. The real client and holder, on the simulation's
transport under virtual time (``tests/harness.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.sim import ActorDied, SimActor
from nemo_ckpt.errors import (
    BackendUnavailableError,
    SessionExistsError,
    TurnInProgressError,
    TurnOutcomeUnknownError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.sessions import SessionClient
from tests.harness import World

pytestmark = pytest.mark.timeout(60)


def lose_answers(world: World, *methods: str) -> list[str]:
    """Lose the answer of every call of ``methods`` that ran; the methods it lost."""
    lost: list[str] = []

    def lose(target: SimActor, method: str) -> bool:
        if method in methods:
            lost.append(method)
            return True
        return False

    world.sim.lose_reply = lose
    return lost


async def opened(world: World) -> tuple[SessionClient, Ep]:
    await world.ckpt.ensure_holders()
    instance = sorted(world.holders())[0]
    client = await world.client(instance)
    ep = Ep("r", 0)
    await client.open(ep, b"s0")
    return client, ep


async def run_turn(client: SessionClient, ep: Ep, step: int) -> None:
    async with client.turn(ep) as turn:
        turn.complete(f"t{step}".encode(), f"s{step + 1}".encode(), [f"r/row{step}"])


def test_a_turn_knows_its_count_and_reads_only_the_earlier_records_it_asks_for(
        tmp_path: Path) -> None:
    world = World(tmp_path)

    async def scenario() -> None:
        client, ep = await opened(world)
        for step in range(5):
            await run_turn(client, ep, step)
        async with client.turn(ep) as turn:
            assert (turn.turn_count, turn.state) == (5, b"s5")
            assert await turn.read_turns() == tuple(f"t{n}".encode() for n in range(5))
            assert await turn.read_turns(-1) == (b"t4",)
            assert await turn.read_turns(1, 3) == (b"t1", b"t2")
            assert await turn.read_turns(7) == ()
            turn.complete(b"t5", b"s6", ["r/row5"])
        assert (turn.session.turn_count, turn.session.state, turn.turn_count) == (6, b"s6", 5)
        assert await client.read_turns(ep, 4) == (b"t4", b"t5")

    try:
        world.run(scenario(), world.worker)
    finally:
        world.close()


def test_a_commit_whose_answer_is_lost_returns_the_committed_session_once(
        tmp_path: Path) -> None:
    world = World(tmp_path)

    async def scenario() -> None:
        client, ep = await opened(world)
        lost = lose_answers(world, "commit_turn")
        async with client.turn(ep) as turn:
            turn.complete(b"t0", b"s1", ["r/row0"])
        assert lost == ["commit_turn"]  # the block exited cleanly all the same
        assert (turn.session.turn_count, turn.session.state) == (1, b"s1")
        world.sim.lose_reply = lambda target, method: False
        await run_turn(client, ep, 1)
        session = await client.get(ep)
        assert session.turns == (b"t0", b"t1")
        assert session.staging_keys == {"r/row0", "r/row1"}

    try:
        world.run(scenario(), world.worker)
    finally:
        world.close()


def test_a_commit_that_never_arrives_is_reported_not_recorded_and_the_retry_records_once(
        tmp_path: Path) -> None:
    world = World(tmp_path)

    async def scenario() -> None:
        client, ep = await opened(world)
        holder = next(iter(world.holders().values()))
        original = holder.commit_turn

        async def reset(*args: object) -> None:  # the connection reset before it ran
            raise ActorDied("connection reset")

        holder.commit_turn = reset
        with pytest.raises(BackendUnavailableError, match="did not commit") as caught:
            await run_turn(client, ep, 0)
        assert world.ckpt.is_unavailable(caught.value)
        assert (await client.get(ep)).turns == ()  # unchanged
        holder.commit_turn = original
        await run_turn(client, ep, 0)  # the worker retries, as is_unavailable says
        assert (await client.get(ep)).turns == (b"t0",)

    try:
        world.run(scenario(), world.worker)
    finally:
        world.close()


def test_a_holder_that_cannot_be_asked_leaves_the_turn_unknown_not_unavailable(
        tmp_path: Path) -> None:
    world = World(tmp_path)

    async def scenario() -> None:
        client, ep = await opened(world)
        client.resolve_s = 5.0
        lose_answers(world, "commit_turn", "resolve_turn")
        with pytest.raises(TurnOutcomeUnknownError, match="may have been recorded") as caught:
            await run_turn(client, ep, 0)
        assert not world.ckpt.is_unavailable(caught.value)
        assert "client.get(episode)" in str(caught.value)
        world.sim.lose_reply = lambda target, method: False
        assert (await client.get(ep)).turns == (b"t0",)  # what the worker reads to decide

    try:
        world.run(scenario(), world.worker)
    finally:
        world.close()


def test_a_turn_resolved_as_not_committed_can_no_longer_commit(tmp_path: Path) -> None:
    world = World(tmp_path)

    async def scenario() -> None:
        _, ep = await opened(world)
        holder = next(iter(world.holders().values()))
        await holder.begin_turn(ep, "tok-a")
        assert await holder.resolve_turn(ep, "tok-a") is None  # its commit still travels
        with pytest.raises(TurnInProgressError, match="no turn in flight"):
            await holder.commit_turn(ep, "tok-a", b"t0", b"s1")
        assert (await holder.get_session(ep)).turns == ()
        await holder.begin_turn(ep, "tok-b")
        await holder.commit_turn(ep, "tok-b", b"t0", b"s1")
        committed = await holder.resolve_turn(ep, "tok-b")
        assert committed is not None and committed.turn_count == 1
        assert (await holder.get_session(ep)).turns == (b"t0",)  # asking changed nothing

    try:
        world.run(scenario(), world.worker)
    finally:
        world.close()


def test_an_open_repeated_after_its_answer_was_lost_changes_nothing(tmp_path: Path) -> None:
    world = World(tmp_path)

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        client = await world.client(sorted(world.holders())[0])
        ep = Ep("r", 0)
        lose_answers(world, "open_session", "open_sessions")
        with pytest.raises(BackendUnavailableError):
            await client.open(ep, b"s0")
        with pytest.raises(BackendUnavailableError):
            await client.open_many([(Ep("q", 0), b"q0"), (Ep("p", 0), b"p0")])
        world.sim.lose_reply = lambda target, method: False
        again = await client.open(ep, b"s0")  # the retry: the session as opened
        assert (again.episode, again.turns, again.state) == (ep, (), b"s0")
        assert await client.open_many([(Ep("q", 0), b"q0"), (Ep("p", 0), b"p0")]) == 2
        assert sorted(s.episode.rollout_id for s in await client.sessions()) == ["p", "q", "r"]
        await run_turn(client, ep, 0)
        with pytest.raises(SessionExistsError, match="already open"):  # not a retry any more
            await client.open(ep, b"s0")
        with pytest.raises(SessionExistsError, match="already open"):  # another initial state
            await client.open(Ep("q", 0), b"other")

    try:
        world.run(scenario(), world.worker)
    finally:
        world.close()
