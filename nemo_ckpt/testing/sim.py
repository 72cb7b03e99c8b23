"""The real driver, coordinator and holders in one process, under a virtual clock and a
seeded transport: the world the deterministic simulation (``tests/simulation.py``) runs.

- ``VirtualTimeLoop`` is an asyncio loop whose clock jumps to the next timer whenever
  nothing is ready, so a lease of 30 s costs microseconds, and a run is a pure function of
  its seed (no threads, no wall time).
- ``SimWorld`` holds nodes and actors. Every actor (holder, coordinator, and the driver
  and environment workers as pseudo-actors) has its own clock offset, and every task it
  starts is its own: killing it cancels them all, as a process death would.
- ``SimTransport`` implements ``nemo_ckpt.transport.Transport``. Each call is delivered
  after a seeded delay, so calls to one actor arrive in a seeded order (as Ray delivers
  an async actor's calls), runs as a task of the callee, and its result travels back
  after another delay. Arguments and results are pickled on the way, as between
  processes. A caller that stops waiting (timeout, cancellation) does not stop the call.
- ``Runtime.run_blocking`` runs file work inline after a seeded virtual cost, and lets
  the world fail or tear chosen writes (``SimWorld.io_faults``).

Files are real (a temporary folder per world), so the format code is the real one.
"""

from __future__ import annotations

import asyncio
import contextvars
import pickle
import random
import selectors
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from actors.coordinator import CheckpointCoordinator
from actors.session_holder import SessionHolder
from nemo_ckpt.config import HOLDER_NAME_PREFIX, CheckpointConfig
from nemo_ckpt.transport import (
    COORDINATOR,
    HOLDER,
    Actor,
    NoMetrics,
    Runtime,
    unavailable_error,
)

__all__ = [
    "ActorDied",
    "IoFault",
    "SimActor",
    "SimTransport",
    "SimWorld",
    "VirtualTimeLoop",
    "current_actor",
]

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


class ActorDied(Exception):
    """The callee died before it answered (what Ray reports as an actor error)."""


class IoFault(Exception):
    """Raised inside ``run_blocking`` when the world tears a write: the caller dies."""


current_actor: contextvars.ContextVar[SimActor | None] = contextvars.ContextVar(
    "nemo_ckpt_sim_actor", default=None)


@dataclass(eq=False)
class SimActor:
    """One incarnation of an actor: its object, node, clock offset and tasks."""

    kind: str  # HOLDER, COORDINATOR, "driver" or "worker"
    name: str
    node: str
    obj: Any = None
    alive: bool = True
    clock_offset: float = 0.0
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    serial: int = 0

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name}#{self.serial}{'' if self.alive else ' dead'}>"


# The context of the transport's own callbacks: they belong to no actor.
_NO_ACTOR = contextvars.Context()


class _SimClock:
    def __init__(self, world: SimWorld, actor: SimActor) -> None:
        self._world = world
        self._actor = actor

    def monotonic(self) -> float:
        return self._world.loop.time() + self._actor.clock_offset

    def wall(self) -> float:
        return EPOCH + self.monotonic()


# What a blocking call may suffer, decided per call by ``SimWorld.io_faults``:
# "fail" raises OSError-like refusal before the work, "tear" leaves a partial temp
# file and kills the calling actor mid-write.
IoDecision = str | None


