"""The runtime over Ray: the one module that names Ray's actor API.

``RayTransport`` finds holders by name prefix in the job's namespace, lists alive nodes,
creates holders pinned to their node and the coordinator pinned beside the driver, calls
them, and turns Ray's errors into the transport's contract (``nemo_ckpt.transport``).
``SessionHolderActor`` and ``CheckpointCoordinatorActor`` are the plain classes as Ray
actors, wired to this process's clock, metrics and threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import sys
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors import metrics
from actors.coordinator.actor import CheckpointCoordinator
from actors.coordinator.holders import FanRelay
from actors.drills import COORDINATOR_POINTS, HOLDER_POINTS, PhaseDelays
from actors.holder.actor import SessionHolder
from actors.holder.heap import HeapTrimmer, freeze_startup_objects
from nemo_ckpt import tracing
from nemo_ckpt.config import HOLDER_NAME_PREFIX, CheckpointConfig
from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.protocol.holder_api import concurrency_group
from nemo_ckpt.transport import (
    CONTROL_GROUP,
    COORDINATOR,
    HOLDER,
    RELAY,
    Actor,
    Runtime,
    unavailable_error,
)

__all__ = [
    "CheckpointCoordinatorActor",
    "RayMetrics",
    "RayTransport",
    "SessionHolderActor",
    "is_ray_unavailable",
]

T = TypeVar("T")


class RayMetrics:
    """Prometheus metrics through ``ray.util.metrics`` (``actors.metrics``), each sample
    labelled with the job's Ray namespace (``actors.metrics.JOB_LABEL``)."""

    def __init__(self, namespace: str) -> None:
        self._job = {metrics.JOB_LABEL: namespace}

    def observe(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        metrics.observe(name, value, {**self._job, **(tags or {})})

    def inc(self, name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        metrics.inc(name, value, {**self._job, **(tags or {})})

    def set_gauge(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        metrics.set_gauge(name, value, {**self._job, **(tags or {})})


def is_ray_unavailable(error: BaseException) -> bool:
    """Whether ``error`` is Ray saying an actor died, is unreachable, or timed out."""
    return isinstance(error, (RayActorError, GetTimeoutError))


@dataclass(frozen=True)
class _Handle:
    """A Ray actor handle and the Ray session (the driver's job) it was made in: a
    handle does not outlive ``ray.shutdown()``; a new session looks the name up again."""

    ref: Any
    session: str


def _session() -> str:
    return str(ray.get_runtime_context().get_job_id())


async def _raise(error: BaseException) -> Any:
    raise error


def _method(actor: Actor, method: str) -> Any:
    """``actor``'s remote ``method``, in its concurrency group (``concurrency_group``)."""
    remote = getattr(actor.ref.ref, method)
    group = concurrency_group(actor.kind, method)
    return remote if group is None else remote.options(concurrency_group=group)


class RayTransport:
    """The actors of one namespace, reached through Ray (``nemo_ckpt.transport.Transport``)."""

    def __init__(self, config: CheckpointConfig, runtime: Runtime | None = None) -> None:
        self._config = config
        self._runtime = runtime or Runtime(metrics=RayMetrics(config.namespace))
        self._coordinator: Actor | None = None
        self._gcs: Any = None  # GCS's client, made on first use (draining_nodes)

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    @property
    def namespace(self) -> str:
        return self._config.namespace

    @property
    def cluster_id(self) -> str:
        self._require_ray()
        return str(ray.get_runtime_context().gcs_address)

    def _require_ray(self) -> None:
        if not ray.is_initialized():
            raise BackendUnavailableError(
                "Ray is not initialized; call ray.init() (or ray.init(address=...)) before "
                "using nemo-ckpt")

    def local_node(self) -> str:
        self._require_ray()
        return cast(str, ray.get_runtime_context().get_node_id())

    def alive_nodes(self) -> list[str]:
        self._require_ray()
        return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]

    def draining_nodes(self) -> dict[str, float | None]:
        # GCS's own client (``ray drain-node`` and the autoscaler set a drain there):
        # node id -> its deadline in ms since the epoch, 0 for none; bounded, as a GCS
        # that does not answer would hold a thread for ever.
        self._require_ray()
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        if self._gcs is None:
            self._gcs = GcsClient(address=ray.get_runtime_context().gcs_address)
        drains = self._gcs.get_draining_nodes(timeout=_GCS_TIMEOUT_S)
        return {str(node_id): (int(ms) / 1000 if ms else None)
                for node_id, ms in sorted(drains.items())}

    def is_registered_coordinator(self) -> bool:
        self._require_ray()
        try:
            registered = ray.get_actor(self._config.coordinator_name, namespace=self.namespace)
        except ValueError:  # no actor has the name now
            return False
        return bool(registered._actor_id.hex() == ray.get_runtime_context().get_actor_id())

    def coordinator(self) -> Actor:
        self._require_ray()
        if self._coordinator is not None and self._coordinator.ref.session != _session():
            self._coordinator = None  # made before ray.shutdown(): find it again by name
        if self._coordinator is None:
            # Pinned beside the driver (hard affinity: soft affinity was seen to spill
            # onto worker nodes), so losing a worker node never takes the coordinator.
            ref = CheckpointCoordinatorActor.options(
                name=self._config.coordinator_name, namespace=self.namespace,
                lifetime="detached", get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.local_node(),
                                                                   soft=False),
            ).remote(self._config)
            self._coordinator = Actor(COORDINATOR, COORDINATOR, _Handle(ref, _session()))
        return self._coordinator

    def _names(self, timeout_s: float | None = None) -> list[str]:
        self._require_ray()

        def names() -> list[str]:
            return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a.get("namespace") == self.namespace]

        return _bounded("list the named actors", names, timeout_s)

    def holders(self) -> dict[str, Actor]:
        found: dict[str, Actor] = {}
        for name in self._names():
            if name.startswith(HOLDER_NAME_PREFIX):
                instance_id = name[len(HOLDER_NAME_PREFIX):]
                handle = self.holder(instance_id)  # None: died between listing and lookup
                if handle is not None:
                    found[instance_id] = handle
        return found

    def holder(self, instance_id: str) -> Actor | None:
        self._require_ray()
        try:
            ref = ray.get_actor(HOLDER_NAME_PREFIX + instance_id, namespace=self.namespace)
        except ValueError:
            return None
        return Actor(HOLDER, instance_id, _Handle(ref, _session()))

    def create_holder(self, instance_id: str, node_id: str, options: dict[str, Any]) -> Actor:
        self._require_ray()
        ref = SessionHolderActor.options(
            name=HOLDER_NAME_PREFIX + instance_id, namespace=self.namespace,
            lifetime="detached", get_if_exists=True,
            max_concurrency=self._config.holder_turn_slots,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(instance_id, **options)
        return Actor(HOLDER, instance_id, _Handle(ref, _session()))

    def create_relay(self, node_id: str) -> Actor:
        self._require_ray()
        # Unnamed and owned by this process: it dies with the coordinator that made it.
        # Soft affinity: a relay may run anywhere, and its node may be dying.
        ref = FanRelayActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=True),
        ).remote(self._config)
        return Actor(RELAY, f"relay@{node_id[:8]}", _Handle(ref, _session()))

    def _current(self, actor: Actor) -> Actor:
        """``actor``, or its name looked up again if its handle is of an ended Ray
        session (nothing was sent through it in this one, so nothing ran)."""
        self._require_ray()
        if actor.ref.session == _session():
            return actor
        if actor.kind == RELAY:  # unnamed: the registry makes another
            raise unavailable_error(actor, "its lookup")
        if actor.kind == COORDINATOR:
            return self.coordinator()
        found = self.holder(actor.name)
        if found is None:
            raise unavailable_error(actor, "its lookup")
        return found

    def call(self, actor: Actor, method: str, *args: Any,
             timeout: float | None = None) -> Any:
        try:
            actor = self._current(actor)
            ref = _method(actor, method).remote(*args)  # sent now, awaited or not
        except BackendUnavailableError as exc:
            return _raise(exc)
        except TypeError:
            raise  # arguments that do not fit the method: a bug, not an outage
        except Exception as exc:  # Ray refused to submit it: it never ran
            return _raise(unavailable_error(actor, method, cause=exc))
        return self._result(actor, method, ref, timeout)

    async def _result(self, actor: Actor, method: str, ref: Any, timeout: float | None) -> Any:
        try:
            if timeout is None:
                return await ref
            return await asyncio.wait_for(ref, timeout)
        except asyncio.TimeoutError:
            raise unavailable_error(actor, method, timeout=timeout) from None
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, BaseException):
                raise cause from None
            raise
        except RayError as exc:
            # An actor dead or unreachable (ActorUnavailableError: the call may or may
            # not have run), a call cancelled, an owner or object lost, a full object
            # store: the callee is out of reach, and the caller learns what a mutating
            # call did from its operation's record (the driver's abort answers it).
            if actor.kind == COORDINATOR:
                self._coordinator = None  # the next call finds or creates a new one
            raise unavailable_error(actor, method, cause=exc) from exc

    def send(self, actor: Actor, method: str, *args: Any) -> None:
        with contextlib.suppress(Exception):  # forgotten: its errors are dropped anyway
            _method(self._current(actor), method).remote(*args)

    def kill(self, actor: Actor) -> None:
        with contextlib.suppress(ValueError, BackendUnavailableError):
            ray.kill(self._current(actor).ref.ref, no_restart=True)
        if actor.kind == COORDINATOR:
            self._coordinator = None

    def end_self(self) -> None:
        self._require_ray()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def kill_namespace(self, timeout_s: float | None = None) -> None:
        self._require_ray()

        def kill() -> None:
            for name in self.actor_names():
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(name, namespace=self.namespace))

        self._coordinator = None
        _bounded("kill the namespace's actors", kill, timeout_s)

    def actor_names(self, timeout_s: float | None = None) -> list[str]:
        return [name for name in self._names(timeout_s)
                if name.startswith(HOLDER_NAME_PREFIX) or name == self._config.coordinator_name]


