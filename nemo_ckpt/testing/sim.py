"""The real driver, coordinator and holders in one process, under a virtual clock and a
seeded transport: the world the deterministic simulation (``tests/simulation/``) runs.

- ``VirtualTimeLoop`` is an asyncio loop whose clock jumps to the next timer whenever
  nothing is ready, so a lease of 30 s costs microseconds, and a run is a pure function of
  its seed (no wall time; one guard thread only watches for a call that blocks).
- ``SimWorld`` holds nodes and actors. Every actor (holder, coordinator, and the driver
  and environment workers as pseudo-actors) has its own clock offset, and every task it
  starts is its own: killing it cancels them all, as a process death would.
- ``SimTransport`` implements ``nemo_ckpt.transport.Transport``. Each call is delivered
  after a seeded delay, so calls to one actor arrive in a seeded order (as Ray delivers
  an async actor's calls), runs as a task of the callee, and its result travels back
  after another delay. Arguments and results are pickled on the way, as between
  processes. A caller that stops waiting (timeout, cancellation) does not stop the call.
  A fault may lose a message or deliver it twice (``SimWorld.route``), or lose the
  answer of a call that ran (``SimWorld.lose_reply``: at-most-once delivery).
- ``Runtime.run_blocking`` is a thread model: the work runs at a seeded later virtual
  time (two calls in flight run in a seeded order, one call at a time), whether or not
  its caller still waits (a thread outlives its cancelled caller; it dies with its
  process), and its result reaches the caller as an event after the rest of its seeded
  cost. The world may fail or tear chosen calls (``SimWorld.io_faults``). A call that
  does not return within ``GUARD_S`` real seconds is reported (``SimWorld.on_blocked``)
  and unblocked (``SimWorld.unblock``): see ``_Guard``.
- Every actor has its own clocks (``SimActor``): a steady offset of its wall clock, a
  monotonic clock of its own origin, a rate that differs a little from true time, and
  jumps (``clock_offset``).
- Ray as it behaves: a death is noticed after ``death_delay`` (calls to the dead fail
  then, or at their timeout) and its name resolves to the dead actor until released;
  ``stall`` freezes actors (their messages, answers and blocking work wait), and a stall
  past its detection delay makes Ray declare them dead: their calls fail and their names
  are released, yet they run again as zombies once the stall ends; each actor admits
  ``concurrency`` calls per group (``method_group``), the rest wait in FIFO order.

Files are real (a temporary folder per world), so the format code is the real one.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import os
import pickle
import random
import selectors
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.coordinator import CheckpointCoordinator
from actors.holder_registry import FanRelay
from actors.session_holder import SessionHolder
from nemo_ckpt.config import HOLDER_NAME_PREFIX, CheckpointConfig
from nemo_ckpt.transport import (
    COORDINATOR,
    HOLDER,
    RELAY,
    Actor,
    NoMetrics,
    Runtime,
    concurrency_group,
    unavailable_error,
)

__all__ = [
    "ActorDied",
    "method_group",
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


def method_group(kind: str, method: str) -> str:
    """The concurrency group an actor's ``method`` runs in at its callee (Ray's
    concurrency groups, each with its own limit), as the real actors declare them
    (``nemo_ckpt.transport.concurrency_group``): a holder's control calls apart from
    its session calls."""
    return concurrency_group(kind, method) or "default"


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
    clock_offset: float = 0.0  # jumps (both clocks), on top of the steady model below
    wall_offset: float = 0.0  # its host's wall clock minus true time, steady
    mono_origin: float = 0.0  # its monotonic clock at virtual time 0
    rate: float = 1.0  # seconds its clocks count per true second
    # In the order they started (a dict, not a set): a kill cancels them in that order,
    # whatever their addresses, so a seed replays the same.
    tasks: dict[asyncio.Task[Any], None] = field(default_factory=dict)
    serial: int = 0
    # When its callers learn that Ray declared it dead (its calls fail from then on);
    # None while Ray thinks it alive. An actor alive past it is a zombie.
    noticed_at: float | None = None
    stalled_until: float = 0.0  # its node is frozen until then: nothing it does shows
    inbox: list[asyncio.Future[Any]] = field(default_factory=list)  # calls sent to it
    # Per concurrency group: the methods running now, and the calls waiting for a slot
    # (method, args, answer, queued at, the methods of the calls ahead of it).
    running: dict[str, list[str]] = field(default_factory=dict)
    queues: dict[str, deque[tuple[str, bytes, asyncio.Future[Any], float, tuple[str, ...]]]] \
        = field(
        default_factory=dict)

    @property
    def zombie(self) -> bool:
        return self.alive and self.noticed_at is not None

    def __repr__(self) -> str:
        state = "" if self.alive and self.noticed_at is None else (
            " zombie" if self.alive else " dead")
        return f"<{self.kind} {self.name}#{self.serial}{state}>"


# The context of the transport's own callbacks: they belong to no actor.
_NO_ACTOR = contextvars.Context()


class _SimClock:
    def __init__(self, world: SimWorld, actor: SimActor) -> None:
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


# Real seconds a blocking call may take before the guard acts: sim calls take
# milliseconds, so this only trips on a call that waits for something that never comes.
GUARD_S = 0.5


class _Guard:
    """Watches the one blocking call running now, from a daemon thread. A call that has
    slept in the kernel for ``GUARD_S`` (a FIFO's open, a lock's wait) first sees its
    actor's clocks move on (``thread_skip``: virtual time does not pass while a call
    runs, so a wait on a clock would spin); after another ``GUARD_S`` it is reported and
    unblocked. Only the time the thread sleeps counts, where the system says
    (``/proc``): a call that waits for a core or for the GIL on a loaded machine is not
    blocked, and counting it would make a seed's schedule depend on the machine's load."""

    def __init__(self) -> None:
        self.world: SimWorld | None = None
        self.serial = 0  # counts the calls run
        self.busy = False  # whether one runs now
        self.thread_id = 0
        self._stat = Path("/proc/self/stat")
        self._thread: threading.Thread | None = None

    def start(self, world: SimWorld) -> None:
        self.world = world
        self.thread_id = threading.get_ident()
        self._stat = Path(f"/proc/self/task/{threading.get_native_id()}/stat")
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="sim-blocking-guard")
            self._thread.start()

    def _sleeping(self) -> bool:
        """Whether the watched thread sleeps in the kernel, other than on a futex (the
        GIL's, which the loaded machine may keep from it); True where ``/proc`` is not."""
        try:
            stat = self._stat.read_bytes()
            wchan = self._stat.with_name("wchan").read_bytes()
        except OSError:
            return True
        return stat[stat.rindex(b")") + 2:][:1] == b"S" and not wchan.startswith(b"futex")

    def _watch(self) -> None:
        seen, slept, stage = 0, 0.0, 0
        while True:
            time.sleep(GUARD_S / 4)
            serial, world = self.serial, self.world
            if not self.busy or world is None:
                seen, stage = 0, 0
                continue
            if serial != seen:
                seen, slept, stage = serial, 0.0, 0
                continue
            if self._sleeping():
                slept += GUARD_S / 4
            if slept < GUARD_S * (stage + 1):
                continue
            stage += 1
            if stage == 1:
                world.thread_skip = world.call_deadline_s
                continue
            where, running, name = self._where(), world.running, world.running_name
            world.thread_skip = 10 * 3600.0
            fifos = world.unblock()
            if stage == 2 and world.on_blocked is not None and running is not None:
                if fifos:
                    where += f", opening a FIFO ({fifos} opened for writing to free it)"
                world.on_blocked(running, name, where)

    def _where(self) -> str:
        """The innermost function of the project that the blocked call is in."""
        frame = sys._current_frames().get(self.thread_id)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith(("nemo_ckpt", "actors")) and \
                    not module.startswith("nemo_ckpt.testing"):
                return f"{frame.f_code.co_name} ({module}:{frame.f_lineno})"
            frame = frame.f_back
        return "?"


_GUARD = _Guard()


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
        self.thread_skip = 0.0  # how far the running call's clocks moved on (``_Guard``)
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
            owner.tasks[task] = None
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
        self.set_clock(actor)
        self.actors.append(actor)
        if not self.nodes.get(node, False):
            actor.alive = False  # scheduled onto a dead node: it never starts
        return actor

    def set_clock(self, actor: SimActor) -> None:
        """Give ``actor`` its host's steady clock model (``clock_skew_s``, ``clock_rate``)."""
        rng = self._clock_rng
        actor.mono_origin = rng.uniform(0.0, 1e6)  # its host booted whenever
        if self.clock_skew_s:
            actor.wall_offset = rng.uniform(-self.clock_skew_s, self.clock_skew_s)
        if self.clock_rate:
            actor.rate = 1.0 + rng.uniform(-self.clock_rate, self.clock_rate)

    def runtime(self, actor: SimActor) -> Runtime:
        return Runtime(clock=_SimClock(self, actor), metrics=NoMetrics(),
                       run_blocking=self._blocking_runner(actor),
                       token=lambda: f"{self.rng.getrandbits(64):016x}")

    def _blocking_runner(self, actor: SimActor) -> Callable[..., Awaitable[Any]]:
        async def run_blocking(fn: Callable[..., Any], *args: Any) -> Any:
            if not actor.alive:
                raise asyncio.CancelledError()  # a dead process does nothing more
            name = getattr(fn, "__name__", repr(fn))
            done = self.loop.create_future()
            # Nobody may wait for it any more (a cancelled caller): its error is dropped.
            done.add_done_callback(_retrieve)
            cost = self.io_cost(name)
            start = self.rng.uniform(0.0, cost)
            self.loop.call_later(start, self._execute, actor, fn, name, args, done,
                                 cost - start, context=_NO_ACTOR)
            return await asyncio.shield(done)

        return run_blocking

    def _execute(self, actor: SimActor, fn: Callable[..., Any], name: str,
                 args: tuple[Any, ...], done: asyncio.Future[Any], rest: float) -> None:
        """The thread runs ``fn`` now; its caller hears of it ``rest`` seconds later."""
        if not actor.alive:  # the thread died with its process
            done.cancel()
            return
        frozen = actor.stalled_until - self.loop.time()
        if frozen > 0:  # its node is stalled: the thread runs once it thaws
            self.loop.call_later(frozen, self._execute, actor, fn, name, args, done, rest,
                                 context=_NO_ACTOR)
            return
        decision = self.io_faults(name, args)
        if decision == "fail":
            from nemo_ckpt.errors import SnapshotWriteError

            self._complete(done, rest, exc=SnapshotWriteError(
                str(args[0]) if args else "?", f"injected failure of {name}"))
            return
        if decision == "tear":
            self.kill(actor)
            done.set_exception(IoFault(f"{actor} died in the middle of {name}"))
            return
        guard = _GUARD
        if guard.world is not self:
            guard.start(self)
        self.running, self.running_name = actor, name
        guard.serial += 1
        guard.busy = True
        try:
            result = fn(*args)
        except Exception as exc:
            self._complete(done, rest, exc=exc)
            return
        finally:
            guard.busy = False
            self.running = None
            self.thread_skip = 0.0  # a blocked call's clocks moved on (``_Guard``): no more
        self.io_log.append((self.loop.time(), actor.name, name, args, result))
        if self.after_io is not None:
            self.after_io(actor, name)
            if not actor.alive:
                done.set_exception(IoFault(f"{actor} died right after {name}"))
                return
        self._complete(done, rest, value=result)

    def _complete(self, done: asyncio.Future[Any], rest: float, value: Any = None,
                  exc: BaseException | None = None) -> None:
        self.loop.call_later(rest, _settle, done, value, exc, context=_NO_ACTOR)

    def unblock(self) -> int:
        """Let a blocked call go on: a FIFO's open returns once a writer opened it (and
        a read then sees its end); a wait on a clock sees ``thread_skip``. Returns how
        many FIFOs had a reader waiting."""
        freed = 0
        for path in self.fifos:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue  # no reader waits on it, or it is gone
            os.close(fd)
            freed += 1
        return freed

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
            self.loop.call_later(after, self._release, actor, 0.0, context=_NO_ACTOR)
            return
        for key, registered in list(self.registry.items()):
            if registered is actor:
                del self.registry[key]

    def _fail(self, done: asyncio.Future[Any], target: SimActor, why: str) -> None:
        """Fail a call to ``target`` as unavailable once its death is noticed."""
        wait = 0.0 if target.noticed_at is None else target.noticed_at - self.loop.time()
        if wait > 0:
            self.loop.call_later(wait, _settle, done, None, ActorDied(why),
                                 context=_NO_ACTOR)
        else:
            _settle(done, exc=ActorDied(why))

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
                                 context=_NO_ACTOR)

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
                _settle(done, exc=ActorDied(f"{actor} was declared dead"))
            actor.inbox.clear()
            life = max(0.0, actor.stalled_until - now) + self.zombie_life(actor)
            self.loop.call_later(life, self.kill, actor, context=_NO_ACTOR)

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
        """The actors of ``kind`` alive that Ray has not declared dead (no zombies)."""
        return [a for a in self.actors if a.kind == kind and a.alive and a.noticed_at is None]

    def transport(self, actor: SimActor, config: CheckpointConfig) -> SimTransport:
        return SimTransport(self, actor, config)

    # --- delivery ---------------------------------------------------------------------

    def deliver(self, caller: SimActor, target: SimActor, method: str,
                args: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Send ``target.method(*args)``; the future gets its (copied) result."""
        done: asyncio.Future[Any] = self.loop.create_future()
        if self.on_send is not None:
            self.on_send(caller, target, method, args)
        payload = self._pack(args)
        inbox = target.inbox
        if len(inbox) > 256:
            inbox[:] = [f for f in inbox if not f.done()]
        inbox.append(done)
        # The message travels on its own (timer callbacks, no task of the caller):
        # neither the caller's death nor its cancellation stops it, as with a Ray call
        # already sent. Callbacks rather than a task per message: the simulation's
        # schedules are mostly event-loop turns. A stalled caller's message leaves as it
        # thaws.
        copies = self.route(caller, target, method)
        if copies is None:
            copies = (self._leg(target, method, False),)
        frozen = max(0.0, caller.stalled_until - self.loop.time())
        for k, delay in enumerate(copies):
            answer = done
            if k:  # a copy's answer goes nowhere: the caller has one
                answer = self.loop.create_future()
                answer.add_done_callback(_retrieve)
            self.loop.call_later(delay + frozen, self._arrive, target, method, payload,
                                 answer, False, context=_NO_ACTOR)
        return done

    def _pack(self, value: Any) -> bytes:
        """``value`` pickled as between processes, an actor handle in it (a relay's
        arguments carry holders') by reference, as Ray pickles a handle."""
        try:
            return b"P" + pickle.dumps(value, protocol=5)
        except (TypeError, AttributeError, pickle.PicklingError):
            pass  # an actor in it: the slower pickler that keeps actors by reference
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=5)
        pickler.persistent_id = (  # type: ignore[method-assign]
            lambda obj: obj.serial if isinstance(obj, SimActor) else None)
        pickler.dump(value)
        return b"A" + buffer.getvalue()

    def _unpack(self, payload: bytes) -> Any:
        if payload[:1] == b"P":
            return pickle.loads(payload[1:])
        unpickler = pickle.Unpickler(io.BytesIO(payload[1:]))
        unpickler.persistent_load = lambda serial: self.actors[serial - 1]  # type: ignore[method-assign]
        return unpickler.load()

    def _arrive(self, target: SimActor, method: str, payload: bytes,
                done: asyncio.Future[Any], held: bool) -> None:
        if not target.alive:
            self._fail(done, target, f"{target} is dead")
            return
        now = self.loop.time()
        if not held and target.noticed_at is not None and now >= target.noticed_at:
            # Ray declared it dead: nothing more reaches it (what reached its node before
            # runs as it thaws, ``held``).
            _settle(done, exc=ActorDied(f"{target} was declared dead"))
            return
        frozen = target.stalled_until - now
        if frozen > 0:
            self.loop.call_later(frozen, self._arrive, target, method, payload, done, True,
                                 context=_NO_ACTOR)
            return
        args = self._unpack(payload)
        if self.on_deliver is not None:
            self.on_deliver(target, method, args)
            if not target.alive:
                self._fail(done, target, f"{target} died as {method} arrived")
                return
        group = method_group(target.kind, method)
        limit = self.concurrency(target, group)
        if limit is None:
            self._run(target, method, args, done, None)
            return
        running = target.running.setdefault(group, [])
        queue = target.queues.setdefault(group, deque())
        if len(running) < limit and not queue:
            running.append(method)
            self._run(target, method, args, done, group)
            return
        queue.append((method, payload, done, now, (*running, *(q[0] for q in queue))))

    def _run(self, target: SimActor, method: str, args: tuple[Any, ...],
             done: asyncio.Future[Any], group: str | None) -> None:
        run = self.spawn(target, getattr(target.obj, method)(*args))
        run.add_done_callback(lambda run: self._answer(target, method, run, done, group),
                              context=_NO_ACTOR)

    def _next(self, target: SimActor, group: str) -> None:
        """A slot of ``group`` freed: the call waiting longest takes it (FIFO)."""
        queue = target.queues[group]
        running = target.running[group]
        limit = self.concurrency(target, group) or 1
        while queue and len(running) < limit:
            method, payload, done, since, ahead = queue.popleft()
            if not target.alive:
                self._fail(done, target, f"{target} died while {method} waited for a slot")
                continue
            args = self._unpack(payload)
            if self.on_queued is not None:
                self.on_queued(target, method, args, self.loop.time() - since, ahead, limit)
            running.append(method)
            self._run(target, method, args, done, group)

    def _answer(self, target: SimActor, method: str, run: asyncio.Task[Any],
                done: asyncio.Future[Any], group: str | None = None) -> None:
        """The callee's task ended: its answer travels back, unless it died first."""
        if group is not None:
            target.running[group].remove(method)
            self._next(target, group)
        if run.cancelled():  # the callee died (its tasks were cancelled), or cancelled it
            why = "died" if not target.alive else "cancelled its task"
            self._fail(done, target, f"{target} {why} during {method}")
            return
        if not target.alive:  # the dead never answer
            self._fail(done, target, f"{target} died during {method}")
            return
        exc = run.exception()
        if exc is not None:  # the callee raised: the caller gets a copy
            reply: tuple[Any, BaseException | None] = (None, _copy_error(exc))
        else:
            try:  # copied as it leaves, as Ray serializes a return value
                reply = (pickle.loads(pickle.dumps(run.result(), protocol=5)), None)
            except Exception as error:  # an unpicklable reply is a bug in the callee
                reply = (None, error)
        delay = self._leg(target, method, True)
        if self.lose_reply(target, method):
            reply = (None, ActorDied(f"the answer of {method} from {target} was lost (its "
                                     f"connection reset): it may or may not have run"))
        frozen = target.stalled_until - self.loop.time()
        self.loop.call_later(delay + frozen if frozen > 0 else delay, _settle, done, *reply,
                             context=_NO_ACTOR)


def _retrieve(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()


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
        # Kept until a call finds it dead, as Ray's transport keeps its handle: a driver
        # reaches a successor only through a failed call, which makes it attach again.
        self._coordinator: SimActor | None = None

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

    def is_registered_coordinator(self) -> bool:
        registered = self._world.registry.get((self.namespace, self._config.coordinator_name))
        return registered is self._me

    def coordinator(self) -> Actor:
        if self._coordinator is not None:
            return Actor(COORDINATOR, COORDINATOR, self._coordinator)
        key = (self.namespace, self._config.coordinator_name)
        actor = self._world.registry.get(key)
        if actor is None:
            actor = self._world.new_actor(COORDINATOR, COORDINATOR, self._me.node)
            transport = SimTransport(self._world, actor, self._config)
            actor.obj = CheckpointCoordinator(self._config, transport)
            if actor.alive:
                self._world.registry[key] = actor
        self._coordinator = actor
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

    def create_relay(self, node_id: str) -> Actor:
        actor = self._world.new_actor(RELAY, f"relay-{self._world._serial + 1}", node_id)
        actor.obj = FanRelay(SimTransport(self._world, actor, self._config))
        return Actor(RELAY, actor.name, actor)

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
            if actor.kind == COORDINATOR:
                self._coordinator = None  # the next call finds or creates a new one
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
        if actor.kind == COORDINATOR:
            self._coordinator = None

    def end_self(self) -> None:
        self._world.kill(self._me)

    def kill_namespace(self) -> None:
        for (ns, _), actor in list(self._world.registry.items()):
            if ns == self.namespace:
                self._world.kill(actor)
        self._coordinator = None

    def actor_names(self) -> list[str]:
        return [name for ns, name in self._world.registry if ns == self.namespace]
