"""What an environment worker uses to run sessions on its holder: ``SessionClient`` and
the ``Turn`` it hands out. The session's data is ``nemo_ckpt.session_record``.

The client reaches its holder through a ``Transport``. The core does not import the Ray
side: without a ``transport``, ``connect`` uses the one registered with
``register_default_transport`` (``nemo_ckpt.driver`` registers Ray's on import), else the
installed runtime's (``nemo_ckpt.transport.runtime_transport``: Ray's), so a worker that
imports only ``SessionClient`` gets Ray's too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from nemo_ckpt.errors import (
    BackendUnavailableError,
    SessionNotFoundError,
    TurnOutcomeUnknownError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.phases import HolderInfo, instance_sort_key
from nemo_ckpt.protocol.holder_api import holder_calls, probe_calls, session_calls
from nemo_ckpt.sandbox_backend import ContainerRef
from nemo_ckpt.session_record import SessionHead, SessionRecord, check_staging_keys
from nemo_ckpt.transport import Actor, Transport

__all__ = ["SessionClient", "Turn", "register_default_transport"]

# Seconds between two questions to a holder that did not answer ``resolve_turn``.
_RESOLVE_RETRY_S = 0.5

# namespace -> the transport ``SessionClient.connect`` uses when it is given none.
_default_transport: Callable[[str], Transport] | None = None


def register_default_transport(factory: Callable[[str], Transport] | None
                               ) -> Callable[[str], Transport] | None:
    """Make ``factory(namespace)`` the transport of ``SessionClient.connect`` calls that
    pass none (``nemo_ckpt.driver`` registers Ray's; None: the installed runtime's);
    returns the one it replaces."""
    global _default_transport
    previous, _default_transport = _default_transport, factory
    return previous


def _installed_transport(namespace: str) -> Transport:
    """The installed runtime's transport (Ray's, by its entry point) for ``namespace``."""
    from nemo_ckpt.config import CheckpointConfig
    from nemo_ckpt.transport import runtime_transport

    return runtime_transport(CheckpointConfig(namespace=namespace))


class Turn:
    """One turn in flight: read the session as it was, then ``complete`` it.

    A turn carries the session's state and turn count, not its turn records, so its
    cost does not grow with the rollout's length: ``await read_turns()`` fetches the
    earlier records a turn needs. ``session`` is the session's ``SessionHead``: as the
    turn began, and once it committed, as the commit left it.

    The turn commits when its ``async with`` block exits cleanly after ``complete``;
    on an exception, or without ``complete``, it aborts and records nothing.
    """

    def __init__(self, session: SessionHead,
                 read: Callable[[int, int | None], Awaitable[list[bytes]]]) -> None:
        self.session = session
        self._read = read
        self._begun_at = session.turn_count
        self._result: tuple[bytes, bytes, frozenset[str]] | None = None

    @property
    def state(self) -> bytes:
        """The environment state after the session's last committed turn."""
        return self.session.state

    @property
    def turn_count(self) -> int:
        """How many turns the session had committed when this one began (over all its
        attempts): this turn's index."""
        return self._begun_at

    async def read_turns(self, start: int = 0, stop: int | None = None
                         ) -> tuple[bytes, ...]:
        """The session's turn records before this turn, ``start`` to ``stop`` as a
        slice's bounds (negative from the end), oldest first; fetched from the holder
        now, and only those asked for."""
        first, last, _ = slice(start, stop).indices(self._begun_at)
        if last <= first:
            return ()
        return tuple(await self._read(first, last))

    @property
    def directory(self) -> Path | None:
        """The session's sandbox directory, if it owns one: change it only inside turns."""
        d = self.session.directory
        return None if d is None else Path(d)

    @property
    def container(self) -> str | None:
        """The name of the session's container, if it owns one: change it only inside
        turns (``podman exec``)."""
        return self.session.container

    def complete(self, record: bytes, state: bytes, staging_keys: Iterable[str] = ()) -> None:
        """Set what the turn commits: its record, the new state, the staging rows it wrote.

        Write every staging row before the block exits: the row must exist in the data
        plane before the turn that references it commits. Raises TypeError at once for
        a record or state that is not bytes, or staging keys that are not strings.
        """
        where = self.session.episode.capture_key
        for what, data in (("turn record", record), ("state", state)):
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"{what} of {where} must be bytes, not "
                                f"{type(data).__name__}; serialize it in the environment")
        self._result = (record, state, check_staging_keys(staging_keys, where))