# How long a look at the draining nodes waits for the GCS.
_GCS_TIMEOUT_S = 10.0


def _bounded(what: str, fn: Callable[[], T], timeout_s: float | None) -> T:
    """``fn()``, or ``BackendUnavailableError`` once ``timeout_s`` passed: Ray's calls to
    its GCS retry for as long as it is unreachable (a signal sent to the whole process
    group ends the local raylet and GCS too), so the call runs on a daemon thread of its
    own, which nothing waits for at exit (an executor's thread would hold the exit)."""
    if timeout_s is None:
        return fn()
    result: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            result.set_result(fn())
        except BaseException as exc:  # handed to the caller
            result.set_exception(exc)

    threading.Thread(target=run, name=f"nemo-ckpt: {what}", daemon=True).start()
    try:
        return result.result(timeout=max(0.0, timeout_s))
    except concurrent.futures.TimeoutError:
        raise BackendUnavailableError(
            f"Ray did not {what} within {timeout_s:g}s: its GCS or this node's raylet is "
            f"unreachable (a signal to the whole process group, as timeout and Slurm send, "
            f"ends them too); the actors end with the cluster") from None


_SWITCH_INTERVAL_S = 0.0005


class _HomeLoop:
    """One event loop, on a thread of its own, that runs all of a holder's code. Ray
    runs each concurrency group of an async actor on an event loop of its own, but a
    holder's state (its turn gate, its conditions, its tasks) belongs to one loop: each
    call, whichever group's slot Ray gave it, runs here."""

    def __init__(self) -> None:
        # A call now crosses threads twice (Ray's loop, this one): hand the GIL over
        # sooner than the default 5 ms, or each crossing may wait that long.
        sys.setswitchinterval(_SWITCH_INTERVAL_S)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="holder-loop",
                         daemon=True).start()

    async def run(self, call: Coroutine[Any, Any, Any]) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self.loop))


