"""Where a test or drill may make a holder or the coordinator wait, to aim a fault (a
kill, a cancellation, a lost node) at one phase of an operation.

The actors' code only names the points it reaches (``Runtime.reached``); the delays live
here, in the runtime a test or the Ray actor gives them (``actors.ray_transport``'s
``inject_delay``), never in the actors' own classes.
"""

from __future__ import annotations

import asyncio

__all__ = ["COORDINATOR_POINTS", "HOLDER_POINTS", "PhaseDelays"]

# A holder's points: pause (before the drain), capture, persist (before a shard is
# written), finish_writes (before its write is awaited), prepare_restore (before the
# shards are read), commit_restore (before the sessions go live).
HOLDER_POINTS = frozenset({"pause", "capture", "persist", "finish_writes",
                           "prepare_restore", "commit_restore"})
# The coordinator's: begin_snapshot (before the holders are asked), commit_snapshot
# (before the shards are awaited), before_manifest (every shard durable, the manifest
# not yet written), after_manifest (the manifest renamed, holders not yet resumed),
# commit_restore (before the holders are asked).
COORDINATOR_POINTS = frozenset({"begin_snapshot", "commit_snapshot", "before_manifest",
                                "after_manifest", "commit_restore"})


class PhaseDelays:
    """The delays set at one actor's points; its ``reached`` is that actor's
    ``Runtime.reached``."""

    def __init__(self, points: frozenset[str]) -> None:
        self._points = points
        self._delays: dict[str, float] = {}

    def set(self, point: str, seconds: float) -> None:
        """Make ``point`` take ``seconds`` longer; 0 removes the delay."""
        if point not in self._points:
            raise ValueError(f"unknown phase {point!r}; one of {sorted(self._points)}")
        if seconds > 0:
            self._delays[point] = seconds
        else:
            self._delays.pop(point, None)

    async def reached(self, point: str) -> None:
        seconds = self._delays.get(point, 0.0)
        if seconds > 0:
            await asyncio.sleep(seconds)
