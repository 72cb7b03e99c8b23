"""The holder's watchdog: named checks run in order, every period, from the holder's loop.

A check is stepped alone by ``tick`` in tests, without waiting for a period."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nemo_ckpt.transport import Clock

__all__ = ["Check", "Watchdog"]


@dataclass(frozen=True)
class Check:
    """One thing the watchdog looks at; ``run`` gets the time of the tick."""

    name: str
    run: Callable[[float], Awaitable[None]]


class Watchdog:
    """Runs its checks every ``period_s``, once started, until cancelled."""

    def __init__(self, clock: Clock, period_s: float, checks: list[Check]) -> None:
        self._clock = clock
        self._period_s = period_s
        self.checks = tuple(checks)
        self._task: asyncio.Task[None] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.checks)

    def ensure_running(self) -> None:
        """Start the loop unless it runs (a check that raised stopped it)."""
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())

    def cancel(self) -> None:
        """Stop the loop (it starts again on the next ``ensure_running``)."""
        if self._task is not None:
            self._task.cancel()

    async def tick(self) -> None:
        """Run every check once, in order, at one time."""
        now = self._clock.monotonic()
        for check in self.checks:
            await check.run(now)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            await self.tick()
