"""The driver's own handles on the holders a snapshot paused, with which it releases
them itself as its block exits, beside its commit to the coordinator: one hop less than
the coordinator's release (the call order: ``actors.coordinator``'s docstring).

The handles are looked up by name through the driver's transport, off the pause's path
(in the background while the caller's block runs), and kept as long as the coordinator
names the same set of holders (``SnapshotBegun.holder_set``); a set that changed (a
holder restarted, added or lost) is looked up again. A release opens a holder's gate
only if that holder is paused for that very snapshot (``SessionHolder.release``), so a
handle that is missing, stale or late only loses the hop saved: the coordinator's
release still comes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nemo_ckpt.coordinator_api import SnapshotBegun
from nemo_ckpt.holder_api import HolderCalls
from nemo_ckpt.transport import Actor, Transport

__all__ = ["HolderHandles"]

log = logging.getLogger("nemo_ckpt")


class HolderHandles:
    """Handles on the holders of the coordinator's last named holder set."""

    def __init__(self, transport: Callable[[], Transport]) -> None:
        self._transport = transport  # the driver's, made on first use
        self._set = ""  # the holder set the handles are of
        self._handles: dict[str, Actor] = {}
        self._lookup: asyncio.Future[None] | None = None

    def prepare(self, begun: SnapshotBegun) -> None:
        """Start looking up the handles of ``begun``'s holders, unless those of its set
        are held or being looked up on this event loop (one that an earlier
        ``asyncio.run`` closed never finishes its lookup). Returns at once."""
        if not begun.holder_set:
            return
        if begun.holder_set == self._set and (self._handles or self._looking_up()):
            return
        self._set, self._handles = begun.holder_set, {}
        self._lookup = asyncio.ensure_future(self._look_up(begun.holder_set,
                                                           begun.instances))

    def _looking_up(self) -> bool:
        lookup = self._lookup
        return lookup is not None and not lookup.done() \
            and lookup.get_loop() is asyncio.get_running_loop()

    async def _look_up(self, holder_set: str, instances: tuple[str, ...]) -> None:
        transport = self._transport()

        def resolve() -> dict[str, Actor]:
            found = {}
            for instance_id in instances:
                handle = transport.holder(instance_id)
                if handle is not None:
                    found[instance_id] = handle
            return found

        try:
            found = await transport.runtime.run_blocking(resolve)
        except Exception as exc:  # the coordinator's release still comes
            log.debug("looking the holders of set %s up failed: %s", holder_set, exc)
            return  # none held: the next snapshot looks them up again
        if self._set == holder_set:
            self._handles = found

    def release(self, begun: SnapshotBegun) -> int:
        """Send ``release`` to each holder ``begun`` paused whose handle is held, the
        last instance first: the coordinator sends in instance order, so each holder
        gets the sooner of the two. Returns how many were sent; sending never raises."""
        if begun.holder_set != self._set:
            return 0
        transport = self._transport()
        sent = 0
        for instance_id in reversed(begun.instances):
            handle = self._handles.get(instance_id)
            if handle is not None:
                HolderCalls(transport, handle, None).release(begun.snapshot_id)
                sent += 1
        return sent
