"""The coordinator's holders: discovery, creation, placement, and the fan-out.

``HolderRegistry`` knows which holder serves which instance on which node. It finds
them through the transport, creates one on each alive node that has none (or, for a
restore, one for each instance the snapshot names, on the least loaded node), and
calls a phase on many holders at once (``fan``), aggregating their failures.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nemo_ckpt.errors import BackendUnavailableError, aggregate
from nemo_ckpt.holder_api import HolderCalls
from nemo_ckpt.phases import HolderInfo, instance_sort_key
from nemo_ckpt.restore_plan import least_loaded_node
from nemo_ckpt.transport import Actor, Transport

__all__ = ["HolderRegistry", "PHASE_LOGGER"]

T = TypeVar("T")
# The logger of the phase lines (``fan`` with an operation id): one JSON object each.
PHASE_LOGGER = "nemo_ckpt.coordinator"
log = logging.getLogger(PHASE_LOGGER)


class HolderRegistry:
    """Which holder serves which instance, and calls to many of them at once."""

    def __init__(self, transport: Transport, timeout: Callable[[], float],
                 options: Callable[[], dict[str, Any]]) -> None:
        self._transport = transport
        self._clock = transport.runtime.clock
        self._timeout = timeout  # a control call's timeout (the config may be adopted)
        self._options = options  # the SessionHolder keyword arguments of this job
        self._holders: dict[str, Actor] = {}  # instance id -> actor handle
        self._nodes: dict[str, str] = {}  # instance id -> node id
        self._registered: dict[str, Actor] = {}  # every holder the last discovery listed
        self.lock = asyncio.Lock()  # placement: one discovery or creation at a time

    @property
    def handles(self) -> dict[str, Actor]:
        """The holders known now, by instance id, in instance order."""
        return {i: self._holders[i] for i in sorted(self._holders, key=instance_sort_key)}

    @property
    def registered(self) -> dict[str, Actor]:
        """Every holder the last discovery listed, answering or not."""
        return dict(self._registered)

    def node_of(self, instance_id: str) -> str:
        return self._nodes[instance_id]

    def forget(self) -> None:
        """A holder is gone or late: the next phase re-discovers."""
        self._holders = {}

    async def discover(self) -> list[HolderInfo]:
        """Ask every registered holder for its info; those that do not answer are lost."""
        found = self._transport.holders()
        self._registered = found
        results = await asyncio.gather(
            *(HolderCalls(self._transport, h, self._timeout()).info()
              for h in found.values()),
            return_exceptions=True)
        infos = []
        self._holders = {}
        self._nodes = {}
        for (inst, handle), res in zip(found.items(), results, strict=True):
            if isinstance(res, HolderInfo):
                self._holders[inst] = handle
                self._nodes[inst] = res.node_id
                infos.append(res)
            else:
                log.warning("holder %s does not answer (%s); treating it as lost", inst, res)
        return infos

    async def ensure(self) -> list[HolderInfo]:
        """Find every live holder, and create one on each alive node that has none."""
        async with self.lock:
            infos = await self.discover()
            hosted = {i.node_id for i in infos}
            for node_id in self._transport.alive_nodes():
                if node_id not in hosted:
                    try:
                        infos.append(await self.create(self._free_instance_id(), node_id))
                    except BackendUnavailableError as exc:
                        # Typically a node that died but is not yet declared dead. A
                        # node that stays without a holder fails check_startup.
                        log.warning("no holder could start on node %s: %s", node_id, exc)
            return sorted(infos, key=_instance_order)

    async def known(self) -> dict[str, Actor]:
        """The holders to fan out to, re-discovered (and created on new nodes) only when
        none are known or the alive nodes changed: discovery costs a GCS round trip per
        holder, which the pause must not pay every time."""
        alive = set(self._transport.alive_nodes())
        if not self._holders or alive != set(self._nodes.values()):
            await self.ensure()
        return self.handles

    async def infos(self) -> list[HolderInfo]:
        """Every live holder's info, without creating any."""
        return sorted(await self.discover(), key=_instance_order)

    async def place(self, instances: list[str]) -> dict[str, str]:
        """Create a holder for each of ``instances`` that has none, each on the least
        loaded alive node; returns every known instance's node."""
        await self.known()
        async with self.lock:
            for inst in sorted(instances, key=instance_sort_key):
                if inst not in self._holders:
                    infos = await self.discover()
                    node = least_loaded_node(self._transport.alive_nodes(),
                                             [i.node_id for i in infos])
                    await self.create(inst, node)
        return {i: self._nodes[i] for i in self.handles}

    async def create(self, instance_id: str, node_id: str) -> HolderInfo:
        handle = self._transport.create_holder(instance_id, node_id, self._options())
        info = await HolderCalls(self._transport, handle, self._timeout()).info()
        self._holders[instance_id] = handle
        self._nodes[instance_id] = info.node_id
        log.info("created holder %s on node %s", instance_id, node_id)
        return info

    def _free_instance_id(self) -> str:
        k = 0
        while f"holder-{k}" in self._holders:
            k += 1
        return f"holder-{k}"

    async def fan(
        self,
        holders: dict[str, Actor],
        what: str,
        call: Callable[[str, Actor], Awaitable[T]],
        tolerate_failures: bool = False,
        op_id: str | None = None,
    ) -> dict[str, T]:
        """Call every holder concurrently; after all have answered, raise one error that
        carries every holder's failure (``aggregate``), unless ``tolerate_failures``.

        With ``op_id``, logs one structured line: the phase, its per-holder seconds and
        the slowest holder, so that a slow pause names its cause.
        """
        targets = dict(holders)
        seconds: dict[str, float] = {}
        start = self._clock.monotonic()

        async def one(inst: str, handle: Actor) -> T:
            try:
                return await call(inst, handle)
            finally:
                seconds[inst] = self._clock.monotonic() - start

        results = await asyncio.gather(*(one(i, h) for i, h in targets.items()),
                                       return_exceptions=True)
        errors = {i: r for i, r in zip(targets, results, strict=True)
                  if isinstance(r, BaseException)}
        if any(isinstance(e, BackendUnavailableError) for e in errors.values()):
            self.forget()
        if op_id is not None:
            log_phase(op_id, what, self._clock.monotonic() - start, seconds,
                      {i: f"{type(e).__name__}: {e}" for i, e in errors.items()})
        if errors and not tolerate_failures:
            raise aggregate(what, errors)
        for inst, err in errors.items():
            log.info("%s on %s failed (tolerated): %s", what, inst, err)
        return {i: r for i, r in zip(targets, results, strict=True)
                if not isinstance(r, BaseException)}


def log_phase(op_id: str, phase: str, seconds: float, per_holder: dict[str, float],
              errors: dict[str, str]) -> None:
    """The phase line: ``nemo_ckpt {"event": "phase", ...}`` (benchmarks parse it)."""
    slowest = max(per_holder, key=lambda i: per_holder[i], default=None)
    line = {
        "event": "phase", "operation": op_id, "phase": phase, "seconds": round(seconds, 6),
        "holders": {i: round(t, 6) for i, t in sorted(per_holder.items())},
        "slowest": slowest,
    }
    if errors:
        line["errors"] = errors
    log.log(logging.WARNING if errors else logging.INFO, "nemo_ckpt %s", json.dumps(line))


def _instance_order(info: HolderInfo) -> tuple[int, str]:
    return instance_sort_key(info.instance_id)
