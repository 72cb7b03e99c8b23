"""The simulated cluster (``SimWorld``): its nodes and actors, the registry of names, the
tasks each actor owns, deaths as Ray notices them (kills, stalls, declared deaths and
zombies), and the models and faults a schedule sets, which its delivery
(``actors.sim.delivery``) and its actors' runtimes (``actors.sim.runtime``) follow."""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections.abc import Callable, Coroutine
from typing import Any

from actors.sim.actor import NO_ACTOR, ActorDied, SimActor, current_actor, settle
from actors.sim.delivery import Delivery
from actors.sim.runtime import BlockingRunner, model_clock
from actors.sim.transport import SimTransport
from actors.sim.view import IoDecision
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.testing.virtual_time import VirtualTimeLoop
from nemo_ckpt.transport import Runtime

__all__ = ["SimWorld"]


class SimWorld:
    """Nodes and actors of one simulated cluster, driven by one seeded RNG."""

    def __init__(self, seed: int, nodes: int = 3) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.loop = VirtualTimeLoop()
        # Nodes announced to drain (``Transport.draining_nodes``), as a test sets them,
        # each with its deadline (seconds since the epoch; None: none).
        self.draining: dict[str, float | None] = {}
        self.loop.set_task_factory(self._task_factory)
        self.nodes: dict[str, bool] = {f"node-{k}": True for k in range(nodes)}
        self.registry: dict[tuple[str, str], SimActor] = {}  # (namespace, name) -> alive
        self.actors: list[SimActor] = []
        self._serial = 0
        self._delivery = Delivery(self)
        self._blocking = BlockingRunner(self)
        # Seconds one leg of a call to ``target.method`` takes (``reply``: the answer).
        self.message_delay: Callable[[SimActor, str, bool], float] = \
            lambda target, method, reply: self._delivery.default_delay()
        # How one message from a caller to ``target.method`` travels, when a fault
        # decides: the delays of the copies that arrive (none: lost on the way; two: it
        # arrives twice). None: one copy, after ``message_delay``.
        self.route: Callable[[SimActor, SimActor, str], tuple[float, ...] | None] = \
            lambda caller, target, method: None
        # At-most-once delivery as Ray gives it: whether the answer of ``target.method``,
        # which ran, is lost on its way back (the caller sees what Ray's
        # ActorUnavailableError says: the call may or may not have run).
        self.lose_reply: Callable[[SimActor, str], bool] = lambda target, method: False
        # Virtual seconds a blocking call costs, by the function's name.
        self.io_cost: Callable[[str], float] = lambda name: 0.002
        # Decides, per blocking call, "fail", "tear" or None (by function name, args).
        self.io_faults: Callable[[str, tuple[Any, ...]], IoDecision] = lambda n, a: None
        # Every blocking call that completed: (time, actor, function name, args, result).
        self.io_log: list[tuple[float, str, str, tuple[Any, ...], Any]] = []
        self.kills: list[tuple[float, SimActor]] = []
        self.slow_links: list[tuple[float, float]] = []  # (sent at, delay) over a second
        # Called with (caller, callee, method, args) as each call is sent; with (callee,
        # method, args) as it starts to run there (the hook may kill the callee); with
        # (actor, function name) as a blocking call returns (the hook may kill the actor).
        self.on_send: Callable[[SimActor, SimActor, str, tuple[Any, ...]], None] | None = None
        self.on_deliver: Callable[[SimActor, str, tuple[Any, ...]], None] | None = None
        self.after_io: Callable[[SimActor, str], None] | None = None
        # The blocking call running now (by whom, which function), for the guard and the
        # fault-injecting wrappers: ``None`` outside one.
        self.running: SimActor | None = None
        self.running_name = ""
        self.thread_skip = 0.0  # how far the running call's clocks moved on (the guard)
        self.call_deadline_s = 30.0  # virtual seconds a blocked call's clocks move on first
        # Called (from the guard's thread) with (actor, function, where it waits) when a
        # blocking call did not return; then ``unblock`` runs.
        self.on_blocked: Callable[[SimActor, str, str], None] | None = None
        self.fifos: list[str] = []  # FIFOs made by the world's actors: ``unblock`` opens them
        # A steady clock model per new actor: seconds of wall-clock offset either way,
        # and the fraction its clocks' rate may differ (0: every clock true).
        self.clock_skew_s = 0.0
        self.clock_rate = 0.0
        self._clock_rng = random.Random(f"clocks-{seed}")
        # Slow death (as Ray notices it): seconds after a death until its callers learn
        # of it, and until its name is released after that (0, 0: at once).
        self.death_delay: Callable[[SimActor], tuple[float, float]] = lambda a: (0.0, 0.0)
        # Seconds a zombie (declared dead, then thawed) runs before its node's raylet
        # finds out and kills it.
        self.zombie_life: Callable[[SimActor], float] = lambda a: 0.0
        # The limit of concurrent calls of ``actor`` in a concurrency group (None: none).
        self.concurrency: Callable[[SimActor, str], int | None] = lambda a, g: None
        # Called with (callee, method, args, seconds waited, the methods of the calls
        # that were ahead of it, the group's limit) as a call that waited for a slot starts.
        self.on_queued: Callable[[SimActor, str, tuple[Any, ...], float, tuple[str, ...],
                                  int], None] | None = None
        self.declared: list[tuple[float, SimActor]] = []  # Ray declared it dead, alive
        self.stalls: list[tuple[float, float, list[SimActor]]] = []  # (from, to, whom)

    # --- tasks belong to the actor that started them ----------------------------------

    def _task_factory(self, loop: asyncio.AbstractEventLoop,
                      coro: Any) -> asyncio.Future[Any]:
        task = asyncio.Task(coro, loop=loop)
        owner = current_actor.get()  # the factory runs in the creator's context
        if owner is not None:
            if not owner.alive:
                task.cancel()
            # Kept after they finish (a schedule is short): a done callback per task to
            # drop it would cost the loop a turn each.
            owner.tasks[task] = None
        return task

    def spawn(self, actor: SimActor, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of ``actor``."""
        ctx = contextvars.copy_context()
        ctx.run(current_actor.set, actor)
        return ctx.run(self.loop.create_task, coro)  # a task copies the current context

    # --- actors -----------------------------------------------------------------------

    @property
    def last_serial(self) -> int:
        """The serial of the actor made last (an actor's is one more than its elder's)."""
        return self._serial

    def new_actor(self, kind: str, name: str, node: str) -> SimActor:
        self._serial += 1
        actor = SimActor(kind, name, node, serial=self._serial)
        self.set_clock(actor)
        self.actors.append(actor)
        if not self.nodes.get(node, False):
            actor.alive = False  # scheduled onto a dead node: it never starts
        return actor

    def set_clock(self, actor: SimActor) -> None:
        """Give ``actor`` its host's steady clock model (``clock_skew_s``, ``clock_rate``)."""
        model_clock(actor, self._clock_rng, self.clock_skew_s, self.clock_rate)

    def runtime(self, actor: SimActor) -> Runtime:
        """``actor``'s clocks and its blocking work (``actors.sim.runtime``)."""
        return self._blocking.runtime(actor)

    def transport(self, actor: SimActor, config: CheckpointConfig) -> SimTransport:
        return SimTransport(self, actor, config)

    def deliver(self, caller: SimActor, target: SimActor, method: str,
                args: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Send ``target.method(*args)``; the future gets its (copied) result
        (``actors.sim.delivery``)."""
        return self._delivery.deliver(caller, target, method, args)

    def unblock(self, first: Callable[[int], None] | None = None) -> int:
        """Let the blocked call go on, ``first`` told how many FIFOs had a reader
        waiting before it does (``BlockingRunner.unblock``); returns that count."""
        return self._blocking.unblock(first)

    def live(self, kind: str) -> list[SimActor]:
        """The actors of ``kind`` alive that Ray has not declared dead (no zombies)."""
        return [a for a in self.actors if a.kind == kind and a.alive and a.noticed_at is None]

    # --- nodes ------------------------------------------------------------------------

    def kill_node(self, node: str) -> None:
        self.nodes[node] = False
        for actor in self.actors:
            if actor.node == node:
                self.kill(actor)

    def add_node(self) -> str:
        node = f"node-{len(self.nodes)}"
        self.nodes[node] = True
        return node

    def alive_nodes(self) -> list[str]:
        return [n for n, alive in self.nodes.items() if alive]

    # --- deaths, as Ray notices them --------------------------------------------------

    def kill(self, actor: SimActor) -> None:
        """Kill one actor incarnation: its tasks are cancelled; its callers learn of it
        after ``death_delay`` (its calls fail then, or at their timeout), and its name
        resolves to the dead actor until it is released after that."""
        if not actor.alive:
            return
        actor.alive = False
        now = self.loop.time()
        self.kills.append((now, actor))
        if actor.noticed_at is None:  # a zombie's death was declared already
            notice, release = self.death_delay(actor)
            actor.noticed_at = now + notice
            self._release(actor, notice + release)
        current = asyncio.current_task(self.loop) if self.loop.is_running() else None
        for task in list(actor.tasks):
            if task is not current and not task.done():
                task.cancel()

    def _release(self, actor: SimActor, after: float) -> None:
        """Ray releases ``actor``'s name ``after`` seconds from now."""
        if after > 0:
            self.loop.call_later(after, self._release, actor, 0.0, context=NO_ACTOR)
            return
        for key, registered in list(self.registry.items()):
            if registered is actor:
                del self.registry[key]

    def stall(self, actors: list[SimActor], seconds: float, detect: float,
              node: str | None = None) -> None:
        """Freeze ``actors`` (a stalled node: their messages, answers and blocking work
        wait) for ``seconds``. A stall longer than ``detect`` makes Ray declare them dead
        (and ``node``, if given) at ``detect``: their calls fail, their names are
        released, and after the stall they run again as zombies for ``zombie_life``."""
        now = self.loop.time()
        for actor in actors:
            actor.stalled_until = max(actor.stalled_until, now + seconds)
        self.stalls.append((now, now + seconds, list(actors)))
        if seconds > detect:
            self.loop.call_later(detect, self._declare, list(actors), node,
                                 context=NO_ACTOR)

    def _declare(self, actors: list[SimActor], node: str | None) -> None:
        now = self.loop.time()
        if node is not None:
            self.nodes[node] = False
        for actor in actors:
            if not actor.alive or actor.noticed_at is not None:
                continue
            actor.noticed_at = now
            self.declared.append((now, actor))
            self._release(actor, self.death_delay(actor)[1])
            for done in actor.inbox:
                settle(done, exc=ActorDied(f"{actor} was declared dead"))
            actor.inbox.clear()
            life = max(0.0, actor.stalled_until - now) + self.zombie_life(actor)
            self.loop.call_later(life, self.kill, actor, context=NO_ACTOR)
