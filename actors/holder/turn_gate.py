"""The holder's turn gate: the gate new turns wait at, the turns in flight (drained by a
pause, timed out by the watchdog), the tokens their callers aborted early or the
watchdog timed out, and RL's retire marks."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

from nemo_ckpt.errors import TurnInProgressError

__all__ = ["TurnGate", "ABORTED_TOKENS"]

log = logging.getLogger("nemo_ckpt.holder")

V = TypeVar("V")

# Turn tokens aborted before their begin_turn arrived, kept to refuse that late begin;
# and tokens of turns timed out, kept to say so to their late commit. Bounded each.
ABORTED_TOKENS = 4096


@dataclass
class _Turn:
    token: str
    started: float


class TurnGate:
    """Turns in flight, keyed by capture key, behind one gate."""

    def __init__(self, instance_id: str, max_retired_marks: int,
                 max_aborted_tokens: int = ABORTED_TOKENS,
                 retired: dict[str, int] | None = None) -> None:
        self.instance_id = instance_id
        self._open = asyncio.Event()
        self._open.set()
        self._closed_at: float | None = None  # since when the gate is closed
        self._turns: dict[str, _Turn] = {}
        self._turns_done = asyncio.Condition()
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._timed_out: OrderedDict[str, float] = OrderedDict()  # token -> timeout
        self._max_aborted = max_aborted_tokens
        # Monotone as NeMo Gym's: rollout id -> the highest attempt retired; every
        # attempt up to it is refused until RL forgets it. A holder started after
        # others starts with the coordinator's copy (``retired``, oldest first).
        self._retired: OrderedDict[str, int] = OrderedDict(retired or {})
        self._max_retired = max_retired_marks
        self.bound_marks()

    # --- the gate ----------------------------------------------------------------------

    def set_open(self, is_open: bool, now: float) -> None:
        """Open or close the gate at ``now``. The time it stays closed (a pause for a
        snapshot or a restore) does not count against the turns in flight: RL's barrier
        may hold their worker for as long (simulation seed 8146)."""
        if is_open and not self._open.is_set():
            if self._closed_at is not None:
                for turn in self._turns.values():
                    turn.started += max(0.0, now - max(turn.started, self._closed_at))
            self._closed_at = None
            self._open.set()
        elif not is_open and self._open.is_set():
            self._closed_at = now
            self._open.clear()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()

    # --- turns in flight ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._turns)

    def in_flight(self) -> list[tuple[str, str]]:
        """``(capture key, token)`` of every turn in flight, sorted."""
        return sorted((key, turn.token) for key, turn in self._turns.items())

    def __contains__(self, capture_key: object) -> bool:
        return capture_key in self._turns

    def begin(self, capture_key: str, token: str, now: float) -> None:
        if capture_key in self._turns:
            raise TurnInProgressError(
                f"{self.instance_id}: session {capture_key} already has a turn in flight; "
                f"a session runs one turn at a time")
        self._turns[capture_key] = _Turn(token, now)

    def holds(self, capture_key: str, token: str) -> bool:
        """Whether the turn in flight for ``capture_key`` is the one of ``token``."""
        turn = self._turns.get(capture_key)
        return turn is not None and turn.token == token

    def take(self, capture_key: str, token: str) -> bool:
        """End the turn of ``token``; whether it was in flight."""
        if not self.holds(capture_key, token):
            return False
        del self._turns[capture_key]
        return True

    def drop(self, capture_key: str) -> None:
        """End whatever turn ``capture_key`` has in flight: it can no longer commit."""
        self._turns.pop(capture_key, None)

    def abort(self, capture_key: str, token: str) -> bool:
        """End the turn of ``token``, or, when it is not in flight (its begin still
        travelling), remember the token to refuse that begin; whether it was in flight."""
        if self.take(capture_key, token):
            return True
        _remember(self._aborted, token, None, self._max_aborted)
        return False

    def consume_aborted(self, token: str) -> bool:
        """Whether ``token`` was aborted before its begin; forgotten once asked."""
        if token in self._aborted:
            del self._aborted[token]
            return True
        return False

    @property
    def aborted_tokens(self) -> int:
        return len(self._aborted)

    def timed_out(self, token: str) -> float | None:
        """The timeout the turn of ``token`` exceeded, if ``time_out`` ended it (among
        the last ``ABORTED_TOKENS`` it ended)."""
        return self._timed_out.get(token)

    async def notify(self) -> None:
        """Wake a drain: a turn ended."""
        async with self._turns_done:
            self._turns_done.notify_all()

    async def drain(self, timeout_s: float) -> None:
        """Wait until no turn is in flight, or ``timeout_s`` passed."""
        async with self._turns_done:
            try:
                await asyncio.wait_for(
                    self._turns_done.wait_for(lambda: not self._turns), timeout_s)
            except asyncio.TimeoutError:
                pass

    def time_out(self, now: float, timeout_s: float) -> list[str]:
        """End the turns in flight for longer than ``timeout_s``, not counting the time
        the gate was closed; their capture keys. None ends while it is closed."""
        if not self._open.is_set():
            return []
        stale = [k for k, t in self._turns.items() if now - t.started > timeout_s]
        for key in stale:
            log.warning("%s: turn of %s exceeded %.1fs; aborting it",
                        self.instance_id, key, timeout_s)
            _remember(self._timed_out, self._turns.pop(key).token, timeout_s,
                      self._max_aborted)
        return stale

    # --- retire marks ------------------------------------------------------------------

    def retired_up_to(self, rollout_id: str) -> int | None:
        """The highest retired attempt of ``rollout_id``, if any is."""
        return self._retired.get(rollout_id)

    def retire(self, rollout_id: str, attempt: int) -> int:
        """Retire every attempt of ``rollout_id`` up to ``attempt``; the mark now."""
        mark = max(attempt, self._retired.pop(rollout_id, -1))
        self._retired[rollout_id] = mark
        return mark

    def bound_marks(self) -> None:
        """Forget the oldest marks beyond the bound."""
        while len(self._retired) > self._max_retired:
            rollout_id, _ = self._retired.popitem(last=False)
            log.warning("%s: more than %d retire marks; forgetting the oldest (%s)",
                        self.instance_id, self._max_retired, rollout_id)

    def forget(self, rollout_id: str, attempt: int) -> None:
        """Drop the mark of ``rollout_id`` if it reaches no further than ``attempt``."""
        if self._retired.get(rollout_id, -1) <= attempt:
            self._retired.pop(rollout_id, None)

    @property
    def retire_marks(self) -> int:
        return len(self._retired)


def _remember(tokens: OrderedDict[str, V], token: str, value: V, bound: int) -> None:
    tokens[token] = value
    while len(tokens) > bound:
        tokens.popitem(last=False)