class SimWorld:
    """Nodes and actors of one simulated cluster, driven by one seeded RNG."""

    def __init__(self, seed: int, nodes: int = 3) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.loop = VirtualTimeLoop()
        self.loop.set_task_factory(self._task_factory)
        self.nodes: dict[str, bool] = {f"node-{k}": True for k in range(nodes)}
        self.registry: dict[tuple[str, str], SimActor] = {}  # (namespace, name) -> alive
        self.actors: list[SimActor] = []
        self._serial = 0
        # Delivery delay of a message, in seconds: mostly fast, sometimes slow enough
        # to be overtaken by later ones.
        # Seconds one leg of a call to ``target.method`` takes (``reply``: the answer).
        self.message_delay: Callable[[SimActor, str, bool], float] = \
            lambda target, method, reply: self._default_delay()
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

    def _leg(self, target: SimActor, method: str, reply: bool) -> float:
        """The delay of one message leg (a call or its answer); slow ones are noted."""
        delay = self.message_delay(target, method, reply)
        if delay > 1.0:
            self.slow_links.append((self.loop.time(), delay))
        return delay

    def _default_delay(self) -> float:
        r = self.rng.random()
        if r < 0.8:
            return self.rng.uniform(0.0005, 0.003)
        if r < 0.97:
            return self.rng.uniform(0.003, 0.05)
        if r < 0.995:
            return self.rng.uniform(0.05, 0.5)
        return self.rng.uniform(2.0, 8.0)  # a stalled link: past most call deadlines

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
            owner.tasks.add(task)
        return task

    def spawn(self, actor: SimActor, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of ``actor``."""
        ctx = contextvars.copy_context()
        ctx.run(current_actor.set, actor)
        return ctx.run(self.loop.create_task, coro)  # a task copies the current context

    # --- actors -----------------------------------------------------------------------

    def new_actor(self, kind: str, name: str, node: str) -> SimActor:
        self._serial += 1
        actor = SimActor(kind, name, node, serial=self._serial)
        self.actors.append(actor)
        if not self.nodes.get(node, False):
            actor.alive = False  # scheduled onto a dead node: it never starts
        return actor

    def runtime(self, actor: SimActor) -> Runtime:
        return Runtime(clock=_SimClock(self, actor), metrics=NoMetrics(),
                       run_blocking=self._blocking_runner(actor),
                       token=lambda: f"{self.rng.getrandbits(64):016x}")

    def _blocking_runner(self, actor: SimActor) -> Callable[..., Awaitable[Any]]:
        async def run_blocking(fn: Callable[..., Any], *args: Any) -> Any:
            name = getattr(fn, "__name__", repr(fn))
            if not actor.alive:
                raise asyncio.CancelledError()  # a dead process does nothing more
            await asyncio.sleep(self.io_cost(name))
            decision = self.io_faults(name, args)
            if decision == "fail":
                from nemo_ckpt.errors import SnapshotWriteError

                raise SnapshotWriteError(str(args[0]) if args else "?",
                                         f"injected failure of {name}")
            if decision == "tear":
                self.kill(actor)
                raise IoFault(f"{actor} died in the middle of {name}")
            result = fn(*args)
            self.io_log.append((self.loop.time(), actor.name, name, args, result))
            if self.after_io is not None:
                self.after_io(actor, name)
                if not actor.alive:
                    raise IoFault(f"{actor} died right after {name}")
            return result

        return run_blocking

    def kill(self, actor: SimActor) -> None:
        """Kill one actor incarnation: its tasks are cancelled, its calls fail."""
        if not actor.alive:
            return
        actor.alive = False
        self.kills.append((self.loop.time(), actor))
        for key, registered in list(self.registry.items()):
            if registered is actor:
                del self.registry[key]
        current = asyncio.current_task(self.loop) if self.loop.is_running() else None
        for task in list(actor.tasks):
            if task is not current and not task.done():
                task.cancel()

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

    def live(self, kind: str) -> list[SimActor]:
        return [a for a in self.actors if a.kind == kind and a.alive]

    def transport(self, actor: SimActor, config: CheckpointConfig) -> SimTransport:
        return SimTransport(self, actor, config)

    # --- delivery ---------------------------------------------------------------------

    def deliver(self, caller: SimActor, target: SimActor, method: str,
                args: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Send ``target.method(*args)``; the future gets its (copied) result."""
        done: asyncio.Future[Any] = self.loop.create_future()
        if self.on_send is not None:
            self.on_send(caller, target, method, args)
        payload = pickle.dumps(args, protocol=5)
        # The message travels on its own (timer callbacks, no task of the caller):
        # neither the caller's death nor its cancellation stops it, as with a Ray call
        # already sent. Callbacks rather than a task per message: the simulation's
        # schedules are mostly event-loop turns.
        self.loop.call_later(self._leg(target, method, False), self._arrive,
                             target, method, payload, done, context=_NO_ACTOR)
        return done

    def _arrive(self, target: SimActor, method: str, payload: bytes,
                done: asyncio.Future[Any]) -> None:
        if not target.alive:
            _settle(done, exc=ActorDied(f"{target} is dead"))
            return
        args = pickle.loads(payload)
        if self.on_deliver is not None:
            self.on_deliver(target, method, args)
            if not target.alive:
                _settle(done, exc=ActorDied(f"{target} died as {method} arrived"))
                return
        run = self.spawn(target, getattr(target.obj, method)(*args))
        run.add_done_callback(lambda run: self._answer(target, method, run, done),
                              context=_NO_ACTOR)

    def _answer(self, target: SimActor, method: str, run: asyncio.Task[Any],
                done: asyncio.Future[Any]) -> None:
        """The callee's task ended: its answer travels back, unless it died first."""
        if run.cancelled():  # the callee died (its tasks were cancelled), or cancelled it
            why = "died" if not target.alive else "cancelled its task"
            _settle(done, exc=ActorDied(f"{target} {why} during {method}"))
            return
        if not target.alive:  # the dead never answer
            _settle(done, exc=ActorDied(f"{target} died during {method}"))
            return
        exc = run.exception()
        if exc is not None:  # the callee raised: the caller gets a copy
            reply: tuple[Any, BaseException | None] = (None, _copy_error(exc))
        else:
            try:  # copied as it leaves, as Ray serializes a return value
                reply = (pickle.loads(pickle.dumps(run.result(), protocol=5)), None)
            except Exception as error:  # an unpicklable reply is a bug in the callee
                reply = (None, error)
        self.loop.call_later(self._leg(target, method, True), _settle, done, *reply,
                             context=_NO_ACTOR)


def _settle(done: asyncio.Future[Any], value: Any = None,
            exc: BaseException | None = None) -> None:
    if done.done():
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(value)


def _copy_error(exc: BaseException) -> BaseException:
    try:
        copied: BaseException = pickle.loads(pickle.dumps(exc, protocol=5))
        return copied
    except Exception:
        return RuntimeError(f"unpicklable {type(exc).__name__}: {exc}")


class SimTransport:
    """``Transport`` over a ``SimWorld``, as seen from one (pseudo-)actor."""

    def __init__(self, world: SimWorld, me: SimActor, config: CheckpointConfig) -> None:
        self._world = world
        self._me = me
        self._config = config
        self._runtime = world.runtime(me)

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    @property
    def namespace(self) -> str:
        return self._config.namespace

    @property
    def cluster_id(self) -> str:
        return f"sim-{self._world.seed}"

    @property
    def me(self) -> SimActor:
        return self._me

    def local_node(self) -> str:
        return self._me.node

    def alive_nodes(self) -> list[str]:
        return self._world.alive_nodes()

    def coordinator(self) -> Actor:
        key = (self.namespace, self._config.coordinator_name)
        actor = self._world.registry.get(key)
        if actor is None:
            actor = self._world.new_actor(COORDINATOR, COORDINATOR, self._me.node)
            transport = SimTransport(self._world, actor, self._config)
            actor.obj = CheckpointCoordinator(self._config, transport)
            if actor.alive:
                self._world.registry[key] = actor
        return Actor(COORDINATOR, COORDINATOR, actor)

    def holders(self) -> dict[str, Actor]:
        prefix = HOLDER_NAME_PREFIX
        return {name[len(prefix):]: Actor(HOLDER, name[len(prefix):], actor)
                for (ns, name), actor in sorted(self._world.registry.items())
                if ns == self.namespace and name.startswith(prefix)}

    def holder(self, instance_id: str) -> Actor | None:
        actor = self._world.registry.get((self.namespace, HOLDER_NAME_PREFIX + instance_id))
        return None if actor is None else Actor(HOLDER, instance_id, actor)

    def create_holder(self, instance_id: str, node_id: str, options: dict[str, Any]) -> Actor:
        key = (self.namespace, HOLDER_NAME_PREFIX + instance_id)
        actor = self._world.registry.get(key)
        if actor is None:
            actor = self._world.new_actor(HOLDER, instance_id, node_id)
            actor.obj = SessionHolder(instance_id, node_id=node_id,
                                      runtime=self._world.runtime(actor),
                                      watch_period_s=1.0, **options)
            if actor.alive:
                self._world.registry[key] = actor
        return Actor(HOLDER, instance_id, actor)

    def call(self, actor: Actor, method: str, *args: Any,
             timeout: float | None = None) -> Awaitable[Any]:
        if not self._me.alive:
            raise asyncio.CancelledError()  # a dead process sends nothing
        done = self._world.deliver(self._me, actor.ref, method, args)
        return self._result(actor, method, done, timeout)

    async def _result(self, actor: Actor, method: str, done: asyncio.Future[Any],
                      timeout: float | None) -> Any:
        # What ``wait_for(shield(done), timeout)`` does, with one future and one timer:
        # the caller's cancellation or timeout leaves ``done`` (the call) running.
        loop = self._world.loop
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        done.add_done_callback(wake)
        timer = None if timeout is None else loop.call_later(timeout, wake)
        try:
            await waiter
        finally:
            done.remove_done_callback(wake)
            if timer is not None:
                timer.cancel()
        if not done.done():
            raise unavailable_error(actor, method, timeout=timeout)
        exc = done.exception()
        if isinstance(exc, ActorDied):
            raise unavailable_error(actor, method, cause=exc) from exc
        if exc is not None:
            raise exc
        return done.result()

    def send(self, actor: Actor, method: str, *args: Any) -> None:
        if self._me.alive:
            done = self._world.deliver(self._me, actor.ref, method, args)
            done.add_done_callback(lambda f: f.cancelled() or f.exception())

    def kill(self, actor: Actor) -> None:
        self._world.kill(actor.ref)

    def kill_namespace(self) -> None:
        for (ns, _), actor in list(self._world.registry.items()):
            if ns == self.namespace:
                self._world.kill(actor)
