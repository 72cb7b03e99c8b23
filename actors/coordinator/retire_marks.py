"""RL's retire marks, as the coordinator keeps them for the holders it starts later.

A holder refuses every attempt of a rollout up to the highest one RL retired
(``actors.holder.turn_gate.TurnGate``). Those marks die with the holder; a worker's
``open``, retried across its holder's death, would then land on the successor and open an
attempt RL had retired (simulation seed 800362). So the coordinator records each
``retire`` and ``forget`` here, under the same rule and bound as a holder's
(``CheckpointConfig.max_retired_marks``, the oldest going first), and starts each holder
with them (``actors.coordinator.holders.HolderRegistry.create``): a successor refuses
what its predecessor would have. Like the rest of the coordinator's state they live as
long as the coordinator: one that replaces a dead coordinator starts with none (the
holders alive keep theirs).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from nemo_ckpt.interfaces import EnvironmentEpisode

__all__ = ["RetireMarks"]

log = logging.getLogger("nemo_ckpt.coordinator")


class RetireMarks:
    """Rollout id -> the highest attempt RL retired, until RL forgets it (bounded)."""

    def __init__(self, bound: Callable[[], int]) -> None:
        self._marks: OrderedDict[str, int] = OrderedDict()
        self._bound = bound

    def __len__(self) -> int:
        return len(self._marks)

    def retire(self, episodes: list[EnvironmentEpisode]) -> None:
        """Record these attempts retired, as a holder's ``retire`` does."""
        _check(episodes)
        for ep in episodes:
            self._marks[ep.rollout_id] = max(ep.attempt, self._marks.pop(ep.rollout_id, -1))
        bound = self._bound()
        while len(self._marks) > bound:
            rollout_id, _ = self._marks.popitem(last=False)
            log.warning("more than %d retire marks; a holder started from now on no longer "
                        "refuses rollout %s", bound, rollout_id)

    def forget(self, episodes: list[EnvironmentEpisode]) -> None:
        """Drop the mark of each rollout it reaches no further than, as a holder's
        ``forget`` does."""
        _check(episodes)
        for ep in episodes:
            if self._marks.get(ep.rollout_id, -1) <= ep.attempt:
                self._marks.pop(ep.rollout_id, None)

    def now(self) -> dict[str, int]:
        """A copy of the marks, oldest first (a new holder starts with them)."""
        return dict(self._marks)

    @staticmethod
    def since(given: dict[str, int], now: dict[str, int]
              ) -> tuple[list[EnvironmentEpisode], list[EnvironmentEpisode]]:
        """What a holder started with ``given`` still needs to hold ``now``: the
        attempts to retire on it, and those to forget."""
        retire = [EnvironmentEpisode(r, a) for r, a in now.items() if given.get(r, -1) < a]
        forget = [EnvironmentEpisode(r, a) for r, a in given.items() if r not in now]
        return retire, forget


def _check(episodes: list[EnvironmentEpisode]) -> None:
    for ep in episodes:
        if not isinstance(ep, EnvironmentEpisode):
            raise TypeError(f"expected an EnvironmentEpisode, got {type(ep).__name__}")
