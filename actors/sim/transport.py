"""``SimTransport``: ``nemo_ckpt.transport.Transport`` over a ``SimWorld``, as seen from
one (pseudo-)actor. It makes the real actor classes (``CheckpointCoordinator``,
``SessionHolder``, ``FanRelay``) in-process, as ``actors/ray_transport.py`` makes them on
Ray, resolves names as Ray does (a dead actor's name until it is released), and turns a
call that the callee's death or a deadline ended into ``BackendUnavailableError``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from actors.coordinator.actor import CheckpointCoordinator
from actors.coordinator.holders import FanRelay
from actors.holder.actor import SessionHolder
from actors.sim.actor import ActorDied, SimActor
from actors.sim.view import WorldView
from nemo_ckpt.config import HOLDER_NAME_PREFIX, CheckpointConfig
from nemo_ckpt.transport import COORDINATOR, HOLDER, RELAY, Actor, Runtime, unavailable_error

__all__ = ["SimTransport"]


class SimTransport:
    """``Transport`` over a ``SimWorld``, as seen from one (pseudo-)actor."""

    def __init__(self, world: WorldView, me: SimActor, config: CheckpointConfig) -> None:
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

    def draining_nodes(self) -> dict[str, float | None]:
        return {n: self._world.draining[n] for n in sorted(self._world.draining)
                if self._world.nodes.get(n)}

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
        actor = self._world.new_actor(RELAY, f"relay-{self._world.last_serial + 1}", node_id)
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

    def kill_namespace(self, timeout_s: float | None = None) -> None:
        del timeout_s  # in-process: it never waits
        for (ns, _), actor in list(self._world.registry.items()):
            if ns == self.namespace:
                self._world.kill(actor)
        self._coordinator = None

    def actor_names(self, timeout_s: float | None = None) -> list[str]:
        del timeout_s
        return [name for ns, name in self._world.registry if ns == self.namespace]