async def _sync_call(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return method(*args, **kwargs)


def _on_home_loop(name: str) -> Any:
    """``SessionHolder.<name>`` as a Ray method in its concurrency group, run on the
    holder's home loop."""
    original = getattr(SessionHolder, name)
    if inspect.iscoroutinefunction(original):
        async def call(self: _RaySessionHolder, *args: Any, **kwargs: Any) -> Any:
            return await self._home.run(original(self, *args, **kwargs))
    else:
        async def call(self: _RaySessionHolder, *args: Any, **kwargs: Any) -> Any:
            return await self._home.run(_sync_call(original, self, *args, **kwargs))
    call.__name__ = call.__qualname__ = name
    group = concurrency_group(HOLDER, name)
    return call if group is None else ray.method(concurrency_group=group)(call)


def _import_ahead() -> None:
    """Import as the actor starts what its first snapshot or restore would otherwise
    import in the middle of it: the bucket client, Ray's metrics, the tracing API where
    it is installed. A restarted job restores into fresh actors, so each of these was
    CPU spent inside its restore (``benchmarks.phase_breakdown --fresh-restore-holders``)."""
    import obstore.store  # noqa: F401
    import ray.util.metrics  # noqa: F401

    import nemo_ckpt.storage.object_folder  # noqa: F401

    tracing.enabled()


class _RaySessionHolder(SessionHolder):
    """A holder in its own Ray actor process, on the node it was pinned to."""

    def __init__(self, instance_id: str, **options: Any) -> None:
        _import_ahead()
        self._home = _HomeLoop()
        self._delays = PhaseDelays(HOLDER_POINTS)
        super().__init__(instance_id, node_id=ray.get_runtime_context().get_node_id(),
                         runtime=Runtime(
                             # The job's namespace, as its coordinator passes it.
                             metrics=RayMetrics(str(options.get(
                                 "namespace", CheckpointConfig().namespace))),
                             reached=self._delays.reached),
                         trimmer=HeapTrimmer(), **options)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def inject_delay(self, phase: str, seconds: float) -> None:
        """For tests and drills: make ``phase`` (``actors.drills.HOLDER_POINTS``) take
        ``seconds`` longer, so a fault can be aimed at it; 0 removes the delay."""
        self._delays.set(phase, seconds)


for _name, _member in inspect.getmembers(SessionHolder, inspect.isfunction):
    if not _name.startswith("_"):
        setattr(_RaySessionHolder, _name, _on_home_loop(_name))


class _RayCheckpointCoordinator(CheckpointCoordinator):
    """The coordinator in its own Ray actor process."""

    def __init__(self, config: CheckpointConfig) -> None:
        _import_ahead()
        self._delays = PhaseDelays(COORDINATOR_POINTS)
        super().__init__(config, RayTransport(
            config, Runtime(metrics=RayMetrics(config.namespace),
                            reached=self._delays.reached)))
        freeze_startup_objects()

    async def inject_delay(self, phase: str, seconds: float) -> None:
        """For tests and drills: make ``phase`` (``actors.drills.COORDINATOR_POINTS``)
        take ``seconds`` longer, so a fault can be aimed at it; 0 removes the delay."""
        self._delays.set(phase, seconds)


class _RayFanRelay(FanRelay):
    """A relay of the coordinator's fan-out in its own Ray actor process."""

    def __init__(self, config: CheckpointConfig) -> None:
        super().__init__(RayTransport(config))


def _holder_options() -> dict[str, Any]:
    # No CPU reserved: a holder must fit on any node, beside the environment workers.
    # Session calls run in the default slots (max_concurrency, set per job from
    # CheckpointConfig.holder_turn_slots); control calls in their own group.
    return {"num_cpus": 0, "max_concurrency": 10_000, "max_restarts": 0,
            "concurrency_groups": {CONTROL_GROUP: _CONTROL_SLOTS}}


# Control calls a holder runs at once: one operation's calls at a time, plus status.
_CONTROL_SLOTS = 64


# ray.remote's overloads do not type actor options; the handles are dynamic anyway.
SessionHolderActor: Any = cast(Any, ray.remote)(**_holder_options())(_RaySessionHolder)
CheckpointCoordinatorActor: Any = cast(Any, ray.remote)(
    num_cpus=0, max_concurrency=1000, max_restarts=0)(_RayCheckpointCoordinator)
FanRelayActor: Any = cast(Any, ray.remote)(
    num_cpus=0, max_concurrency=1000, max_restarts=0)(_RayFanRelay)
