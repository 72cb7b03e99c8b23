"""One simulated actor incarnation (``SimActor``), the actor whose code runs now
(``current_actor``), and how its calls end: the errors a caller sees and the settling of a
call's future."""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from actors.drills import COORDINATOR_POINTS, HOLDER_POINTS, PhaseDelays

__all__ = ["NO_ACTOR", "ActorDied", "IoFault", "SimActor", "current_actor", "retrieve",
           "settle"]


class ActorDied(Exception):
    """The callee died before it answered (what Ray reports as an actor error)."""


class IoFault(Exception):
    """Raised inside ``run_blocking`` when the world tears a write: the caller dies."""


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
    # Where a test makes its phases wait (``actors.drills``): its runtime's ``reached``.
    delays: PhaseDelays = field(init=False)

    def __post_init__(self) -> None:
        self.delays = PhaseDelays(
            {"holder": HOLDER_POINTS, "coordinator": COORDINATOR_POINTS}.get(
                self.kind, frozenset()))

    @property
    def zombie(self) -> bool:
        return self.alive and self.noticed_at is not None

    def __repr__(self) -> str:
        state = "" if self.alive and self.noticed_at is None else (
            " zombie" if self.alive else " dead")
        return f"<{self.kind} {self.name}#{self.serial}{state}>"


current_actor: contextvars.ContextVar[SimActor | None] = contextvars.ContextVar(
    "nemo_ckpt_sim_actor", default=None)

# The context of the world's own callbacks (a message on its way, a thread's completion):
# they belong to no actor.
NO_ACTOR = contextvars.Context()


def retrieve(done: asyncio.Future[Any]) -> None:
    """Mark ``done``'s error as seen: nobody may wait for it any more."""
    if not done.cancelled():
        done.exception()


def settle(done: asyncio.Future[Any], value: Any = None,
           exc: BaseException | None = None) -> None:
    """End the call ``done`` with ``value`` or ``exc``, unless it ended already."""
    if done.done():
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(value)
