"""The holder's session calls: sessions opened, read, finished and closed, from
environment workers (``nemo_ckpt.protocol.holder_api.HolderSessions``), and the ledger's
calls from RL through the coordinator (``retire``, ``forget``), with the checks they
make of what they are given. A session's turns are the part beside it
(``actors.holder.turns.Turns``), which finds and checks their session here
(``Sessions.held``, ``check_episode``, ``check_size``).
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack

from actors.holder.parts import HolderParts
from actors.holder.session_table import Held
from nemo_ckpt.errors import (
    CaptureKeyCollisionError,
    RetiredAttemptError,
    RolloutFinishedError,
    SandboxError,
    SessionExistsError,
    SessionNotFoundError,
    StateTooLargeError,
    TurnInProgressError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.protocol.holder_api import OpeningSessions
from nemo_ckpt.sandbox_backend import ContainerRef, SandboxLocation
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.storage.names import sandbox_id_problem

__all__ = ["Sessions"]

log = logging.getLogger("nemo_ckpt.holder")

# A session to open, checked: episode, initial state, sandbox, restart-only.
_Opening = tuple[EnvironmentEpisode, bytes, SandboxLocation | None, bool]


class Sessions:
    """The session calls (but for turns) and the ledger's calls of one holder."""

    def __init__(self, parts: HolderParts, max_state_bytes: int) -> None:
        self._parts = parts
        self.instance_id = parts.instance_id
        self._max_state_bytes = max_state_bytes
        self._runtime = parts.runtime
        self._table = parts.table
        self._gate = parts.gate
        self._sandboxes = parts.sandboxes

    # --- sessions (from environment workers) -------------------------------------------

    async def open_session(
        self, episode: EnvironmentEpisode, state: bytes = b"",
        directory: str | ContainerRef | None = None, restart_only: bool = False,
    ) -> SessionRecord:
        """Open a session for ``episode`` with its initial state, and the sandbox it
        owns, if any: a ``directory`` (inside ``sandbox_root``) or a container (a
        ``ContainerRef``), recorded now, as the session's start. A ``restart_only``
        session is never captured (``nemo_ckpt.sandbox_backend``). Waits while
        paused."""
        await self.open_sessions([(episode, state, directory, restart_only)])
        return self._parts.record(self.held(episode))

    async def open_sessions(self, sessions: OpeningSessions) -> int:
        """Open many sessions in one call (a worker starting a batch of rollouts, or a
        group of samples per prompt): each ``(episode, state)``, ``(episode, state,
        sandbox)`` or ``(episode, state, sandbox, restart_only)`` as ``open_session``
        would, all or none. Returns how many were opened. Waits while paused.

        Repeated after its answer was lost (every session open as this call opens it,
        no turn begun since), it changes nothing and returns the same count at once."""
        opening = [self._opening(item) for item in sessions]
        if opening and all(self._opened_as(*each) for each in opening):
            return len(opening)
        self._parts.refuse_if_parked()
        # Containers that need their memory where this node cannot capture it are
        # restart-only: said once per session, at its open.
        for i, (episode, state, where, restart) in enumerate(opening):
            if isinstance(where, ContainerRef) and where.memory == "required" \
                    and not restart:
                why = await self._runtime.run_blocking(
                    self._sandboxes.restart_only_reason, where)
                if why is not None:
                    log.warning("%s: session %s is restart-only: its container %s needs "
                                "its memory, which this node cannot capture (%s)",
                                self.instance_id, episode.capture_key, where.name, why)
                    opening[i] = (episode, state, where, True)
        # Recorded before the gate: once it opens, the sessions go live with no await.
        recorded = await self._sandboxes.record_all(
            self._runtime.run_blocking,
            [(ep.capture_key, d) for ep, _, d, restart in opening
             if d is not None and not restart])
        try:
            await self._parts.wait_for_gate()
            self._parts.refuse_if_parked()  # parked while it waited at the gate
            rollouts: set[str] = set()
            for episode, _, _, _ in opening:
                if episode.rollout_id in rollouts:
                    raise SessionExistsError(
                        f"{self.instance_id}: rollout {episode.rollout_id!r} is listed twice "
                        f"in this call; nothing was opened")
                self._check_openable(episode)
                rollouts.add(episode.rollout_id)
        except BaseException:
            for rec in recorded.values():
                self._sandboxes.forget_unused(rec)
            raise
        for episode, state, where, restart in opening:
            self._table.put(Held.fresh(episode, state))
            if restart:
                self._sandboxes.restart_only[episode.rollout_id] = where
            elif where is not None:
                self._sandboxes.install(episode.rollout_id, where,
                                        recorded[episode.capture_key])
        self._parts.heap.note(sum(len(each[1]) for each in opening))
        return len(opening)

    def _opening(self, item: tuple[Any, ...]) -> _Opening:
        """One session of ``open_sessions`` checked: its episode, state, sandbox and
        whether it is restart-only."""
        episode, state = item[0], item[1]
        where = item[2] if len(item) > 2 else None
        restart = item[3] if len(item) > 3 else False
        if type(restart) is not bool:
            raise TypeError(f"restart_only must be True or False, not {restart!r}")
        self.check_episode(episode)
        self.check_size("initial state", episode, state)
        if where is not None:  # its id names the directories its restores make
            problem = sandbox_id_problem(episode.rollout_id, episode.attempt)
            if problem is not None:
                raise SandboxError(f"{self.instance_id}: cannot open a session with "
                                   f"sandbox {where}: {problem}; nothing was opened")
        return (episode, state, None if where is None else
                self._sandboxes.check_location(where, episode.capture_key), restart)

    def _opened_as(self, episode: EnvironmentEpisode, state: bytes,
                   location: SandboxLocation | None, restart: bool) -> bool:
        """Whether ``episode``'s session is live exactly as an open with ``state``,
        ``location`` and ``restart`` makes it, untouched since (no turn begun, not
        finished)."""
        held = self._table.get(episode)
        if held is None or held.finished or held.turn_count \
                or held.last_turn is not None or held.capture_key in self._gate \
                or held.state != bytes(state) or held.row != Held.fresh(episode, b"").row:
            return False  # not as opened (a restored one has earlier capture keys)
        if restart != (episode.rollout_id in self._sandboxes.restart_only):
            return False
        return self._sandboxes.location(episode.rollout_id) == location

    def _check_openable(self, episode: EnvironmentEpisode) -> None:
        self.refuse_retired(episode)
        key = episode.capture_key
        live = self._table.of_rollout(episode.rollout_id)
        if live is not None:
            if live.attempt == episode.attempt:
                raise SessionExistsError(
                    f"{self.instance_id}: a session for {key} is already open")
            raise SessionExistsError(
                f"{self.instance_id}: rollout {episode.rollout_id!r} already has a live "
                f"session ({live.capture_key}); close or retire it before opening {key}")
        other = self._table.collision(episode)
        if other is not None:
            raise CaptureKeyCollisionError(
                f"{self.instance_id}: rollout {episode.rollout_id!r} attempt "
                f"{episode.attempt} has capture key {key!r}, which live session "
                f"{other.rollout_id!r} attempt {other.attempt} already uses; rename the "
                f"rollout (ids ending in '-a<digits>' collide with later attempts)")

    async def sessions(self) -> list[SessionRecord]:
        """Every live session, sorted by capture key."""
        return [self._parts.record(h) for h in self._parts.table.sorted()]

    async def replay_diverged(self, episode: EnvironmentEpisode, detail: str) -> int:
        """A continued rollout starts over because its replay diverged: warn, naming it,
        and count it for the next snapshot's metrics. Returns the count so far."""
        self.check_episode(episode)
        self.held(episode)  # only a live session's rollout restarts
        self._parts.replay_restarts += 1
        log.warning("%s: rollout %s starts over: replaying its recorded steps diverged (%s)",
                    self.instance_id, episode.capture_key, detail[:500])
        return self._parts.replay_restarts

    async def get_session(self, episode: EnvironmentEpisode | str) -> SessionRecord:
        """The live session of ``episode`` (or with that capture key)."""
        return self._parts.record(self.held(episode))

    async def read_turns(self, episode: EnvironmentEpisode | str, start: int = 0,
                         stop: int | None = None) -> list[bytes]:
        """Turn records ``start`` to ``stop`` (a slice's bounds, clamped to the turns
        committed; None: to the last) of the live session of ``episode`` (or with that
        capture key); only those are decoded."""
        if type(start) is not int or not (stop is None or type(stop) is int):
            raise TypeError(f"read_turns takes int bounds, not {start!r} and {stop!r}")
        held = self.held(episode)
        first, last, _ = slice(start, stop).indices(held.turn_count)
        if last <= first:
            return []
        try:
            return held.read_turns(first, last)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ValueError(f"{self.instance_id}: the turn records of "
                             f"{held.capture_key} do not decode ({exc}); it says "
                             f"{held.turn_count} turns") from None

    async def close_session(self, episode: EnvironmentEpisode | str) -> SessionRecord:
        """Close a finished session (of ``episode``, or with that capture key) and return
        its final record. Waits while paused."""
        await self._parts.wait_for_gate()
        held = self.held(episode)
        if held.capture_key in self._gate:
            raise TurnInProgressError(
                f"{self.instance_id}: session {held.capture_key} has a turn in flight; "
                f"finish the turn before closing the session")
        record = self._parts.record(held)
        self._table.drop(held.rollout_id)
        self._sandboxes.drop(held.rollout_id)
        await self._release([held.capture_key])
        return record

    async def finish_session(self, episode: EnvironmentEpisode, result: bytes
                             ) -> SessionRecord:
        """Hand in a finished rollout's ``result`` (``nemo_ckpt.receipts``): the session
        stays, finished, until RL acknowledges it (``retire``); it runs no more turns.
        Waits while paused, like a turn: a snapshot captures the session either as it
        was before, or finished. Repeating it with the same result changes nothing."""
        self.check_episode(episode)
        self.check_size("result", episode, result)
        await self._parts.wait_for_gate()
        self._parts.refuse_if_parked()
        held = self.held(episode)
        if held.finished:
            if held.state != bytes(result):
                raise RolloutFinishedError(
                    f"{self.instance_id}: {held.capture_key} was already handed in as "
                    f"finished with another result; nothing changed")
            return self._parts.record(held)
        if held.capture_key in self._gate:
            raise TurnInProgressError(
                f"{self.instance_id}: session {held.capture_key} has a turn in flight; "
                f"finish the turn before handing in the rollout")
        finished = held.finish(result)
        self._table.put(finished)
        self._sandboxes.drop(held.rollout_id)  # the worker owns the directory from now on
        return self._parts.record(finished)

    # --- ledger operations (from RL, through the coordinator) ------------------------

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Refuse every attempt up to each of these of its rollout, and drop their live
        sessions (RL consumed the result). Returns the capture keys dropped."""
        self._parts.require_running("retire")
        dropped = []
        for ep in episodes:
            self.check_episode(ep)
            mark = self._gate.retire(ep.rollout_id, ep.attempt)
            held = self._table.of_rollout(ep.rollout_id)
            if held is not None and held.attempt <= mark:
                self._gate.drop(held.capture_key)  # it can no longer commit
                self._table.drop(held.rollout_id)
                self._sandboxes.drop(held.rollout_id)
                dropped.append(held.capture_key)
        self._gate.bound_marks()
        await self._gate.notify()
        await self._release(dropped)
        return dropped

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Drop these attempts' sessions, and the retire mark of their rollout when it
        reaches no further than them. Returns the capture keys dropped."""
        self._parts.require_running("forget")
        dropped = []
        for ep in episodes:
            self.check_episode(ep)
            self._gate.forget(ep.rollout_id, ep.attempt)
            if self._table.get(ep) is not None:
                self._gate.drop(ep.capture_key)
                self._table.drop(ep.rollout_id)
                self._sandboxes.drop(ep.rollout_id)
                dropped.append(ep.capture_key)
        await self._gate.notify()
        await self._release([ep.capture_key for ep in episodes])  # live or not
        return dropped

    async def _release(self, capture_keys: list[str]) -> None:
        """Remove the sandboxes a provider made for these sessions, gone for good
        (``nemo_ckpt.sandboxes.provided``): none is left behind a rollout RL retired or
        dropped, or its worker closed."""
        marked = self._sandboxes.marked(capture_keys)
        if marked:
            await self._runtime.run_blocking(self._sandboxes.release_provided, marked)

    # --- the checks (``Turns`` makes them too) -----------------------------------------

    def held(self, episode: EnvironmentEpisode | str) -> Held:
        """The live session of ``episode`` (or with that capture key), or a refusal."""
        if isinstance(episode, str):
            held = self._table.by_capture_key(episode)
            key = episode
        else:
            self.check_episode(episode)
            self.refuse_retired(episode)
            held = self._table.get(episode)
            key = episode.capture_key
        if held is None:
            self._parts.refuse_if_parked()  # gone with the stop: say so
            raise SessionNotFoundError(
                f"{self.instance_id}: no live session {key!r}; open it first, or connect "
                f"to the instance that holds it")
        return held

    def refuse_retired(self, episode: EnvironmentEpisode) -> None:
        mark = self._gate.retired_up_to(episode.rollout_id)
        if mark is not None and episode.attempt <= mark:
            raise RetiredAttemptError(
                f"{self.instance_id}: attempt {episode.capture_key} was retired by RL "
                f"(every attempt up to {mark} of {episode.rollout_id!r} is); open the next "
                f"attempt instead, or forget this one first")

    def check_episode(self, episode: object) -> None:
        if not isinstance(episode, EnvironmentEpisode):
            raise TypeError(f"expected an EnvironmentEpisode, got {type(episode).__name__}")

    def check_size(self, what: str, episode: EnvironmentEpisode, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"{what} of {episode.capture_key} must be bytes, not "
                            f"{type(data).__name__}; serialize it in the environment")
        if len(data) > self._max_state_bytes:
            raise StateTooLargeError(
                f"{self.instance_id}: {what} of {episode.capture_key} is {len(data)} bytes, "
                f"over the limit of {self._max_state_bytes}; keep large artefacts outside "
                f"the session or raise CheckpointConfig.max_state_bytes")
