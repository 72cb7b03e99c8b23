"""What the world's parts see of it (``WorldView``): the simulated cluster's state and the
models and hooks a schedule sets. ``actors.sim.world.SimWorld`` is one; its delivery, its
runtimes, the guard and the transport are typed by this view, so that none of them imports
the world that makes them (no import circle)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from actors.sim.actor import SimActor
from nemo_ckpt.testing.virtual_time import VirtualTimeLoop
from nemo_ckpt.transport import Runtime

__all__ = ["IoDecision", "WorldView"]

# What a blocking call may suffer, decided per call by ``SimWorld.io_faults``: "fail"
# raises an OSError-like refusal before the work, "tear" leaves a partial temp file and
# kills the calling actor mid-write.
IoDecision = str | None


class WorldView(Protocol):
    """The simulated cluster as its parts use it (the attributes: ``SimWorld``)."""

    seed: int
    rng: random.Random
    loop: VirtualTimeLoop
    draining: dict[str, float | None]
    nodes: dict[str, bool]
    registry: dict[tuple[str, str], SimActor]
    actors: list[SimActor]
    message_delay: Callable[[SimActor, str, bool], float]
    route: Callable[[SimActor, SimActor, str], tuple[float, ...] | None]
    lose_reply: Callable[[SimActor, str], bool]
    io_cost: Callable[[str], float]
    io_faults: Callable[[str, tuple[Any, ...]], IoDecision]
    io_log: list[tuple[float, str, str, tuple[Any, ...], Any]]
    slow_links: list[tuple[float, float]]
    on_send: Callable[[SimActor, SimActor, str, tuple[Any, ...]], None] | None
    on_deliver: Callable[[SimActor, str, tuple[Any, ...]], None] | None
    after_io: Callable[[SimActor, str], None] | None
    running: SimActor | None
    running_name: str
    thread_skip: float
    call_deadline_s: float
    on_blocked: Callable[[SimActor, str, str], None] | None
    fifos: list[str]
    concurrency: Callable[[SimActor, str], int | None]
    on_queued: Callable[[SimActor, str, tuple[Any, ...], float, tuple[str, ...], int],
                        None] | None

    @property
    def last_serial(self) -> int: ...

    def spawn(self, actor: SimActor, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...

    def new_actor(self, kind: str, name: str, node: str) -> SimActor: ...

    def runtime(self, actor: SimActor) -> Runtime: ...

    def deliver(self, caller: SimActor, target: SimActor, method: str,
                args: tuple[Any, ...]) -> asyncio.Future[Any]: ...

    def unblock(self, first: Callable[[int], None] | None = None) -> int: ...

    def alive_nodes(self) -> list[str]: ...

    def kill(self, actor: SimActor) -> None: ...
