"""One schedule: its workload, its faults and its checkers over one shared state, joined
to the world's hooks, run to the end on virtual time; a pure function of its seed."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from actors.sim import SimActor

from .checkers import Checkers
from .faults import Faults
from .plan import CONFIG
from .state import Driver, Result, State
from .workload import Workload


class Schedule:
    def __init__(self, seed: int, root: Path, tracing: bool = False) -> None:
        self.s = State(seed, root, tracing)
        self.check = Checkers(self.s)
        self.inject = Faults(self.s, self.check)
        self.work = Workload(self.s, self.check, self.inject)
        self.inject.on_managed_event = self.work.managed_event
        world = self.s.world
        world.on_blocked = self.check.on_blocked
        world.on_send = self._on_send
        world.on_deliver = self._on_deliver
        world.after_io = self._after_io
        world.on_queued = self.check.on_queued

    # The checkers record a message before a fault acts on it (a kill, a cancel).

    def _on_send(self, caller: SimActor, callee: SimActor, method: str,
                 args: tuple[Any, ...]) -> None:
        self.check.on_send(caller, callee, method, args)
        self.work.on_send(caller, callee, method, args)
        self.inject.on_send(caller, callee, method, args)

    def _on_deliver(self, target: SimActor, method: str, args: tuple[Any, ...]) -> None:
        self.check.on_deliver(target, method, args)
        self.inject.on_deliver(target, method, args)

    def _after_io(self, actor: SimActor, name: str) -> None:
        self.check.after_io(actor, name)
        self.inject.after_io(actor, name)

    def run(self) -> Result:
        s = self.s
        loop = s.world.loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # a crash of the harness or the code under test
            s.violate(f"the schedule crashed: {type(exc).__name__}: {exc}")
        finally:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.sleep(0))
            loop.close()
            self.inject.withdraw()
            for actor in s.world.actors:  # their finished tasks: free them now
                actor.tasks.clear()
                actor.inbox.clear()
                actor.queues.clear()
        return Result(s.seed, s.violations, s.faults, s.trace)

    async def _main(self) -> None:
        s, work, check, inject = self.s, self.work, self.check, self.inject
        s.driver = Driver(s, "driver-1")
        await s.driver.ckpt.ensure_holders()
        await work.start_workers(fresh=True)
        inject.plant()
        injector = asyncio.ensure_future(inject.inject_faults())
        stalls = asyncio.ensure_future(inject.inject_stalls())
        monitor = asyncio.ensure_future(check.monitor())
        seconds = [asyncio.ensure_future(work.second_driver(t, k))
                   for k, t in enumerate(s.plan.second_driver)]
        outside = [asyncio.ensure_future(c) for c in inject.outside_actors()]
        await work.drive()
        injector.cancel()
        stalls.cancel()
        for task in outside:
            task.cancel()
        for task in seconds:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, CONFIG.lease_s * 3)
        inject.unplant()
        await work.stop_workers()
        if inject.hang_ends is not None:  # what a hung coordinator owes is settled after
            await asyncio.sleep(max(0.0, inject.hang_ends - s.world.loop.time()))
        await check.check_settled()
        monitor.cancel()
        await asyncio.sleep(CONFIG.lease_s * 2 + (CONFIG.turn_timeout_s or 0) + 1)
        await check.check_final()
