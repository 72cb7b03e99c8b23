"""The coordinator's holders: discovery, creation, placement, and the fan-out.

``HolderRegistry`` knows which holder serves which instance on which node. It finds
them through the transport, creates one on each alive node that has none (or, for a
restore, one for each instance the snapshot names, on the least loaded node), and
calls a phase on many holders at once (``fan``), aggregating their failures.

From ``relay_min_holders`` holders on, ``fan`` and ``send`` go through relays
(``FanRelay``, one per group of about the square root of the holders' number, each on a
node of its group): the coordinator's own work per phase then grows with the number of
groups, not of holders, and each relay calls its group from its own node
(benchmarks/README.md, "Fan-out model"). A relay keeps nothing: one that dies fails its
group's calls as unreachable, like the holders' own deaths, and the next phase makes
another.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from typing import Any, TypeVar

from actors.coordinator.restore_plan import place_instances
from actors.coordinator.retire_marks import RetireMarks
from nemo_ckpt.errors import BackendUnavailableError, aggregate
from nemo_ckpt.phases import HolderInfo, instance_sort_key
from nemo_ckpt.protocol.calls import Call
from nemo_ckpt.protocol.holder_api import holder_calls
from nemo_ckpt.transport import Actor, Transport

__all__ = ["FanRelay", "HolderRegistry", "PerHolder", "PHASE_LOGGER"]

T = TypeVar("T")
# The logger of the phase lines (``fan`` with an operation id): one JSON object each.
PHASE_LOGGER = "nemo_ckpt.coordinator"
log = logging.getLogger(PHASE_LOGGER)
# A relay's answer for one holder: its result, or the error it raised, and its seconds.
RelayAnswer = tuple[Any, BaseException | None, float]


# A fan-out's call: the same for every holder, or made for each by its instance id
# (``nemo_ckpt.protocol.calls.call`` of a ``HolderControl`` method either way).
PerHolder = Call[T] | Callable[[str], Call[T]]


def _call_of(made: PerHolder[T], instance_id: str) -> Call[T]:
    return made(instance_id) if callable(made) else made


class FanRelay:
    """A relay: calls a group of holders for the coordinator, from the relay's node, and
    answers with every holder's result or error (never raising for one)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._clock = transport.runtime.clock

    async def relay_call(self, method: str, timeout: float | None,
                         calls: dict[str, tuple[Actor, tuple[Any, ...]]]
                         ) -> dict[str, RelayAnswer]:
        start = self._clock.monotonic()

        async def one(handle: Actor, args: tuple[Any, ...]) -> RelayAnswer:
            try:
                result = await self._transport.call(handle, method, *args, timeout=timeout)
            except Exception as exc:  # the holder's error, carried back as a value
                return None, exc, self._clock.monotonic() - start
            return result, None, self._clock.monotonic() - start

        answers = await asyncio.gather(*(one(h, a) for h, a in calls.values()))
        return dict(zip(calls, answers, strict=True))

    async def relay_send(self, method: str,
                         sends: dict[str, tuple[Actor, tuple[Any, ...]]]) -> None:
        for handle, args in sends.values():
            self._transport.send(handle, method, *args)


