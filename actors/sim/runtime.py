"""The ``Runtime`` a simulated actor runs with: its own clocks (``SimClock``: a steady
wall-clock offset, a monotonic origin, a rate, and jumps) and its blocking work as a
thread model (``BlockingRunner``): the work runs at a seeded later virtual time (two calls
in flight run in a seeded order, one call at a time), whether or not its caller still
waits (a thread outlives its cancelled caller; it dies with its process), and its result
reaches the caller as an event after the rest of its seeded cost. The world may fail or
tear chosen calls (``SimWorld.io_faults``); the guard (``actors.sim.guard``) watches each."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
from collections.abc import Awaitable, Callable
from typing import Any

from actors.sim.actor import NO_ACTOR, IoFault, SimActor, retrieve, settle
from actors.sim.guard import GUARD
from actors.sim.view import WorldView
from nemo_ckpt.errors import SnapshotWriteError
from nemo_ckpt.testing.virtual_time import EPOCH
from nemo_ckpt.transport import NoMetrics, Runtime

__all__ = ["BlockingRunner", "SimClock", "model_clock"]



class SimClock:
    """One actor's clocks: virtual time at its rate, its offsets and jumps, and the time
    a blocked call's clocks moved on (``thread_skip``) while that call runs."""

    def __init__(self, world: WorldView, actor: SimActor) -> None:
        self._world = world
        self._actor = actor

    def _elapsed(self) -> float:
        actor = self._actor
        return self._world.loop.time() * actor.rate + actor.clock_offset + (
            self._world.thread_skip if self._world.running is actor else 0.0)

    def monotonic(self) -> float:
        return self._actor.mono_origin + self._elapsed()

    def wall(self) -> float:
        return EPOCH + self._actor.wall_offset + self._elapsed()


def model_clock(actor: SimActor, rng: random.Random, skew_s: float, rate: float) -> None:
    """Give ``actor`` its host's steady clock model: a monotonic origin, a wall-clock
    offset within ``skew_s`` either way, a rate within ``rate`` of true time."""
    actor.mono_origin = rng.uniform(0.0, 1e6)  # its host booted whenever
    if skew_s:
        actor.wall_offset = rng.uniform(-skew_s, skew_s)
    if rate:
        actor.rate = 1.0 + rng.uniform(-rate, rate)


def _inline(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """``Runtime.detach`` here: the call runs now, on the loop's thread (a cluster call
    in the simulation never blocks, and a thread would break the seed's replay)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:  # handed to whoever waits
        future.set_exception(exc)
    return future


class BlockingRunner:
    """``Runtime.run_blocking`` for the world's actors, one call at a time on the loop's
    thread, with the world's costs, faults and log."""

    def __init__(self, world: WorldView) -> None:
        self._world = world

    def runtime(self, actor: SimActor) -> Runtime:
        world = self._world
        return Runtime(clock=SimClock(world, actor), metrics=NoMetrics(),
                       run_blocking=self.runner(actor),
                       token=lambda: f"{world.rng.getrandbits(64):016x}",
                       reached=actor.delays.reached, threads=1, detach=_inline)

    def runner(self, actor: SimActor) -> Callable[..., Awaitable[Any]]:
        world = self._world

        async def run_blocking(fn: Callable[..., Any], *args: Any) -> Any:
            if not actor.alive:
                raise asyncio.CancelledError()  # a dead process does nothing more
            name = getattr(fn, "__name__", repr(fn))
            done = world.loop.create_future()
            # Nobody may wait for it any more (a cancelled caller): its error is dropped.
            done.add_done_callback(retrieve)
            cost = world.io_cost(name)
            start = world.rng.uniform(0.0, cost)
            world.loop.call_later(start, self._execute, actor, fn, name, args, done,
                                  cost - start, context=NO_ACTOR)
            return await asyncio.shield(done)

        return run_blocking

    def _execute(self, actor: SimActor, fn: Callable[..., Any], name: str,
                 args: tuple[Any, ...], done: asyncio.Future[Any], rest: float) -> None:
        """The thread runs ``fn`` now; its caller hears of it ``rest`` seconds later."""
        world = self._world
        if not actor.alive:  # the thread died with its process
            done.cancel()
            return
        frozen = actor.stalled_until - world.loop.time()
        if frozen > 0:  # its node is stalled: the thread runs once it thaws
            world.loop.call_later(frozen, self._execute, actor, fn, name, args, done, rest,
                                  context=NO_ACTOR)
            return
        decision = world.io_faults(name, args)
        if decision == "fail":
            self._complete(done, rest, exc=SnapshotWriteError(
                str(args[0]) if args else "?", f"injected failure of {name}"))
            return
        if decision == "tear":
            world.kill(actor)
            done.set_exception(IoFault(f"{actor} died in the middle of {name}"))
            return
        guard = GUARD
        if guard.world is not world:
            guard.start(world)
        world.running, world.running_name = actor, name
        guard.serial += 1
        guard.busy = True
        try:
            result = fn(*args)
        except Exception as exc:
            self._complete(done, rest, exc=exc)
            return
        finally:
            guard.busy = False
            world.running = None
            world.thread_skip = 0.0  # a blocked call's clocks moved on (the guard): no more
        world.io_log.append((world.loop.time(), actor.name, name, args, result))
        if world.after_io is not None:
            world.after_io(actor, name)
            if not actor.alive:
                done.set_exception(IoFault(f"{actor} died right after {name}"))
                return
        self._complete(done, rest, value=result)

    def _complete(self, done: asyncio.Future[Any], rest: float, value: Any = None,
                  exc: BaseException | None = None) -> None:
        self._world.loop.call_later(rest, settle, done, value, exc, context=NO_ACTOR)

    def unblock(self, first: Callable[[int], None] | None = None) -> int:
        """Let a blocked call go on: a FIFO's open returns once a writer opened it (and
        a read then sees its end, when the writer closes); a wait on a clock sees
        ``thread_skip``. ``first(freed)`` runs between the two, so that what it records
        comes before the blocked call returns, however the threads are scheduled.
        Returns how many FIFOs had a reader waiting."""
        writers: list[int] = []
        try:
            for path in self._world.fifos:
                try:
                    writers.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    continue  # no reader waits on it, or it is gone
            if first is not None:
                first(len(writers))
        finally:
            for fd in writers:
                os.close(fd)
        return len(writers)
