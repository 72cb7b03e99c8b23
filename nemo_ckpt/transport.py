"""The runtime's seams: how the driver, the coordinator and the holders reach each other,
what time it is, and where blocking work runs. Protocols and small values only; no Ray.

The driver (``RayEnvironmentCheckpoint``), the coordinator and the session holders never
call Ray themselves. They find, create, call and kill actors through a ``Transport``,
read time from a ``Clock``, and run blocking file work through ``Runtime.run_blocking``.
``actors.ray_transport.RayTransport`` is the real transport; ``actors.sim`` runs the
same driver, coordinator and holder code in one process, under a virtual clock and a
seeded transport (the deterministic simulation).

A transport's ``call`` has one error contract, whatever carries the call:

- the callee raised: the same exception is raised here (a ``NemoCkptError`` keeps its
  class and attributes);
- the callee died, is unreachable, or missed ``timeout``: ``BackendUnavailableError``,
  naming the actor and the method.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, TypeVar

__all__ = [
    "CONTROL_GROUP",
    "COORDINATOR",
    "detached",
    "on_daemon_thread",
    "HOLDER",
    "RELAY",
    "TRANSPORTS_GROUP",
    "Actor",
    "Clock",
    "Metrics",
    "NoMetrics",
    "Runtime",
    "SystemClock",
    "Transport",
    "runtime_transport",
    "unavailable_error",
]

T = TypeVar("T")


class Clock(Protocol):
    """Time as an actor sees it."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; deadlines and leases use it."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch; ids, markers and manifests carry it."""
        ...


class SystemClock:
    """The process's own clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class Metrics(Protocol):
    """Where the coordinator and the holders record their figures (Prometheus under Ray)."""

    def observe(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        ...

    def inc(self, name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        ...

    def set_gauge(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        ...


class NoMetrics:
    """Records nothing."""

    def observe(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        del name, value, tags

    def inc(self, name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        del name, value, tags

    def set_gauge(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        del name, value, tags


async def _to_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(fn, *args)


async def _passed(point: str) -> None:
    del point


def on_daemon_thread(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """``fn(*args)`` started now on a daemon thread of its own, its outcome in the future
    returned. Neither the interpreter's exit nor ``asyncio.run``'s end waits for it, as
    they wait for non-daemon threads and the loop's default executor: a call to a
    cluster whose control plane is gone may block for as long as the cluster retries."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()  # a waiter's cancellation cannot cancel it

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever waits
            future.set_exception(exc)

    name = getattr(fn, "__name__", "call")
    threading.Thread(target=run, name=f"nemo-ckpt: {name}", daemon=True).start()
    return future


async def detached(runtime: Runtime, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` through ``runtime.detach``, awaited without blocking the loop."""
    future = runtime.detach(fn, *args)
    if future.done():  # run inline (the simulation): nothing to wait for
        return future.result()
    return await asyncio.wrap_future(future)


@dataclass(frozen=True)
class Runtime:
    """What an actor's code needs from the process it runs in.

    ``run_blocking(fn, *args)`` runs file work off the event loop (a thread under Ray;
    inline, at a simulated cost, in the simulation). ``token()`` returns a fresh unique
    hex string (turn tokens, operation ids); seeded in the simulation, so that a seed
    replays exactly. ``reached(point)`` is awaited where a phase reaches a named point
    (``actors.drills`` lists them): it returns at once, unless a test or drill delays that
    point to aim a fault (a kill, a cancellation) at it. ``threads``: how many threads
    one piece of blocking work may spread over (a restore's sandbox directories: making
    files is the kernel's work, outside the GIL, and a few threads keep it busy,
    benchmarks/sandboxes_vs_restic.py); 1 in the simulation, whose file work runs
    inline, in an order its seed replays. ``detach(fn, *args)`` starts a call to the
    cluster's control plane now, off the event loop, and returns its future: such a call
    blocks while the control plane is unreachable, so it runs where nothing waits for it
    at exit (``on_daemon_thread``), each bounded by its caller's deadline; inline in the
    simulation (``detached`` awaits one).
    """

    clock: Clock = field(default_factory=SystemClock)
    metrics: Metrics = field(default_factory=NoMetrics)
    run_blocking: Callable[..., Awaitable[Any]] = _to_thread
    token: Callable[[], str] = field(default=lambda: uuid.uuid4().hex)
    reached: Callable[[str], Awaitable[None]] = _passed
    threads: int = 4
    detach: Callable[..., concurrent.futures.Future[Any]] = on_daemon_thread


HOLDER = "holder"
COORDINATOR = "coordinator"
RELAY = "relay"  # calls a group of holders for the coordinator (``create_relay``)

# A holder serves two kinds of calls: environment workers' session calls, which may wait
# at a paused holder's gate in any number, and the coordinator's control calls (pause,
# release, renewals, persist, abort, restore, status). A transport with a limit on
# concurrent calls (Ray's max_concurrency) gives control calls their own slots, so they
# never queue behind waiting turns (``nemo_ckpt.protocol.holder_api.concurrency_group``).
CONTROL_GROUP = "control"


@dataclass(frozen=True)
class Actor:
    """A handle on one actor: its kind (``HOLDER`` or ``COORDINATOR``), its name in
    messages (the instance id, or ``coordinator``), and whatever the transport needs to
    reach it."""

    kind: str
    name: str
    ref: Any = field(compare=False, repr=False)


def unavailable_error(actor: Actor, method: str, *, timeout: float | None = None,
                      cause: BaseException | None = None) -> Exception:
    """The ``BackendUnavailableError`` for a call to ``actor`` that died, was
    unreachable, or missed its ``timeout``: one wording for every transport."""
    from nemo_ckpt.errors import BackendUnavailableError

    coordinator = actor.kind == COORDINATOR
    who = ("the nemo-ckpt coordinator" if coordinator else
           f"the coordinator's relay {actor.name}" if actor.kind == RELAY else
           f"holder {actor.name}")
    if timeout is not None:
        error = BackendUnavailableError(
            f"{who} did not finish {method} within {timeout:.1f}s; it is overloaded or its "
            f"node is unreachable; retry")
        error.timed_out = True
    else:
        what = f" ({type(cause).__name__})" if cause is not None else ""
        consequence = ("holders resume by their lease; retry" if coordinator else
                       "the holders it called for the coordinator may not have heard; "
                       "retry" if actor.kind == RELAY else
                       "its node or process died; its sessions are lost and their rollouts "
                       "restart")
        error = BackendUnavailableError(
            f"{who} is unreachable during {method}{what}; {consequence}")
    error.unreachable = actor.kind
    return error


class Transport(Protocol):
    """Finds, creates, calls and kills the actors of one namespace."""

    @property
    def runtime(self) -> Runtime:
        """The clock, metrics and blocking-work runner of the process that holds this."""
        ...

    @property
    def namespace(self) -> str:
        ...

    @property
    def cluster_id(self) -> str:
        """Names the cluster: with the namespace, who owns a claim on a checkpoint path."""
        ...

    def local_node(self) -> str:
        """The id of the node this process runs on."""
        ...

    def alive_nodes(self) -> list[str]:
        """The ids of the nodes alive now."""
        ...

    def draining_nodes(self) -> dict[str, float | None]:
        """The alive nodes the cluster announced it drains (Ray's ``drain-node``: a
        preemption or a scale-down to come), by id, each with its deadline in seconds
        since the epoch as whoever asked for the drain set it (None: none); blocking."""
        ...

    def coordinator(self) -> Actor:
        """The namespace's coordinator, created beside this process if there is none."""
        ...

    def holders(self) -> dict[str, Actor]:
        """Every holder registered in the namespace, by instance id (dead ones may still
        be listed briefly; calls to them fail as unavailable)."""
        ...

    def is_registered_coordinator(self) -> bool:
        """Whether this process is the actor registered under the coordinator's name now:
        one that Ray declared dead may run again after a successor took the name."""
        ...

    def holder(self, instance_id: str) -> Actor | None:
        """The holder of ``instance_id``, or None if there is none."""
        ...

    def create_holder(self, instance_id: str, node_id: str, options: dict[str, Any]) -> Actor:
        """Start the holder of ``instance_id`` on ``node_id`` (or return the one that
        exists). ``options`` are the ``SessionHolder`` keyword arguments."""
        ...

    def create_relay(self, node_id: str) -> Actor:
        """Start a relay on ``node_id`` (``actors.coordinator.holders.FanRelay``): no state
        of its own, it calls a group of holders for the coordinator that created it,
        and dies with it."""
        ...

    def call(self, actor: Actor, method: str, *args: Any,
             timeout: float | None = None) -> Awaitable[Any]:
        """Send ``actor.method(*args)`` now and return its result's awaitable (see the
        module's error contract). The call is sent even if the awaitable is never
        awaited or its awaiting task is cancelled."""
        ...

    def send(self, actor: Actor, method: str, *args: Any) -> None:
        """Send ``actor.method(*args)`` and forget it: its result and errors are dropped."""
        ...

    def kill(self, actor: Actor) -> None:
        """Kill ``actor``; its state is lost."""
        ...

    def kill_namespace(self, timeout_s: float | None = None) -> None:
        """Kill the coordinator and every holder of the namespace; with ``timeout_s``,
        ``BackendUnavailableError`` once that passed (the cluster's control plane may
        never answer: Ray's GCS calls block while it is unreachable)."""
        ...

    def end_self(self) -> None:
        """End the actor this process is, as a kill would (its name is released once the
        cluster has seen it dead)."""
        ...

    def actor_names(self, timeout_s: float | None = None) -> list[str]:
        """The names the namespace's coordinator and holders are registered under now:
        a killed actor keeps its name until the cluster has seen it dead. ``timeout_s``:
        as ``kill_namespace``'s."""
        ...


# The entry-point group that names each runtime's ``Transport`` class (pyproject.toml).
TRANSPORTS_GROUP = "nemo_ckpt.transports"


def runtime_transport(config: Any, runtime: str = "ray") -> Transport:
    """The ``Transport`` of ``runtime`` for ``config``, found through the entry point
    that names it (Ray's: ``actors.ray_transport.RayTransport``), so the core imports
    nothing of the runtime's side, not even inside a function."""
    found = entry_points(group=TRANSPORTS_GROUP, name=runtime)
    if not found:
        raise ImportError(
            f"no {runtime!r} transport is installed (the {TRANSPORTS_GROUP!r} entry point "
            f"of the nemo-ckpt package names it): reinstall nemo-ckpt (`make install`, or "
            f"`pip install -e .` in its checkout)")
    transport: Transport = next(iter(found)).load()(config)
    return transport
