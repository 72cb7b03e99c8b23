"""The driver's own handles on the holders a snapshot paused, with which it releases
them itself as its block exits, beside its commit to the coordinator: one hop less than
the coordinator's release (the call order: ``nemo_ckpt.protocol.coordinator_api.CoordinatorApi``).

The handles are looked up by name through the driver's transport, off the pause's path
(in the background, through ``Runtime.detach``: a lookup that a cluster whose control
plane died holds must not hold the driver's exit, as the loop's default executor would):
first when the driver learns the holders' names
(``ensure_holders``, ``check_startup``), then whenever the coordinator names a new set
of holders at a snapshot's begin (``SnapshotBegun.holder_set``: a holder restarted,
added or lost). Until a new set's lookup ends, the handles held are used: one of a dead
incarnation reaches nobody. A release opens a holder's gate only if that holder is
paused for that very snapshot (``SessionHolder.release``), so a handle that is missing,
stale or late only loses the hop saved: the coordinator's release still comes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from nemo_ckpt.protocol.calls import call
from nemo_ckpt.protocol.coordinator_api import SnapshotBegun
from nemo_ckpt.protocol.holder_api import HolderControl
from nemo_ckpt.transport import Actor, Transport, detached

__all__ = ["HolderHandles"]

log = logging.getLogger("nemo_ckpt")


class HolderHandles:
    """Handles on the holders, by instance id, as last looked up."""

    def __init__(self, transport: Callable[[], Transport]) -> None:
        self._transport = transport  # the driver's, made on first use
        self._handles: dict[str, Actor] = {}
        self._handles_of = ""  # the holder set they were looked up for ("": none named)
        self._lookup: asyncio.Future[None] | None = None  # the latest, if any
        self._lookup_of = ""

    def learn(self, instances: Iterable[str]) -> None:
        """Start looking up ``instances``' handles unless some are held or being looked
        up: the driver learned the holders' names before any snapshot named a set."""
        if not self._handles and not self._looking_up():
            self._start("", tuple(instances))

    def prepare(self, begun: SnapshotBegun) -> None:
        """Start looking up the handles of ``begun``'s holders, unless those of its set
        are held, or being looked up on this event loop (one that an earlier
        ``asyncio.run`` closed never finishes its lookup). Returns at once."""
        named = begun.holder_set
        if not named or named == self._handles_of \
                or (named == self._lookup_of and self._looking_up()):
            return
        self._start(named, begun.instances)

    def _start(self, holder_set: str, instances: tuple[str, ...]) -> None:
        self._lookup_of = holder_set
        self._lookup = asyncio.ensure_future(self._look_up(holder_set, instances))

    def _looking_up(self) -> bool:
        lookup = self._lookup
        return lookup is not None and not lookup.done() \
            and lookup.get_loop() is asyncio.get_running_loop()

    async def _look_up(self, holder_set: str, instances: tuple[str, ...]) -> None:
        transport = self._transport()
        me = asyncio.current_task()

        def resolve() -> dict[str, Actor]:
            found = {}
            for instance_id in instances:
                handle = transport.holder(instance_id)
                if handle is not None:
                    found[instance_id] = handle
            return found

        try:
            found = await detached(transport.runtime, resolve)
        except Exception as exc:  # the coordinator's release still comes
            log.debug("looking the holders %s up failed: %s", instances, exc)
            return  # the next snapshot looks them up again
        if me is self._lookup:  # a later lookup supersedes this one
            self._handles, self._handles_of = found, holder_set

    def release(self, begun: SnapshotBegun) -> int:
        """Send ``release`` to each holder ``begun`` paused whose handle is held, the
        last instance first: the coordinator sends in instance order, so each holder
        gets the sooner of the two. Returns how many were sent; sending never raises."""
        transport = self._transport()
        release = call(HolderControl.release, begun.snapshot_id)
        sent = 0
        for instance_id in reversed(begun.instances):
            handle = self._handles.get(instance_id)
            if handle is not None:
                transport.send(handle, release.method, *release.args)
                sent += 1
        return sent
