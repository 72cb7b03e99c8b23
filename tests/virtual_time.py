"""Unit tests on virtual time: a test runs on a fresh ``VirtualTimeLoop`` (its clock jumps
to the next timer whenever nothing is ready), and the parts under test read that clock, so
a lease or a timeout is stepped exactly, without waiting for it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec

from nemo_ckpt.testing.virtual_time import VirtualTimeLoop
from nemo_ckpt.transport import Runtime

__all__ = ["LoopClock", "now", "on_virtual_time", "virtual_runtime"]

P = ParamSpec("P")


def on_virtual_time(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """Run ``test`` on a fresh ``VirtualTimeLoop``; what it leaves running is cancelled."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        loop = VirtualTimeLoop()
        try:
            loop.run_until_complete(test(*args, **kwargs))
        finally:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.close()

    return run


class LoopClock:
    """The running loop's clock: virtual time under ``VirtualTimeLoop``."""

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    def wall(self) -> float:
        return asyncio.get_running_loop().time()


def now() -> float:
    """Virtual seconds since the test began."""
    return asyncio.get_running_loop().time()


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    # A thread's completion would never wake a virtual loop: file work runs on it.
    return fn(*args)


def virtual_runtime() -> Runtime:
    """A holder's runtime on the loop's clock, its file work run inline."""
    return Runtime(clock=LoopClock(), run_blocking=_inline, threads=1)