class HolderRegistry:
    """Which holder serves which instance, and calls to many of them at once."""

    def __init__(self, transport: Transport, timeout: Callable[[], float],
                 options: Callable[[], dict[str, Any]],
                 relay_min: Callable[[], int] = lambda: 128,
                 marks: RetireMarks | None = None) -> None:
        self._transport = transport
        self._clock = transport.runtime.clock
        self._timeout = timeout  # a control call's timeout (the config may be adopted)
        self._options = options  # the SessionHolder keyword arguments of this job
        self._holders: dict[str, Actor] = {}  # instance id -> actor handle
        self._nodes: dict[str, str] = {}  # instance id -> node id
        self._registered: dict[str, Actor] = {}  # every holder the last discovery listed
        self.lock = asyncio.Lock()  # placement: one discovery or creation at a time
        self._relay_min = relay_min  # holders from which fan and send go through relays
        self._relays: dict[str, Actor] = {}  # node id -> the relay made there
        # RL's retire marks (``Ledger`` records them): every holder made starts with them.
        self.marks = marks if marks is not None else RetireMarks(lambda: 100_000)

    @property
    def handles(self) -> dict[str, Actor]:
        """The holders known now, by instance id, in instance order."""
        return {i: self._holders[i] for i in sorted(self._holders, key=instance_sort_key)}

    @property
    def registered(self) -> dict[str, Actor]:
        """Every holder the last discovery listed, answering or not."""
        return dict(self._registered)

    @property
    def relays(self) -> dict[str, Actor]:
        """The relays made so far and not failed, by the node each was made on."""
        return dict(self._relays)

    def node_of(self, instance_id: str) -> str:
        return self._nodes[instance_id]

    def forget(self) -> None:
        """A holder is gone or late: the next phase re-discovers."""
        self._holders = {}

    # --- relays -----------------------------------------------------------------------

    def _groups(self, targets: dict[str, Actor]) -> list[tuple[str, dict[str, Actor]]]:
        """``targets`` in groups of about the square root of their number, a node's
        holders together where they fit, each with the node its relay runs on."""
        order = sorted(targets, key=lambda i: (self._nodes.get(i, ""), instance_sort_key(i)))
        size = math.ceil(math.sqrt(len(order)))
        groups = []
        for lo in range(0, len(order), size):
            members = order[lo:lo + size]
            node = self._nodes.get(members[0]) or self._transport.local_node()
            groups.append((node, {i: targets[i] for i in members}))
        return groups

    def _relay(self, node_id: str) -> Actor:
        relay = self._relays.get(node_id)
        if relay is None:
            relay = self._relays[node_id] = self._transport.create_relay(node_id)
        return relay

    def _drop_relay(self, node_id: str) -> None:
        """Forget a relay that failed or whose node is gone, and end it if it is not:
        at most one relay per node lives at a time."""
        relay = self._relays.pop(node_id, None)
        if relay is not None:
            self._transport.kill(relay)

    def _relayed(self, targets: dict[str, Actor]) -> bool:
        return len(targets) >= self._relay_min()

    def send(self, holders: dict[str, Actor], message: Call[None]) -> None:
        """Send ``message`` (a ``one_way`` call) to every holder and forget it (through
        relays from ``relay_min_holders`` on: one message per group)."""
        if not message.one_way:
            raise TypeError(f"{message.method} is a call, not a message: fan it out")
        if not self._relayed(holders):
            for handle in holders.values():
                self._transport.send(handle, message.method, *message.args)
            return
        for node, group in self._groups(holders):
            self._transport.send(self._relay(node), "relay_send", message.method,
                                 {i: (h, message.args) for i, h in group.items()})

    async def _through_relays(self, targets: dict[str, Actor], made: PerHolder[Any],
                              seconds: dict[str, float], direct_after_relay: bool
                              ) -> dict[str, Any]:
        """Each group's calls through its relay. A relay that fails fails its group, or,
        with ``direct_after_relay`` (the calls that end or keep up an operation:
        resume, renewals, which holders take twice as once), has the coordinator
        call that group itself: a dead relay must not leave holders paused."""
        calls = {i: _call_of(made, i) for i in targets}
        first = next(iter(calls.values()))
        timeout = self._timeout() if first.timeout is None else first.timeout
        out: dict[str, Any] = {}

        async def group_call(node: str, group: dict[str, Actor]) -> None:
            relay = self._relay(node)
            start = self._clock.monotonic()
            try:
                # The relay's own hop on top of its holders' timeout.
                answers: dict[str, RelayAnswer] = await self._transport.call(
                    relay, "relay_call", first.method, timeout,
                    {i: (h, calls[i].args) for i, h in group.items()},
                    timeout=timeout + self._timeout())
            except Exception as exc:
                if self._relays.get(node) is relay:
                    self._drop_relay(node)  # the next phase makes another
                if direct_after_relay:
                    log.warning("relay %s failed during %s (%s); calling its %d holders "
                                "directly", relay.name, first.method, exc, len(group))
                    answers_direct = await asyncio.gather(
                        *(self._direct(h, calls[i]) for i, h in group.items()),
                        return_exceptions=True)
                    for inst, res in zip(group, answers_direct, strict=True):
                        out[inst] = res
                        seconds[inst] = self._clock.monotonic() - start
                    return
                for inst in group:
                    out[inst] = exc
                    seconds[inst] = self._clock.monotonic() - start
                return
            for inst, (result, error, spent) in answers.items():
                out[inst] = result if error is None else error
                seconds[inst] = spent

        await asyncio.gather(*(group_call(n, g) for n, g in self._groups(targets)))
        return out

    async def discover(self) -> list[HolderInfo]:
        """Ask every registered holder for its info; those that do not answer are lost."""
        found = self._transport.holders()
        self._registered = found
        results = await asyncio.gather(
            *(holder_calls(self._transport, h, self._timeout()).info()
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

    async def ensure_holders(self) -> list[HolderInfo]:
        """Find every live holder, and create one on each alive node that has none."""
        async with self.lock:
            infos = await self.discover()
            alive = set(self._transport.alive_nodes())
            for node in [n for n in self._relays if n not in alive]:
                self._drop_relay(node)
            hosted = {i.node_id for i in infos}
            bare = [n for n in self._transport.alive_nodes() if n not in hosted]
            created = await self._create_all(list(zip(self._free_instance_ids(len(bare)),
                                                      bare, strict=True)))
            for node_id, made in zip(bare, created, strict=True):
                if isinstance(made, BackendUnavailableError):
                    # Typically a node that died but is not yet declared dead. A
                    # node that stays without a holder fails check_startup.
                    log.warning("no holder could start on node %s: %s", node_id, made)
                elif isinstance(made, BaseException):
                    raise made
                else:
                    infos.append(made)
            if self._relayed(self._holders):  # started now: a process takes a while
                for node, _ in self._groups(self._holders):
                    self._relay(node)
            return sorted(infos, key=_instance_order)

    async def known(self) -> dict[str, Actor]:
        """The holders to fan out to, re-discovered (and created on new nodes) only when
        none are known or the alive nodes changed: discovery costs a GCS round trip per
        holder, which the pause must not pay every time."""
        alive = set(self._transport.alive_nodes())
        if not self._holders or alive != set(self._nodes.values()):
            await self.ensure_holders()
        return self.handles

    async def holder_infos(self) -> list[HolderInfo]:
        """Every live holder's info, without creating any."""
        return sorted(await self.discover(), key=_instance_order)

    async def place(self, instances: list[str]) -> dict[str, str]:
        """Create a holder for each of ``instances`` that has none, each on the least
        loaded alive node; returns every known instance's node."""
        await self.known()
        async with self.lock:
            missing = [i for i in sorted(instances, key=instance_sort_key)
                       if i not in self._holders]
            if not missing:
                return {i: self._nodes[i] for i in self.handles}
            # One discovery, then each new holder counted where it will go: a discovery
            # per holder made a restore onto N fresh holders cost N^2 calls.
            hosted = [i.node_id for i in await self.discover()]
            plan = place_instances([i for i in missing if i not in self._holders],
                                   self._transport.alive_nodes(), hosted)
            for made in await self._create_all(plan):
                if isinstance(made, BaseException):
                    raise made
        return {i: self._nodes[i] for i in self.handles}

    async def _create_all(self, plan: list[tuple[str, str]]
                          ) -> list[HolderInfo | BaseException]:
        """Create each ``(instance, node)`` holder, all at once: a holder's process takes
        a while to start, and a restarted job on N nodes waited for N of them in turn.
        Each one's info or error, in the plan's order, once every creation has ended."""
        return await asyncio.gather(*(self.create(inst, node) for inst, node in plan),
                                    return_exceptions=True)

    async def create(self, instance_id: str, node_id: str) -> HolderInfo:
        """Start the holder of ``instance_id`` on ``node_id`` with RL's retire marks (a
        worker's open retried across its predecessor's death must find the attempts RL
        retired refused), and know it once it holds every mark recorded meanwhile."""
        given = self.marks.now()
        handle = self._transport.create_holder(instance_id, node_id,
                                               {**self._options(), "retired": given})
        calls = holder_calls(self._transport, handle, self._timeout())
        info = await calls.info()
        # A retire or forget while it started went to the holders known then, not to
        # it: it gets them now, until none came meanwhile; known from then on (no await
        # between the last look and ``_holders``), it gets every later one.
        while True:
            now = self.marks.now()
            retire, forget = RetireMarks.since(given, now)
            if not retire and not forget:
                break
            if retire:
                await calls.retire(retire)
            if forget:
                await calls.forget(forget)
            given = now
        self._holders[instance_id] = handle
        self._nodes[instance_id] = info.node_id
        log.info("created holder %s on node %s", instance_id, node_id)
        return info

    async def _direct(self, handle: Actor, made: Call[T]) -> T:
        timeout = self._timeout() if made.timeout is None else made.timeout
        result: T = await self._transport.call(handle, made.method, *made.args,
                                               timeout=timeout)
        return result

    def _free_instance_ids(self, count: int) -> list[str]:
        """The ``count`` smallest ``holder-<k>`` names no known holder has."""
        free: list[str] = []
        k = 0
        while len(free) < count:
            if f"holder-{k}" not in self._holders:
                free.append(f"holder-{k}")
            k += 1
        return free

    async def fan(
        self,
        holders: dict[str, Actor],
        made: PerHolder[T],
        tolerate_failures: bool = False,
        op_id: str | None = None,
        direct: bool = False,
        explain: Callable[[dict[str, BaseException]], BaseException | None] | None = None,
    ) -> dict[str, T]:
        """Make ``made`` (a ``HolderControl`` call, or one per instance) on every holder
        concurrently; after all have answered, raise one error that carries every
        holder's failure (``aggregate``; or the one ``explain`` makes of them, when it
        makes one), unless ``tolerate_failures``. From ``relay_min_holders`` holders on
        the calls go through relays, unless ``direct`` (an abort: a relay that died
        unseen would keep its group paused until Ray declares it dead, which the
        fallback to direct calls waits for).

        With ``op_id``, logs one structured line: the phase (the call's name), its
        per-holder seconds and the slowest holder, so that a slow pause names its cause.
        """
        targets = dict(holders)
        if not targets:
            return {}
        what = _call_of(made, next(iter(targets))).method
        seconds: dict[str, float] = {}
        start = self._clock.monotonic()
        results: list[Any]
        if self._relayed(targets) and not direct:
            relayed = await self._through_relays(targets, made, seconds, tolerate_failures)
            results = [relayed[i] for i in targets]
        else:
            async def one(inst: str, handle: Actor) -> T:
                try:
                    return await self._direct(handle, _call_of(made, inst))
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
            raise (explain and explain(errors)) or aggregate(what, errors)
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
