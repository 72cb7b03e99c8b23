"""Virtual time: an asyncio loop whose clock jumps to the next timer whenever nothing is
ready, so a lease of 30 s costs microseconds and a run is a pure function of its inputs
(no wall time). A double of the clock alone, as trio's ``MockClock`` is; the simulated
world that runs actors on it is ``actors.sim``."""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

__all__ = ["EPOCH", "Deadlock", "VirtualTimeLoop"]

# Seconds since the epoch at virtual time 0 (2026-12-01T00:00:00Z): ids and markers
# carry wall-clock times, and a fixed origin keeps them the same on every replay.
EPOCH = 1_796_083_200.0


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is pending: every task waits for ever."""


class _VirtualSelector(selectors.BaseSelector):
    """A selector that never waits: it moves the loop's clock to the next timer."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Deadlock("every task waits and no timer is pending")
        self._loop.advance(timeout)
        return []

    def get_map(self) -> Any:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, jumping to the next timer when idle."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(selector=_VirtualSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward; timers due by then run on the next iterations."""
        if seconds > 0:
            self._now += seconds