class SessionClient:
    """What an environment worker uses to open, run and close sessions on its holder.

    ``await SessionClient.connect()`` finds the holder on the worker's own node;
    ``connect(instance_id=...)`` finds a named instance (after a restore onto fewer
    nodes, a node may host several). A rollout continued after a restore goes back to
    the instance that captured it (``RestoredEnvironmentRollouts.continued_attempts``).

    Usage::

        client = await SessionClient.connect()
        await client.open(episode, state=initial_state)
        async with client.turn(episode) as turn:
            new_state, record, rows = run_tool_call(turn.state)
            turn.complete(record, new_state, rows)     # commits when the block exits
        final = await client.close(episode)
    """

    # Seconds a turn whose commit got no answer keeps asking its holder whether it
    # committed (``resolve_turn``) before it raises ``TurnOutcomeUnknownError``.
    resolve_s: float = 30.0

    def __init__(self, holder: Actor, transport: Transport) -> None:
        # None once a call found it dead or unreachable: the next call looks its
        # instance's name up again (check_startup may have made a successor).
        self._holder: Actor | None = holder
        self._transport = transport
        self.instance_id = holder.name
        # An async actor may run calls out of order, so a session's next turn waits for
        # the abort of its last one.
        self._aborting: dict[str, asyncio.Future[Any]] = {}
        self._holder_calls = session_calls(self._call)
        self._probe_calls = probe_calls(self._call)

    @classmethod
    async def connect(
        cls, instance_id: str | None = None, namespace: str = "nemo_ckpt",
        transport: Transport | None = None,
    ) -> SessionClient:
        """Find the holder of ``instance_id``, or the first holder on this node.

        ``transport`` defaults to the registered one (Ray's), for ``namespace``."""
        if transport is None:
            transport = (_default_transport or _installed_transport)(namespace)
        namespace = transport.namespace
        if instance_id is not None:
            handle = transport.holder(instance_id)
            if handle is None:
                raise SessionNotFoundError(
                    f"no session holder {instance_id!r} in namespace {namespace!r}; it was "
                    f"never created or its node died; RayEnvironmentCheckpoint."
                    f"ensure_holders() creates holders")
            return cls(handle, transport)
        node = transport.local_node()
        handles = transport.holders()
        infos = {}
        for inst, handle in handles.items():
            with contextlib.suppress(Exception):
                infos[inst] = await holder_calls(transport, handle, None).info()
        here = sorted((i for i, info in infos.items() if info.node_id == node),
                      key=instance_sort_key)
        if not here:
            raise SessionNotFoundError(
                f"no session holder on node {node} in namespace {namespace!r}; call "
                f"RayEnvironmentCheckpoint.check_startup() or ensure_holders() before "
                f"starting environment workers")
        return cls(handles[here[0]], transport)

    def _call(self, method: str, *args: Any, timeout: float | None = None
              ) -> Awaitable[Any]:
        """Send ``method`` to the instance's holder now; its result's awaitable."""
        if self._holder is None:
            self._holder = self._transport.holder(self.instance_id)
            if self._holder is None:
                error = BackendUnavailableError(
                    f"holder {self.instance_id} is not running (its process or node died); "
                    f"retry once RayEnvironmentCheckpoint.check_startup() or "
                    f"ensure_holders() has started its successor")
                error.unreachable = "holder"
                raise error
        return self._result(self._holder, self._transport.call(self._holder, method, *args,
                                                               timeout=timeout))

    async def _result(self, holder: Actor, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except BackendUnavailableError:
            if self._holder is holder:
                self._holder = None
            raise

    async def open(self, episode: EnvironmentEpisode, state: bytes = b"",
                   directory: str | os.PathLike[str] | None = None, *,
                   container: str | ContainerRef | None = None,
                   restart_only: bool = False) -> SessionRecord:
        """Open a session for ``episode`` with its initial state and, optionally, the
        sandbox it owns on this node (``nemo_ckpt.sandbox_backend`` says what each
        class of environment gets):

        - ``directory``: a folder inside ``CheckpointConfig.sandbox_root``; its tree is
          recorded now and at every turn commit, and a restore gives the continued
          attempt its copy (``SessionRecord.directory``);
        - ``container``: a container on this node's podman, by name (or a
          ``ContainerRef`` saying what it needs of its memory), with
          ``CheckpointConfig.containers`` on: its filesystem changes, and its
          processes' memory where CRIU works, are recorded now and at every turn
          commit; a restore creates the continued attempt's container
          (``SessionRecord.container``). Change it only inside turns;
        - ``restart_only``: what the environment holds cannot be captured: snapshots
          report the session restarting and RL starts it over after a crash.
        """
        if directory is not None and container is not None:
            raise ValueError(f"session {episode.capture_key}: give a directory or a "
                             f"container, not both")
        sandbox: str | ContainerRef | None = None
        if directory is not None:
            sandbox = os.fspath(directory)
        elif container is not None:
            sandbox = container if isinstance(container, ContainerRef) \
                else ContainerRef(container)
        return await self._holder_calls.open_session(episode, state, sandbox, restart_only)

    async def open_many(self, sessions: Iterable[tuple[EnvironmentEpisode, bytes]]) -> int:
        """Open many sessions in one call: ``(episode, initial state)`` each, all or none
        (a batch of rollouts, a group of samples per prompt). Returns how many."""
        return int(await self._holder_calls.open_sessions(list(sessions)))

    async def get(self, episode: EnvironmentEpisode) -> SessionRecord:
        """The live session of ``episode``, every turn record with it."""
        return await self._holder_calls.get_session(episode.capture_key)

    async def read_turns(self, episode: EnvironmentEpisode, start: int = 0,
                         stop: int | None = None) -> tuple[bytes, ...]:
        """Turn records ``start`` to ``stop`` (a slice's bounds; None: to the last) of
        ``episode``'s live session; only those travel."""
        return tuple(await self._holder_calls.read_turns(episode.capture_key, start, stop))

    @contextlib.asynccontextmanager
    async def turn(self, episode: EnvironmentEpisode) -> AsyncIterator[Turn]:
        """Run one turn of ``episode``'s session. Waits while the holder is paused.

        The caller owns the turn: its token is made here, so a turn whose caller goes
        away (an exception, a cancellation, even while waiting at a closed gate) is
        aborted with it, and never stays open on the holder. A dead worker's turn ends
        at ``CheckpointConfig.turn_timeout_s``.

        A commit that gets no answer is resolved by asking the holder: the block exits
        cleanly if the turn committed; ``BackendUnavailableError`` (retry: nothing was
        recorded) if not; ``TurnOutcomeUnknownError`` if the holder could not be asked
        within ``resolve_s``."""
        pending = self._aborting.get(episode.capture_key)
        if pending is not None:
            await asyncio.wait([pending])
        token = self._transport.runtime.token()
        try:
            session = await self._holder_calls.begin_turn(episode, token)
        except BaseException:
            self._abort(episode, token)  # its begin may still be on its way
            raise
        turn = Turn(session, functools.partial(self._holder_calls.read_turns, episode))
        try:
            yield turn
        except BaseException:
            self._abort(episode, token)
            raise
        if turn._result is None:
            self._abort(episode, token)
            raise ValueError(
                f"turn of {episode.capture_key} exited without turn.complete(record, "
                f"state, staging_keys); nothing was recorded")
        record, state, keys = turn._result
        try:
            turn.session = await self._holder_calls.commit_turn(episode, token, record,
                                                               state, keys)
        except BackendUnavailableError as lost:
            # The commit may have run and only its answer been lost: ask, don't guess.
            turn.session = await self._resolve(episode, token, lost)
        except BaseException:
            self._abort(episode, token)
            raise

    async def _resolve(self, episode: EnvironmentEpisode, token: str,
                       lost: BackendUnavailableError) -> SessionHead:
        """The outcome of a commit that got no answer, from its holder (``resolve_turn``),
        asked again until ``resolve_s`` has passed: the session as the commit left it,
        or, when the turn did not commit (and now never will), ``lost`` said again as
        "nothing was recorded, retry". If the holder cannot be asked in time,
        ``TurnOutcomeUnknownError``: the turn may have been recorded."""
        clock = self._transport.runtime.clock
        deadline = clock.monotonic() + self.resolve_s
        key = episode.capture_key
        why: BaseException = lost
        try:
            while (remaining := deadline - clock.monotonic()) > 0:
                calls = session_calls(functools.partial(self._call, timeout=remaining))
                try:
                    session = await calls.resolve_turn(episode, token)
                except BackendUnavailableError as exc:
                    why = exc
                    await asyncio.sleep(min(_RESOLVE_RETRY_S, max(0.0, remaining)))
                    continue
                if session is not None:
                    return session
                error = BackendUnavailableError(
                    f"holder {self.instance_id} did not answer the commit of a turn of "
                    f"{key} ({lost}); asked, it says the turn did not commit, and it is "
                    f"aborted: nothing was recorded; retry the turn")
                error.unreachable, error.timed_out = lost.unreachable, lost.timed_out
                raise error from lost
        except BaseException as exc:
            if not isinstance(exc, BackendUnavailableError):
                self._abort(episode, token)  # gone before the answer: it never commits late
            raise
        raise TurnOutcomeUnknownError(
            f"holder {self.instance_id} did not answer the commit of a turn of {key} "
            f"({lost}), nor, within {self.resolve_s:g}s, whether it committed ({why}): "
            f"the turn may have been recorded. Do not run it again blindly: read the "
            f"session (client.get(episode)) once the holder answers and compare its turn "
            f"count with the one this turn began at") from lost

    def _abort(self, episode: EnvironmentEpisode, token: str) -> None:
        """Abort a turn without waiting: sent even from a cancelled task. Its outcome
        only orders the session's next turn; a failed abort leaves the turn to
        ``turn_timeout_s`` and the next begin reports what is wrong."""
        key = episode.capture_key
        try:
            sent = self._holder_calls.abort_turn(episode, token)
        except asyncio.CancelledError:
            return  # this process is going away; its turns end at turn_timeout_s
        except Exception:  # no holder to abort at: its turns died with it
            return
        done = asyncio.ensure_future(sent)
        self._aborting[key] = done

        def forget(f: asyncio.Future[Any]) -> None:
            if not f.cancelled():
                f.exception()
            if self._aborting.get(key) is f:
                del self._aborting[key]
        done.add_done_callback(forget)

    async def finish(self, episode: EnvironmentEpisode, result: bytes) -> SessionRecord:
        """Hand in ``episode``'s finished rollout with its ``result`` (bytes the
        environment serializes). The holder keeps both, finished, until RL acknowledges
        them (``RayEnvironmentCheckpoint.acknowledge``); a snapshot captures the result,
        and a restore hands it back to RL instead of running the rollout again
        (``nemo_ckpt.receipts``). Waits while a snapshot pauses the holder."""
        pending = self._aborting.get(episode.capture_key)
        if pending is not None:  # an aborted last turn would refuse the finish
            await asyncio.wait([pending])
        return await self._holder_calls.finish_session(episode, result)

    async def close(self, episode: EnvironmentEpisode) -> SessionRecord:
        """Close ``episode``'s finished session and return its final record."""
        return await self._holder_calls.close_session(episode.capture_key)

    async def sessions(self) -> list[SessionRecord]:
        """Every live session of this instance."""
        return await self._holder_calls.sessions()

    async def holder_info(self) -> HolderInfo:
        """Its holder's identity, state and options (``sandbox_root`` among them)."""
        return await self._probe_calls.info()

    async def replay_diverged(self, episode: EnvironmentEpisode, detail: str) -> int:
        """Report that ``episode``'s continued rollout starts over because replaying its
        recorded steps returned something else (``detail`` says what): the holder logs
        it as a warning and counts it in the next snapshot's ``replay_restarted_rollouts``
        metric. Returns the holder's count so far."""
        return int(await self._holder_calls.replay_diverged(episode, detail))
