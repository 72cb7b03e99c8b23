"""The holder's turns: a session's turn begun, committed (its record and state appended,
its sandbox recorded as the turn left it), aborted, and resolved for a caller whose commit
got no answer, all from environment workers (``nemo_ckpt.protocol.holder_api.HolderSessions``).

``Turns`` is a part of the holder beside ``actors.holder.sessions.Sessions``, which finds
and checks the session a turn belongs to (``Sessions.held``, ``check_episode``,
``check_size``); the turns in flight are the turn gate's (``actors.holder.turn_gate``).
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.holder.parts import HolderParts
from actors.holder.sessions import Sessions
from nemo_ckpt.errors import (
    RolloutFinishedError,
    TurnAbortedError,
    TurnInProgressError,
    TurnTimedOutError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.sandbox_backend import Recorded
from nemo_ckpt.session_record import SessionHead, check_staging_keys

__all__ = ["Turns"]


class Turns:
    """The turn calls of one holder (see the module docstring)."""

    def __init__(self, parts: HolderParts, sessions: Sessions) -> None:
        self._parts = parts
        self._sessions = sessions
        self.instance_id = parts.instance_id
        self._runtime = parts.runtime
        self._table = parts.table
        self._gate = parts.gate
        self._sandboxes = parts.sandboxes

    async def begin_turn(self, episode: EnvironmentEpisode, token: str) -> SessionHead:
        """Start a turn whose token the caller made: wait while paused, then return the
        session as a turn sees it (its state and turn count, not its turn records). A
        token its caller already aborted (it went away while this call travelled or
        waited at the gate) is refused, so no turn stays open for ever."""
        self._sessions.check_episode(episode)
        if not isinstance(token, str) or not token:
            raise TypeError("a turn token must be a non-empty string made by the caller")
        self._refuse_aborted(episode, token)
        await self._parts.wait_for_gate()
        self._refuse_aborted(episode, token)
        self._parts.refuse_if_parked()
        held = self._sessions.held(episode)
        if held.finished:
            raise RolloutFinishedError(
                f"{self.instance_id}: {held.capture_key} was handed in as finished; it "
                f"runs no more turns (RL reads its result and acknowledges it)")
        head = self._parts.head(held)
        self._gate.begin(episode.capture_key, token, self._parts.clock.monotonic())
        self._parts.settle_restore()
        return head

    async def commit_turn(
        self,
        episode: EnvironmentEpisode,
        token: str,
        record: bytes,
        state: bytes,
        staging_keys: Iterable[str] = (),
    ) -> SessionHead:
        """Commit a turn: append its record, replace the state, add its staging keys,
        and record the session's directory as the turn left it (a thread re-reads the
        files that changed; the turn stays in flight until that is done, so a pause
        waits for it). Nothing earlier in the session is decoded or re-encoded
        (``Held.with_turn``); the answer is the session's head. Invalid arguments, or a
        directory that cannot be recorded, abort the turn and change nothing. A turn
        that a stop snapshot captured in flight commits only if that snapshot ends
        without parking its session (``HolderParts.after_stop_capture``)."""
        self._sessions.check_episode(episode)
        if not self._gate.is_open:  # paused: a stop snapshot may hold this turn's session
            await self._parts.after_stop_capture(episode.capture_key)
        box = self._sandboxes.get(episode.rollout_id)
        recorded: Recorded | None = None
        if box is not None and self._turn_is(episode, token):
            recording = False
            try:
                self._sessions.check_size("turn record", episode, record)
                self._sessions.check_size("state", episode, state)
                recording = True
                recorded = (await self._sandboxes.record_all(
                    self._runtime.run_blocking, [(episode.capture_key, box.location)],
                    box.recorded))[episode.capture_key]
            except BaseException as exc:
                if self._turn_is(episode, token):
                    self._take_turn(episode, token)
                    await self._gate.notify()
                if recording and isinstance(exc, Exception):
                    self._note_unrecorded(episode, staging_keys)
                raise
        try:
            self._take_turn(episode, token)
        except BaseException:
            if recorded is not None:
                self._sandboxes.forget_unused(recorded)
            raise
        try:
            old = self._sessions.held(episode)
            self._sessions.check_size("turn record", episode, record)
            self._sessions.check_size("state", episode, state)
            keys = check_staging_keys(staging_keys, episode.capture_key)
            new = old.with_turn(record, state, keys, token)
            self._table.put(new)
            if recorded is not None and box is not None:
                self._sandboxes.install(episode.rollout_id, box.location, recorded)
                recorded = None
            self._parts.heap.note(len(record) + len(state))
            return self._parts.head(new)
        finally:
            if recorded is not None:
                self._sandboxes.forget_unused(recorded)
            await self._gate.notify()

    def _note_unrecorded(self, episode: EnvironmentEpisode,
                         staging_keys: Iterable[str]) -> None:
        """Remember the staging rows of a turn whose commit failed recording its
        sandbox, for the orphan rows a snapshot reports."""
        try:
            keys = check_staging_keys(staging_keys, episode.capture_key)
        except TypeError:
            return
        if keys and self._sandboxes.get(episode.rollout_id) is not None:
            self._sandboxes.unrecorded[episode.rollout_id] = keys

    async def abort_turn(self, episode: EnvironmentEpisode, token: str) -> None:
        """Abort a turn: nothing it did is recorded. A token not in flight (its begin
        still travelling, or already finished) is remembered and refused later."""
        self._sessions.check_episode(episode)
        if self._gate.abort(episode.capture_key, token):
            await self._gate.notify()

    async def resolve_turn(self, episode: EnvironmentEpisode, token: str
                           ) -> SessionHead | None:
        """The outcome of the turn of ``token``, for a caller whose ``commit_turn`` got no
        answer: the session's head as that commit left it if the turn committed, else None,
        and then the turn can no longer commit (aborted here now if it is in flight,
        its token refused if its begin is still on its way). Read and decided with no
        await between, so no commit lands between the look and the abort.

        A session remembers the token of its last committed turn, and nothing older,
        until it leaves the holder: enough, as a session runs one turn at a time and
        ``SessionClient`` asks before it begins the session's next turn. Raises as any
        session call does when the session is not live here (retired, closed, or lost
        with a holder that died)."""
        self._sessions.check_episode(episode)
        if not isinstance(token, str) or not token:
            raise TypeError("a turn token must be a non-empty string made by the caller")
        held = self._table.get(episode)
        if held is not None and held.last_turn == token:
            return self._parts.head(held)
        if self._gate.abort(episode.capture_key, token):
            await self._gate.notify()
        self._sessions.held(episode)  # the session is gone: say so rather than "not recorded"
        return None


    def _refuse_aborted(self, episode: EnvironmentEpisode, token: str) -> None:
        if self._gate.consume_aborted(token):
            raise TurnAbortedError(
                f"{self.instance_id}: the turn of {episode.capture_key} was aborted by its "
                f"caller before it began here; nothing was recorded")

    def _turn_is(self, episode: EnvironmentEpisode, token: str) -> bool:
        return self._gate.holds(episode.capture_key, token)

    def _take_turn(self, episode: EnvironmentEpisode, token: str) -> None:
        if not self._gate.take(episode.capture_key, token):
            self._sessions.refuse_retired(episode)
            self._parts.refuse_if_parked()
            timeout_s = self._gate.timed_out(token)
            if timeout_s is not None:
                raise TurnTimedOutError(
                    f"{self.instance_id}: the turn of {episode.capture_key} ran longer than "
                    f"turn_timeout_s ({timeout_s:g}s, not counting the time the "
                    f"holder was paused), so the holder aborted it and recorded nothing; "
                    f"run the turn again, and raise CheckpointConfig.turn_timeout_s if "
                    f"your tool calls take that long")
            raise TurnInProgressError(
                f"{self.instance_id}: no turn in flight for {episode.capture_key} with "
                f"that token; it was aborted (turn timeout, retire or forget) or already "
                f"finished")
