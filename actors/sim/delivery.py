"""How a call travels in the simulated world: sent after a seeded delay (so calls to one
actor arrive in a seeded order, as Ray delivers an async actor's calls), its arguments and
answer pickled as between processes, lost or delivered twice when a fault says so
(``SimWorld.route``), held while its callee's node is stalled, queued per concurrency group
(``method_group``) past the callee's limit, run as a task of the callee, and answered
after another delay unless the answer is lost (``SimWorld.lose_reply``: at-most-once
delivery). A caller that stops waiting does not stop the call."""

from __future__ import annotations

import asyncio
import io
import pickle
from collections import deque
from typing import Any

from actors.sim.actor import NO_ACTOR, ActorDied, SimActor, retrieve, settle
from actors.sim.view import WorldView
from nemo_ckpt.protocol.holder_api import concurrency_group

__all__ = ["Delivery", "method_group"]


def method_group(kind: str, method: str) -> str:
    """The concurrency group an actor's ``method`` runs in at its callee (Ray's
    concurrency groups, each with its own limit), as the real actors declare them
    (``nemo_ckpt.transport.concurrency_group``): a holder's control calls apart from
    its session calls."""
    return concurrency_group(kind, method) or "default"


class Delivery:
    """The messages of one world: calls on their way, in queues, running, answered."""

    def __init__(self, world: WorldView) -> None:
        self._world = world

    def deliver(self, caller: SimActor, target: SimActor, method: str,
                args: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Send ``target.method(*args)``; the future gets its (copied) result."""
        world = self._world
        done: asyncio.Future[Any] = world.loop.create_future()
        if world.on_send is not None:
            world.on_send(caller, target, method, args)
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
        copies = world.route(caller, target, method)
        if copies is None:
            copies = (self._leg(target, method, False),)
        frozen = max(0.0, caller.stalled_until - world.loop.time())
        for k, delay in enumerate(copies):
            answer = done
            if k:  # a copy's answer goes nowhere: the caller has one
                answer = world.loop.create_future()
                answer.add_done_callback(retrieve)
            world.loop.call_later(delay + frozen, self._arrive, target, method, payload,
                                  answer, False, context=NO_ACTOR)
        return done

    def _leg(self, target: SimActor, method: str, reply: bool) -> float:
        """The delay of one message leg (a call or its answer); slow ones are noted."""
        world = self._world
        delay = world.message_delay(target, method, reply)
        if delay > 1.0:
            world.slow_links.append((world.loop.time(), delay))
        return delay

    def default_delay(self) -> float:
        """Seconds one leg takes when no fault decides: mostly fast, sometimes slow
        enough to be overtaken by later ones, now and then past most call deadlines."""
        rng = self._world.rng
        r = rng.random()
        if r < 0.8:
            return rng.uniform(0.0005, 0.003)
        if r < 0.97:
            return rng.uniform(0.003, 0.05)
        if r < 0.995:
            return rng.uniform(0.05, 0.5)
        return rng.uniform(2.0, 8.0)  # a stalled link: past most call deadlines

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
        world = self._world
        unpickler.persistent_load = lambda serial: world.actors[serial - 1]  # type: ignore[method-assign]
        return unpickler.load()

    def _arrive(self, target: SimActor, method: str, payload: bytes,
                done: asyncio.Future[Any], held: bool) -> None:
        world = self._world
        if not target.alive:
            self._fail(done, target, f"{target} is dead")
            return
        now = world.loop.time()
        if not held and target.noticed_at is not None and now >= target.noticed_at:
            # Ray declared it dead: nothing more reaches it (what reached its node before
            # runs as it thaws, ``held``).
            settle(done, exc=ActorDied(f"{target} was declared dead"))
            return
        frozen = target.stalled_until - now
        if frozen > 0:
            world.loop.call_later(frozen, self._arrive, target, method, payload, done, True,
                                  context=NO_ACTOR)
            return
        args = self._unpack(payload)
        if world.on_deliver is not None:
            world.on_deliver(target, method, args)
            if not target.alive:
                self._fail(done, target, f"{target} died as {method} arrived")
                return
        group = method_group(target.kind, method)
        limit = world.concurrency(target, group)
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
        run = self._world.spawn(target, getattr(target.obj, method)(*args))
        run.add_done_callback(lambda run: self._answer(target, method, run, done, group),
                              context=NO_ACTOR)

    def _next(self, target: SimActor, group: str) -> None:
        """A slot of ``group`` freed: the call waiting longest takes it (FIFO)."""
        world = self._world
        queue = target.queues[group]
        running = target.running[group]
        limit = world.concurrency(target, group) or 1
        while queue and len(running) < limit:
            method, payload, done, since, ahead = queue.popleft()
            if not target.alive:
                self._fail(done, target, f"{target} died while {method} waited for a slot")
                continue
            args = self._unpack(payload)
            if world.on_queued is not None:
                world.on_queued(target, method, args, world.loop.time() - since, ahead, limit)
            running.append(method)
            self._run(target, method, args, done, group)

    def _answer(self, target: SimActor, method: str, run: asyncio.Task[Any],
                done: asyncio.Future[Any], group: str | None = None) -> None:
        """The callee's task ended: its answer travels back, unless it died first."""
        world = self._world
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
        if world.lose_reply(target, method):
            reply = (None, ActorDied(f"the answer of {method} from {target} was lost (its "
                                     f"connection reset): it may or may not have run"))
        frozen = target.stalled_until - world.loop.time()
        world.loop.call_later(delay + frozen if frozen > 0 else delay, settle, done, *reply,
                              context=NO_ACTOR)

    def _fail(self, done: asyncio.Future[Any], target: SimActor, why: str) -> None:
        """Fail a call to ``target`` as unavailable once its death is noticed."""
        loop = self._world.loop
        wait = 0.0 if target.noticed_at is None else target.noticed_at - loop.time()
        if wait > 0:
            loop.call_later(wait, settle, done, None, ActorDied(why), context=NO_ACTOR)
        else:
            settle(done, exc=ActorDied(why))


def _copy_error(exc: BaseException) -> BaseException:
    """The callee's error as its caller gets it: a pickled copy, as Ray sends it."""
    try:
        copied: BaseException = pickle.loads(pickle.dumps(exc, protocol=5))
        return copied
    except Exception:
        return RuntimeError(f"unpicklable {type(exc).__name__}: {exc}")
