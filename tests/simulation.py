"""The deterministic simulation: many seeded schedules of the real driver, coordinator and
holders, with environment workers running turns, RL's ledger and barrier, retire, a
crash and restore, a second driver, and faults at any await; invariants after each.

Each schedule is a pure function of its seed (``nemo_ckpt.testing.sim``: virtual time, a
seeded transport that delivers an actor's calls in a seeded order, pickled messages,
real files in a temporary folder). Faults: actors killed (holders, the coordinator, the
driver, workers, whole nodes), the driver's operation and workers' rollouts cancelled,
clocks jumping past leases, shard and manifest writes failing or torn by a death
mid-write, shard reads slower than a lease, cuts that do not match (caught inside the
block or not), an exception inside ``restored()``. In a fifth of the schedules the
rollouts own sandbox directories, which every turn changes and checks against the
session's state, and every committed snapshot's directories must verify blob by blob.

The world outside the protocol (issue 23): blocking work runs as threads that outlive
their cancelled callers; every process has its own clocks (offsets up to hours, rates
within 10%); every ``Folder`` call may fail after it happened, reads may fail, and the
disk may be full for seconds (``DiskFaults``); a gc from another host, a retention
script, a second job, and a hostile process inside the sandboxes act meanwhile
(``HostileSandbox``); a copy of a committed manifest is damaged. Its invariants: no
committed snapshot references a missing blob, nothing outside a sandbox is read into
one, sparse files stay sparse, no call waits past its deadline, damaged data is the
project's error.

Ray as it behaves (issue 29; ``_ray_plan``): a death is noticed late, and the name resolves
to the dead actor until Ray releases it; a stalled node (or the coordinator's process,
once right after a manifest's rename) is declared dead past Ray's detection delay, and
runs again as a zombie whose work still reaches files and holders; a holder admits a few
concurrent calls in its one concurrency group (``nemo_ckpt.testing.sim.method_group``),
with more workers' turns than that; a restarted driver brings another config. Its
invariants: no zombie's clean-up tears a newer snapshot (case 29.1), no abort or next
call fails only because it met the dead coordinator's name (29.2), no control call waits
behind turns (29.3), no driver with another config commits.

    .venv/bin/python -m tests.simulation                  # 10,000 schedules on 2 processes
    .venv/bin/python -m tests.simulation --replay SEED    # one schedule, with its trace

A violation prints its seed and the replay command. The run re-executes itself with
``PYTHONHASHSEED=0``, so a replay iterates sets exactly as the failing run did.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import multiprocessing
import os
import pickle
import random
import shutil
import stat
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_ckpt.checkpoint_folder import environment_dir
from nemo_ckpt.collection import collect_blobs, committed_snapshots
from nemo_ckpt.config import ADOPTED_FIELDS, DRIVER_FIELDS, CheckpointConfig
from nemo_ckpt.errors import (
    BackendUnavailableError,
    LeaseExpiredError,
    NemoCkptError,
    SnapshotMismatchError,
    SnapshotWriteError,
    is_retriable,
)
from nemo_ckpt.folder import unlistable
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.local_folder import LocalFolder, write_failure
from nemo_ckpt.path_claims import claim_path, read_claims, release_claim
from nemo_ckpt.phases import HolderState
from nemo_ckpt.ray_checkpoint import RayEnvironmentCheckpoint
from nemo_ckpt.sandbox import _Scanner
from nemo_ckpt.sandbox_storage import verify_directories
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.sessions import SessionClient
from nemo_ckpt.snapshot_files import read_manifest, read_snapshot
from nemo_ckpt.testing.data_plane import StaticCut
from nemo_ckpt.testing.sim import SimActor, SimWorld
from nemo_ckpt.transport import COORDINATOR, HOLDER, SESSION_METHODS

CONFIG = CheckpointConfig(namespace="sim", drain_timeout_s=1.0, lease_s=6.0,
                          phase_timeout_s=3.0, persist_timeout_s=15.0, turn_timeout_s=10.0)
REPLAY = ".venv/bin/python -m tests.simulation --replay {seed}"


class InjectedError(Exception):
    """Raised by the simulation inside a block, as RL's own failure would be."""


# Faults aimed at a phase boundary: kill the actor a call arrives at, kill an actor right
# after a file operation returns, cancel the driver's operation as it sends a call.
TRIGGERS = {
    "kill_at": ["begin", "start_persist", "finish_persist", "resume", "renew_lease",
                "prepare_restore", "commit_restore", "abort_restore", "abort",
                "begin_snapshot", "start_writes", "commit_snapshot", "abort_snapshot",
                "renew"],
    "kill_after_io": ["write_held_shard", "write_manifest", "load_shard", "read_manifest",
                      "remove_snapshot_files", "remove_unreferenced_files", "persist",
                      "prepare_restore", "commit_restore", "collect_quietly"],
    "cancel_at": ["begin_snapshot", "start_writes", "commit_snapshot", "renew",
                  "prepare_restore", "commit_restore"],
}
_END_METHODS = ("resume", "abort")
# How long after an operation ended a holder may still be paused for it (its abort or
# resume in flight): well under a lease, so a stuck pause is seen before it lapses.
GRACE_S = 1.0


# --- the plan of one schedule ----------------------------------------------------------


@dataclass
class Plan:
    seed: int
    nodes: int
    rollouts_per_node: int
    turns: int
    ops: list[str]  # "snap:A", "snap:B", "restore"
    faults: list[tuple[float, str]]  # (when, kind)
    triggers: list[tuple[str, str, int]]  # (kind, method or function, at its n-th call)
    second_driver: list[float]  # when a second driver in the namespace snapshots
    io_fail: float
    io_tear: float
    slow_reads: bool
    bad_cut: float
    catch_mismatch: bool
    raise_in_restore: bool
    sandboxes: bool
    clock_skew_s: float
    disk_after: float  # chance a write or removal raises after it happened
    disk_read_fail: float  # chance a read raises EIO
    enospc: list[tuple[float, float]]  # (from, seconds): every write finds the disk full
    long_save: bool  # RL's own save inside the block outlasts a lease
    gc_every: float  # a gc process collects the store every ~this many seconds (0: none)
    retention: list[float]  # when a user's script removes the oldest committed snapshot
    second_job: list[float]  # when another job claims a path of this one
    hostile: float  # chance a file being scanned is swapped by the sandbox's own process
    sparse: bool  # a turn makes a sparse file
    damage: str | None  # a copy of a committed manifest, damaged: "huge" or "nested"
    # Ray as it behaves (issue 29), drawn apart too (``_ray_plan``):
    slow_death: bool  # callers learn of a death late; the name points at the dead
    detect_s: float  # seconds of a stall after which Ray declares the stalled dead
    stalls: list[tuple[float, str, float]]  # (when, "coordinator" or "node", seconds)
    stall_manifest: int | None  # the coordinator stalls after its n-th manifest rename
    coordinator_node_dies: float | None  # when the coordinator and its node's holders die
    turn_limit: int | None  # a holder's concurrent calls in its (turn) group
    successor_config: str | None  # a restarted driver's config: "lease" or "mismatch"

    @classmethod
    def make(cls, seed: int) -> Plan:
        rng = random.Random(f"plan-{seed}")
        ops = [rng.choice(["snap:A", "snap:A", "snap:B"]) for _ in range(rng.randint(2, 5))]
        if rng.random() < 0.5:  # after two snapshots, so that one has likely committed
            ops.insert(rng.randint(2, len(ops)), "restore")
        kinds = ["kill_holder", "kill_coordinator", "cancel_op", "cancel_op", "kill_driver",
                 "cancel_rollout", "cancel_rollout", "kill_worker", "clock_jump_holder",
                 "clock_jump_coordinator", "kill_node"]
        faults = sorted((round(rng.uniform(0.2, 9.0), 3), rng.choice(kinds))
                        for _ in range(rng.choice([0, 1, 1, 2, 2, 3])))
        triggers = []
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            kind = rng.choice(sorted(TRIGGERS))
            triggers.append((kind, rng.choice(TRIGGERS[kind]), rng.randint(1, 3)))
        plan = cls(
            seed=seed, nodes=rng.choice([2, 3]), rollouts_per_node=rng.randint(1, 3),
            turns=rng.randint(2, 5), ops=ops, faults=faults, triggers=triggers,
            second_driver=sorted(round(rng.uniform(0.2, 6.0), 3)
                                 for _ in range(rng.choice([0, 0, 0, 0, 1, 2]))),
            io_fail=rng.choice([0.0, 0.0, 0.0, 0.15]),
            io_tear=rng.choice([0.0, 0.0, 0.0, 0.0, 0.1]),
            slow_reads=rng.random() < 0.15,
            bad_cut=rng.choice([0.0, 0.0, 0.25]),
            catch_mismatch=rng.random() < 0.5,
            raise_in_restore=rng.random() < 0.15,
            # Its own draw: the plans of every other seed stay as they were.
            sandboxes=random.Random(f"sandboxes-{seed}").random() < 0.2,
            clock_skew_s=random.Random(f"skew-{seed}").choice([0.0, 60.0, 3 * 3600.0]),
            **_world_plan(seed), **_ray_plan(seed),
        )
        if plan.turn_limit is not None:  # more turns waiting at a gate than slots
            plan.rollouts_per_node = max(plan.rollouts_per_node, plan.turn_limit
                                         + random.Random(f"turns-{seed}").randint(1, 3))
        return plan


def _world_plan(seed: int) -> dict[str, Any]:
    """The faults of the world outside the protocol's model (issue 23), drawn apart so
    that every other draw of a seed stays as it was."""
    rng = random.Random(f"world-{seed}")
    enospc = []
    if rng.random() < 0.2:
        enospc.append((round(rng.uniform(0.5, 9.0), 3), round(rng.uniform(2.0, 9.0), 3)))
    return dict(
        disk_after=rng.choice([0.0, 0.0, 0.0, 0.05]),
        disk_read_fail=rng.choice([0.0, 0.0, 0.0, 0.0, 0.02]),
        enospc=enospc,
        long_save=rng.random() < (0.6 if enospc else 0.15),
        gc_every=rng.choice([0.0, 0.0, 1.0, 2.5]),
        retention=sorted(round(rng.uniform(1.0, 9.0), 3)
                         for _ in range(rng.choice([0, 0, 1, 2]))),
        second_job=sorted(round(rng.uniform(0.5, 9.0), 3)
                          for _ in range(rng.choice([0, 0, 0, 1]))),
        hostile=rng.choice([0.0, 0.0, 0.0, 0.1]),
        sparse=rng.random() < 0.05,
        damage=rng.choice([None] * 20 + ["huge", "nested"]),
    )


def _ray_plan(seed: int) -> dict[str, Any]:
    """What real Ray does that an ideal transport does not (issue 29): deaths noticed
    late, stalled nodes declared dead that run again, concurrency limits, a restarted
    driver with another config."""
    rng = random.Random(f"ray-{seed}")
    detect = round(rng.uniform(1.0, 4.0), 3)
    stalls = sorted((round(rng.uniform(0.3, 9.0), 3), rng.choice(["coordinator", "node"]),
                     round(rng.uniform(0.3, 10.0), 3))
                    for _ in range(rng.choice([0, 0, 0, 0, 1, 1, 2])))
    return dict(
        slow_death=rng.random() < 0.5,
        detect_s=detect,
        stalls=stalls,
        stall_manifest=rng.choice([None, None, None, 1, 1, 2]),
        turn_limit=rng.choice([None] * 6 + [2, 3, 4]),
        successor_config=rng.choice([None] * 6 + ["lease", "lease", "mismatch"]),
        coordinator_node_dies=random.Random(f"ray-node-{seed}").choice(
            [None] * 6 + [round(random.Random(f"ray-at-{seed}").uniform(0.3, 9.0), 3)]),
    )


# --- disk faults at every Folder call -------------------------------------------------


class DiskFaults:
    """Faults at every ``Folder`` call an actor makes in a blocking call (every folder
    here is a ``LocalFolder``, so its methods are wrapped, once per process): writes
    (shards, manifests, path claims, blob-store holds and collection claims, blobs) and
    removals that raise after they happened (the file is in place, or gone), reads that
    raise EIO, and windows of virtual time in which every write finds the disk full.
    Errors are raised as the folder raises them (``Folder``'s contract: a write or a
    removal ``SnapshotWriteError``, a listing ``CheckpointPathError``, a read ``OSError``)."""

    active: Schedule | None = None
    _installed = False

    @classmethod
    def install(cls, schedule: Schedule) -> None:
        cls.active = schedule
        if cls._installed:
            return
        cls._installed = True
        for method, kind in (("prepare", "write"), ("write_stream", "write"),
                             ("write_bytes", "write"), ("remove", "remove"),
                             ("read", "read"), ("names", "read")):
            setattr(LocalFolder, method, cls._wrap(getattr(LocalFolder, method), kind))

    @staticmethod
    def _as_raised(method: str, target: str, error: OSError) -> Exception:
        if method == "names":
            return unlistable(target, error)
        if method == "read":
            return error
        return SnapshotWriteError(target, write_failure(target, error))

    @classmethod
    def _wrap(cls, original: Any, kind: str) -> Any:
        def faulty(folder: LocalFolder, *args: Any, **kwargs: Any) -> Any:
            schedule = cls.active
            if schedule is None or schedule.world.running is None:
                return original(folder, *args, **kwargs)  # the checkers' own calls
            target = folder.describe(args[0] if args and isinstance(args[0], str) else "")
            fault = schedule.disk_fault(kind, target)
            if fault == "enospc":
                raise SnapshotWriteError(target, write_failure(
                    target, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
            if fault == "eio":
                raise cls._as_raised(original.__name__, target, OSError(
                    errno.EIO, f"{os.strerror(errno.EIO)} (injected): {target}"))
            result = original(folder, *args, **kwargs)
            if fault == "after":
                raise cls._as_raised(original.__name__, target, OSError(
                    errno.EIO, f"{os.strerror(errno.EIO)} after the fsync and the rename "
                               f"(injected)"))
            return result

        faulty.__name__ = original.__name__
        return faulty


# --- a hostile process inside a sandbox -----------------------------------------------

SECRET = b"the-secret-outside-every-sandbox"
SPARSE_BYTES = 32 << 20


class HostileSandbox:
    """The process inside a sandbox (model-generated code), acting just before the scan
    opens a file it listed: it swaps the file for a symlink to a secret file outside
    every sandbox, for a FIFO, or changes it. The scan's ``_Scanner._file`` opens each
    listed file (``nemo_ckpt/sandbox.py``), so it is wrapped (once per process) here alone."""

    active: Schedule | None = None
    _installed = False

    @classmethod
    def install(cls, schedule: Schedule) -> None:
        cls.active = schedule
        if cls._installed:
            return
        cls._installed = True
        original = _Scanner._file

        def read_file(scanner: _Scanner, fd: int, name: str, path: str, *args: Any,
                      **kwargs: Any) -> Any:
            schedule = cls.active
            if schedule is not None and schedule.plan.hostile:
                schedule.swap(os.fsdecode(path))
            return original(scanner, fd, name, path, *args, **kwargs)

        _Scanner._file = read_file  # type: ignore[method-assign]


# --- RL's side: ledger, staging rows, barrier, saves ------------------------------------


@dataclass
class Saved:
    snapshot_id: str
    expected: dict[str, frozenset[Ep]]
    rows: frozenset[str]
    finished: frozenset[str]


class SimRL:
    """RL's ledger and data plane, as the contract assumes them: a dispatch is recorded
    before the session opens, rows are written inside turns, and the barrier freezes
    both while a cut is live."""

    def __init__(self) -> None:
        self.expected: dict[str, set[Ep]] = defaultdict(set)
        self.where: dict[str, tuple[str, Ep]] = {}  # rollout -> (instance, episode)
        self.rows: set[str] = set()
        self.finished: set[str] = set()
        self.unfrozen = asyncio.Event()
        self.unfrozen.set()
        self.lock = asyncio.Lock()  # snapshots vs. finish + retire
        self.saves: dict[str, Saved] = {}  # committed with the environment's snapshot

    async def dispatch(self, instance: str, ep: Ep) -> None:
        await self.unfrozen.wait()
        self.expected[instance].add(ep)
        self.where[ep.rollout_id] = (instance, ep)

    async def write_row(self, key: str) -> None:
        await self.unfrozen.wait()
        self.rows.add(key)

    def finish(self, rollout_id: str) -> None:
        instance, ep = self.where.pop(rollout_id)
        self.expected[instance].discard(ep)
        self.finished.add(rollout_id)

    @contextlib.asynccontextmanager
    async def checkpoint(self) -> AsyncIterator[StaticCut]:
        self.unfrozen.clear()
        cut = StaticCut({i: set(eps) for i, eps in self.expected.items()}, set(self.rows))
        try:
            yield cut
        finally:
            cut.expire()
            self.unfrozen.set()

    def state(self, snapshot_id: str) -> Saved:
        return Saved(snapshot_id, {i: frozenset(e) for i, e in self.expected.items()},
                     frozenset(self.rows), frozenset(self.finished))


# --- the schedule -------------------------------------------------------------------------


@dataclass
class OpRecord:
    driver: str
    kind: str
    path: str
    start: float
    op_id: str | None = None
    entered: float | None = None  # when RL's lock was taken and the snapshot called
    begun: float | None = None  # when the driver's snapshot began (holders captured)
    body_end: float | None = None  # when the caller's block ended (RL saved its half)
    end: float | None = None
    outcome: str = "running"
    check_failed: bool = False
    abort_sent: float | None = None  # when its driver first sent its abort
    # Its driver's calls that met a coordinator dead (or declared dead) as they were sent.
    dead_calls: list[tuple[float, str, SimActor]] = field(default_factory=list)


@dataclass
class Result:
    seed: int
    violations: list[str]
    faults: int
    trace: list[str] = field(default_factory=list)


class Driver:
    """One RL controller process: a pseudo-actor with its own RayEnvironmentCheckpoint."""

    def __init__(self, sim: Schedule, name: str, config: CheckpointConfig | None = None
                 ) -> None:
        self.actor = sim.world.new_actor("driver", name, "node-0")
        self.config = config or sim.config
        self.ckpt = RayEnvironmentCheckpoint(self.config,
                                             sim.world.transport(self.actor, self.config))
        self.name = name
        # The fields its config has that the job's does not (a restarted driver's).
        self.differs = sorted(k for k in CheckpointConfig.model_fields
                              if getattr(self.config, k) != getattr(sim.config, k))
        self.op_task: asyncio.Task[Any] | None = None
        self.record: OpRecord | None = None  # the operation it runs now
        sim.drivers[self.actor] = self


class Schedule:
    def __init__(self, seed: int, root: Path, tracing: bool = False) -> None:
        self.seed = seed
        self.plan = Plan.make(seed)
        self.world = SimWorld(seed, self.plan.nodes)
        # Every process's clocks: a steady offset (hours either way), a rate within 10%.
        self.world.clock_skew_s = self.plan.clock_skew_s
        self.world.clock_rate = 0.1
        self.world.call_deadline_s = CONFIG.persist_timeout_s
        self.root = root
        self.sandbox_root = root / "sandboxes" if self.plan.sandboxes else None
        self.config = CONFIG if self.sandbox_root is None else CONFIG.model_copy(
            update={"checkpoint_root": root, "sandbox_root": self.sandbox_root})
        self.rl = SimRL()
        self.tracing = tracing
        self.trace: list[str] = []
        self.violations: list[str] = []
        self.faults = 0
        self.ops: list[OpRecord] = []
        self.committed: dict[str, list[str]] = defaultdict(list)  # path -> ids seen committed
        self.failed_checks: set[str] = set()
        self.driver: Driver | None = None
        self.workers: dict[str, SimActor] = {}  # instance -> worker pseudo-actor
        self.rollout_tasks: dict[str, asyncio.Task[Any]] = {}  # capture key -> its task
        self.rollout_worker: dict[str, SimActor] = {}  # capture key -> worker
        self.stop = False
        self.rng = random.Random(f"run-{seed}")
        self.fired: list[tuple[float, str]] = []
        self.drivers: dict[SimActor, Driver] = {}
        self._restart: list[tuple[str, Ep]] = []
        self.triggered: dict[tuple[str, str], int] = defaultdict(int)
        self.paused_since: dict[tuple[int, str], float] = {}
        self.paused_reported: set[tuple[int, str]] = set()
        self.begin_delivered: dict[tuple[int, str], float] = {}
        self.end_delivered: dict[tuple[int, str], float] = {}
        # (holder, operation) -> its abort or resume messages on their way (a slow link)
        self.end_in_flight: dict[tuple[int, str], int] = defaultdict(int)
        self.turn_aborts_in_flight: dict[str, int] = defaultdict(int)  # by turn token
        self._install_io_faults()
        self.enospc_hit: set[int] = set()  # windows that refused a write
        DiskFaults.install(self)
        HostileSandbox.install(self)
        self.blocked: list[str] = []  # blocking calls the guard found waiting
        self.world.on_blocked = self._on_blocked
        self.secret = root / "secret.txt"
        self.secret.write_bytes(SECRET + f"-{seed}".encode())
        self.retired: set[str] = set()  # paths a user's retention script removed
        self.path_claimed_by_job2: dict[str, float] = {}  # path -> when
        self.dense_reported: set[Path] = set()
        # (when, blobs removed, the gc's clock minus the coordinator's) of each gc pass
        self.gc_removals: list[tuple[float, int, float]] = []
        self.world.on_send = self._on_send
        self.world.on_deliver = self._on_deliver
        self.world.after_io = self._after_io
        self._install_ray()

    def _install_ray(self) -> None:
        """Ray as it behaves (issue 29): deaths noticed late, zombies, concurrency
        limits. Its own RNG, so the other draws of a seed stay as they were."""
        plan, rng = self.plan, random.Random(f"ray-run-{self.seed}")
        self.ray_rng = rng
        if plan.slow_death:
            self.world.death_delay = lambda actor: (rng.uniform(0.2, 3.0),
                                                    rng.uniform(0.0, 2.0))
        self.world.zombie_life = lambda actor: rng.uniform(0.5, 6.0)
        limit = plan.turn_limit
        if limit is not None:
            self.world.concurrency = lambda actor, group: (
                limit if actor.kind == HOLDER and group == "default" else None)
        self.world.on_queued = self._on_queued
        self.manifests_written = 0
        # Blocking calls of zombies (declared dead, running again): (when, actor, function).
        self.zombie_io: list[tuple[float, SimActor, str]] = []
        # Control calls that waited for a slot behind session calls (turns, opens):
        # (when, holder, method, operation, seconds waited, session calls ahead, limit).
        self.queued_behind_turns: list[tuple[float, str, str, str, float, str, int]] = []

    def _on_queued(self, target: SimActor, method: str, args: tuple[Any, ...],
                   waited: float, ahead: tuple[str, ...], limit: int) -> None:
        turns = _session_calls(ahead)
        if method not in SESSION_METHODS and turns:
            op = args[0] if args and isinstance(args[0], str) else "?"
            self.queued_behind_turns.append((self.now(), target.name, method, op, waited,
                                             turns, limit))
            self.log(f"{method}({op}) to {target} waited {waited:.2f}s for a slot behind "
                     f"{turns}")

    def _stall(self, actors: list[SimActor], seconds: float, node: str | None,
               why: str) -> None:
        detect = self.plan.detect_s
        self.faults += 1
        self.fired.append((self.now(), f"stall:{why}"))
        declared = f"; Ray declares it dead at {detect:.1f}s" if seconds > detect else ""
        self.log(f"fault: {why}: {actors} stall for {seconds:.1f}s{declared}")
        self.world.stall(actors, seconds, detect, node)

    async def _inject_stalls(self) -> None:
        start = self.now()
        faults = list(self.plan.stalls)
        if self.plan.coordinator_node_dies is not None:
            faults.append((self.plan.coordinator_node_dies, "coordinator_node", 0.0))
        for at, kind, seconds in sorted(faults):
            await asyncio.sleep(max(0.0, start + at - self.now()))
            if kind == "coordinator_node":  # issue 29 case 2: the node is removed
                for coordinator in self.world.live(COORDINATOR):
                    node = coordinator.node
                    actors = [a for a in self.world.live(COORDINATOR) + self.world.live(HOLDER)
                              if a.node == node]
                    self.faults += 1
                    self.fired.append((self.now(), "kill_coordinator"))
                    self.log(f"fault: the coordinator's node {node} is removed: {actors} die")
                    for actor in actors:
                        self.world.kill(actor)
                continue
            if kind == "coordinator":
                actors = self.world.live(COORDINATOR)
                if actors:
                    self._stall(actors, seconds, None, "the coordinator's process stalls")
                continue
            nodes = [n for n in self.world.alive_nodes() if n != "node-0"]
            if nodes:
                node = self.ray_rng.choice(nodes)
                actors = [a for a in self.world.actors if a.node == node and a.alive
                          and a.noticed_at is None]
                self._stall(actors, seconds, node, f"node {node} stalls")

    def _trigger(self, kind: str, method: str) -> bool:
        """Whether a planned trigger fires now (each fires once, at its n-th call)."""
        for k, m, nth in self.plan.triggers:
            if k == kind and m == method:
                self.triggered[(k, m)] += 1
                if self.triggered[(k, m)] == nth:
                    self.faults += 1
                    self.fired.append((self.now(), f"{kind}:{method}"))
                    return True
        return False

    def _on_deliver(self, target: SimActor, method: str, args: tuple[Any, ...]) -> None:
        if method == "abort_turn" and len(args) > 1:
            self.turn_aborts_in_flight[args[1]] -= 1
        if target.kind == HOLDER and args and isinstance(args[0], str):
            if method in ("begin", "pause", "prepare_restore"):
                self.begin_delivered.setdefault((target.serial, args[0]), self.now())
            elif method in _END_METHODS:
                self.end_delivered.setdefault((target.serial, args[0]), self.now())
                self.end_in_flight[(target.serial, args[0])] -= 1
        if self._trigger("kill_at", method):
            self.log(f"fault: {target} is killed as {method} arrives")
            self.world.kill(target)

    def _after_io(self, actor: SimActor, name: str) -> None:
        if actor.zombie:
            self.zombie_io.append((self.now(), actor, name))
        if actor.kind == COORDINATOR and name == "write_manifest" and actor.noticed_at is None:
            self.manifests_written += 1
            if self.manifests_written == self.plan.stall_manifest:
                # Issue 29 case 1: the node stalls past Ray's health checks right after
                # the rename; the process runs again later.
                seconds = self.plan.detect_s + self.ray_rng.uniform(0.2, 4.0)
                self._stall([actor], seconds, None,
                            "the coordinator's node stalls right after a manifest's rename")
        if actor.kind in (HOLDER, COORDINATOR) and self._trigger("kill_after_io", name):
            self.log(f"fault: {actor} is killed right after {name}")
            self.world.kill(actor)

    def _on_send(self, caller: SimActor, callee: SimActor, method: str,
                 args: tuple[Any, ...]) -> None:
        """Learn each operation's id from the first message its driver sends."""
        if callee.kind == HOLDER and method in _END_METHODS and args:
            self.end_in_flight[(callee.serial, args[0])] += 1
        if method == "abort_turn" and len(args) > 1:
            self.turn_aborts_in_flight[args[1]] += 1
        driver = self.drivers.get(caller)
        if driver is None:
            return
        record = driver.record
        if record is not None and callee.kind == COORDINATOR:
            if method == "abort" and record.abort_sent is None:
                record.abort_sent = self.now()
            if not callee.alive or callee.noticed_at is not None:
                record.dead_calls.append((self.now(), method, callee))
        if driver.record is not None and driver.record.op_id is None \
                and method in ("begin_snapshot", "prepare_restore") and args:
            driver.record.op_id = args[0]
            self.log(f"{driver.name} {driver.record.kind} {args[0]} "
                     f"({Path(driver.record.path).name})")
        task = driver.op_task
        if task is not None and not task.done() and self._trigger("cancel_at", method):
            self.log(f"fault: {driver.name}'s operation is cancelled as it sends {method}")
            self.world.loop.call_later(self.rng.uniform(0.0, 0.02), task.cancel)

    # --- bookkeeping -----------------------------------------------------------------------

    def now(self) -> float:
        return self.world.loop.time()

    def log(self, message: str) -> None:
        if self.tracing:  # the scratch root differs between runs of one seed
            message = message.replace(str(self.root), "ROOT")
            self.trace.append(f"{self.now():9.4f}  {message}")

    def violate(self, message: str) -> None:
        message = message.replace(str(self.root), "ROOT")
        self.violations.append(f"t={self.now():.4f}: {message}")
        self.log(f"VIOLATION {message}")

    def _install_io_faults(self) -> None:
        plan = self.plan
        rng = self.rng

        def decide(name: str, args: tuple[Any, ...]) -> str | None:
            if name == "write_held_shard":
                if rng.random() < plan.io_fail:
                    self.faults += 1
                    self.log("fault: a shard write fails")
                    return "fail"
                if rng.random() < plan.io_tear:
                    self.faults += 1
                    self.log("fault: a holder dies in the middle of its shard write")
                    return "tear"
            if name in ("persist", "prepare_restore") and plan.sandboxes:
                # A sandbox's blobs and trees file, or a restore's directories.
                if rng.random() < plan.io_fail:
                    self.faults += 1
                    self.log(f"fault: a sandbox {name} fails")
                    return "fail"
                if name == "persist" and rng.random() < plan.io_tear:
                    self.faults += 1
                    self.log("fault: a holder dies in the middle of writing its blobs")
                    return "tear"
            if name == "write_manifest" and rng.random() < plan.io_fail / 2:
                self.faults += 1
                self.log("fault: the manifest write fails")
                return "fail"
            return None

        def cost(name: str) -> float:
            if name == "load_shard" and plan.slow_reads:
                return CONFIG.lease_s * rng.uniform(1.2, 2.0)
            if name == "write_held_shard":
                return rng.uniform(0.002, 0.05)
            return 0.001

        self.world.io_faults = decide
        self.world.io_cost = cost

    def disk_fault(self, kind: str, target: str) -> str | None:
        """What the disk does to this ``kind`` of call on ``target`` now (``DiskFaults``)."""
        plan, now = self.plan, self.now()
        if kind == "write":
            for k, (start, seconds) in enumerate(plan.enospc):
                if start <= now <= start + seconds:
                    if k not in self.enospc_hit:
                        self.enospc_hit.add(k)
                        self.faults += 1
                        self.log(f"fault: the disk is full from {start:.1f}s for "
                                 f"{seconds:.1f}s")
                    return "enospc"
        if kind in ("write", "remove") and plan.disk_after and \
                self.rng.random() < plan.disk_after:
            self.faults += 1
            self.log(f"fault: a {kind} of {Path(target).name} raises after it happened")
            return "after"
        if kind == "read" and plan.disk_read_fail and self.rng.random() < plan.disk_read_fail:
            self.faults += 1
            self.log(f"fault: a read of {Path(target).name} raises EIO")
            return "eio"
        return None

    def _full_disk_during(self, record: OpRecord) -> tuple[float, float] | None:
        """A window of full disk that overlapped ``record``'s life."""
        end = record.end if record.end is not None else self.now()
        for k, (start, seconds) in enumerate(self.plan.enospc):
            if k in self.enospc_hit and start <= end and record.start <= start + seconds:
                return start, seconds
        return None

    def killed_since(self, start: float, kinds: Iterable[str]) -> bool:
        """Whether an actor of ``kinds`` died, or Ray declared it dead, after ``start``."""
        kinds = set(kinds)
        return any(t > start and a.kind in kinds
                   for t, a in self.world.kills + self.world.declared)

    # --- inspection (in-process, not through the transport) ---------------------------------

    async def _ask(self, actor: SimActor, method: str, *args: Any) -> Any:
        """Call a holder's method in-process, as a task of the holder (whatever it
        starts dies with it)."""
        return await self.world.spawn(actor, getattr(actor.obj, method)(*args))

    async def holder_infos(self) -> list[Any]:
        return [await self._ask(a, "info") for a in self.world.live(HOLDER)]

    async def live_sessions(self) -> dict[str, list[SessionRecord]]:
        return {a.name: await self._ask(a, "sessions") for a in self.world.live(HOLDER)}

    # --- the run -------------------------------------------------------------------------------

    def run(self) -> Result:
        loop = self.world.loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # a crash of the harness or the code under test
            self.violate(f"the schedule crashed: {type(exc).__name__}: {exc}")
        finally:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.sleep(0))
            loop.close()
            for actor in self.world.actors:  # their finished tasks: free them now
                actor.tasks.clear()
                actor.inbox.clear()
                actor.queues.clear()
        return Result(self.seed, self.violations, self.faults, self.trace)

    async def _main(self) -> None:
        self.driver = Driver(self, "driver-1")
        await self.driver.ckpt.ensure_holders()
        await self._start_workers(fresh=True)
        injector = asyncio.ensure_future(self._inject_faults())
        stalls = asyncio.ensure_future(self._inject_stalls())
        monitor = asyncio.ensure_future(self._monitor())
        seconds = [asyncio.ensure_future(self._second_driver(t, k))
                   for k, t in enumerate(self.plan.second_driver)]
        outside = [asyncio.ensure_future(c) for c in self._outside_actors()]
        await self._drive()
        injector.cancel()
        stalls.cancel()
        for task in outside:
            task.cancel()
        for task in seconds:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, CONFIG.lease_s * 3)
        await self._stop_workers()
        await self._check_settled()
        monitor.cancel()
        await asyncio.sleep(CONFIG.lease_s * 2 + (CONFIG.turn_timeout_s or 0) + 1)
        await self._check_final()

    # --- the driver's script ---------------------------------------------------------------------

    async def _drive(self) -> None:
        for op in self.plan.ops:
            await asyncio.sleep(self.rng.uniform(0.3, 1.8))
            driver = await self._current_driver()
            if driver is None:
                return
            if op == "restore":
                await self._crash_and_restore()
                continue
            path = str(self.root / op.split(":")[1])
            task = self.world.spawn(driver.actor, self._snapshot(driver, path, checked=True))
            driver.op_task = task
            with contextlib.suppress(BaseException):
                await task
            driver.op_task = None

    async def _current_driver(self) -> Driver | None:
        """The live main driver; after a driver's death a successor starts (a restarted
        controller of the same job)."""
        if self.driver is not None and self.driver.actor.alive:
            return self.driver
        await asyncio.sleep(self.rng.uniform(0.1, 2.0))
        config = None
        if self.plan.successor_config == "lease":  # adopted by the live coordinator
            config = self.config.model_copy(update={"lease_s": 9.0})
        elif self.plan.successor_config == "mismatch":  # refused: ConfigMismatchError
            config = self.config.model_copy(update={"max_state_bytes": 1 << 20})
        self.driver = Driver(self, f"driver-{len(self.world.actors)}", config)
        self.log(f"{self.driver.name} starts (successor, config differs in "
                 f"{self.driver.differs})")
        return self.driver

    async def _snapshot(self, driver: Driver, path: str, checked: bool) -> None:
        record = OpRecord(driver.name, "snapshot", path, self.now())
        self.ops.append(record)
        driver.record = record
        ckpt = driver.ckpt
        bad = checked and self.rng.random() < self.plan.bad_cut
        saved = None
        held = False  # a snapshot of nothing yields None, which needs no check
        try:
            async with self._maybe_lock(checked):
                record.entered = self.now()
                async with ckpt.snapshot(Path(path)) as snap:
                    record.begun = self.now()
                    held = snap is not None
                    if checked:
                        async with self.rl.checkpoint() as cut:
                            if snap is not None:
                                if bad:
                                    cut = self._corrupt(cut)
                                try:
                                    await snap.check_against_cut(cut)
                                except SnapshotMismatchError:
                                    record.check_failed = True
                                    assert record.op_id is not None
                                    self.failed_checks.add(record.op_id)
                                    self.log(f"check of {record.op_id} failed (caught: "
                                             f"{self.plan.catch_mismatch and bad})")
                                    if not (self.plan.catch_mismatch and bad):
                                        raise
                            saved = self.rl.state(record.op_id or "?")
                    await asyncio.sleep(  # RL saves its half
                        CONFIG.lease_s * self.rng.uniform(1.2, 2.0) if self.plan.long_save
                        else self.rng.uniform(0.0, 1.5))
                    record.body_end = self.now()
            record.outcome = "committed"
            if held and not checked and not driver.config.allow_unchecked_snapshots:
                self.violate(f"{record.op_id} committed, but its block never checked it "
                             f"against a cut and its config does not allow that")
            if saved is not None:
                self.rl.saves[path] = saved
            self.committed[path].append(record.op_id or "?")
            self.log(f"{record.op_id} committed")
            self._check_commit(record)
            self._check_one_config(driver, record)
        except BaseException as exc:
            record.outcome = type(exc).__name__
            self.log(f"{record.op_id} failed: {type(exc).__name__}: {_short(exc)}")
            if not isinstance(exc, asyncio.CancelledError):
                self._check_error_kind(exc, f"snapshot {record.op_id}")
                self._check_dead_name(record, exc)
                await self._check_failed_snapshot(record, exc)
            if not isinstance(exc, (Exception, asyncio.CancelledError)):
                raise
        finally:
            record.end = self.now()
            driver.record = None
            self._check_deadlines(record, driver.config)

    def _check_deadlines(self, record: OpRecord, cfg: CheckpointConfig) -> None:
        """A snapshot's entry and its commit return within their driver's configured
        deadlines (with a margin of a lease: messages, retries, a slow link)."""
        entry = cfg.drain_timeout_s + 3 * cfg.phase_timeout_s + cfg.lease_s
        # From the call, not from the wait for RL's own lock (its retires may be slow).
        called = record.entered if record.entered is not None else record.start
        if record.begun is not None and record.begun - called > entry:
            self.violate(f"a call waits past its deadline: the snapshot {record.op_id} took "
                         f"{record.begun - called:.1f}s to begin (drain and phase "
                         f"deadlines: {entry - cfg.lease_s:g}s){self._queue_note(record.op_id)}")
        commit = cfg.persist_timeout_s + 2 * cfg.phase_timeout_s + cfg.lease_s
        if record.body_end is not None and record.end is not None and \
                record.end - record.body_end > commit:
            self.violate(f"a call waits past its deadline: the commit of {record.op_id} took "
                         f"{record.end - record.body_end:.1f}s after its block ended (persist "
                         f"and phase deadlines: {commit - cfg.lease_s:g}s)"
                         f"{self._queue_note(record.op_id)}")

    @contextlib.asynccontextmanager
    async def _maybe_lock(self, take: bool) -> AsyncIterator[None]:
        if take:
            async with self.rl.lock:
                yield
        else:
            yield

    def _corrupt(self, cut: StaticCut) -> StaticCut:
        """A cut RL could not have taken with this capture: a row or an episode missing."""
        self.faults += 1
        expected = {i: set(e) for i, e in cut.expected_episodes().items()}
        rows = set(cut.staging_keys())
        if rows and self.rng.random() < 0.5:
            rows.discard(sorted(rows)[self.rng.randrange(len(rows))])
        else:
            for eps in expected.values():
                if eps:
                    eps.discard(sorted(eps)[0])
                    break
            else:
                rows.add("a-row-no-session-wrote")
        self.log("fault: the cut does not match the capture")
        return StaticCut(expected, rows)

    async def _second_driver(self, at: float, k: int) -> None:
        await asyncio.sleep(at)
        # Without RL's ledger: it takes no cut, and only some are allowed to commit so.
        allowed = random.Random(f"unchecked-{self.seed}-{k}").random() < 0.5
        driver = Driver(self, f"second-{k}", self.config.model_copy(
            update={"allow_unchecked_snapshots": allowed}))
        self.log(f"{driver.name} starts")
        task = self.world.spawn(driver.actor, self._snapshot(
            driver, str(self.root / "C"), checked=False))
        with contextlib.suppress(BaseException):
            await task

    # --- outside actors: gc from another host, retention, a second job ---------------------

    def _outside_actors(self) -> list[Any]:
        plan, out = self.plan, []
        if self.sandbox_root is not None:
            if plan.gc_every:
                out.append(self._gc_process())
            out += [self._retention(at) for at in plan.retention]
        out += [self._second_job(at, k) for k, at in enumerate(plan.second_job)]
        return out

    async def _gc_process(self) -> None:
        """``nemo-ckpt gc ROOT`` run now and then from another host (its own clocks)."""
        actor = self.world.new_actor("gc", "gc", "gc-host")
        actor.alive = True  # a host outside the Ray cluster
        runtime = self.world.runtime(actor)
        while True:
            await asyncio.sleep(self.plan.gc_every * self.rng.uniform(0.5, 1.5))
            self.faults += 1
            self.log(f"gc from another host (its clock {actor.wall_offset:+.0f}s)")
            try:
                report = await runtime.run_blocking(
                    collect_blobs, str(self.root), "gc-cli", 30.0, False, runtime.clock.wall)
            except (NemoCkptError, OSError) as exc:
                self.log(f"gc: {type(exc).__name__}: {_short(exc)}")
            else:
                self.log(f"gc removed {report.removed} blobs")
                if report.removed:
                    self.gc_removals.append((self.now(), report.removed, actor.wall_offset
                                             - self._coordinator_offset()))

    async def _retention(self, at: float) -> None:
        """A user's retention script removes the oldest committed snapshot folder that no
        operation of this job writes now (rm -rf), then collects."""
        await asyncio.sleep(at)
        running = {r.path for r in self.ops if r.end is None}
        for path in sorted(self.committed, key=lambda p: self.committed[p] and
                           self.committed[p][-1] or ""):
            if path in running or not self.committed[path] or \
                    not (environment_dir(path) / "manifest.json").exists():
                continue
            self.faults += 1
            self.log(f"retention removes {Path(path).name} ({self.committed[path][-1]})")
            shutil.rmtree(path, ignore_errors=True)
            self.retired.add(path)
            self.committed.pop(path)
            self.rl.saves.pop(path, None)
            return

    async def _second_job(self, at: float, k: int) -> None:
        """Another job (another owner, its own clocks) claims a path this job writes."""
        await asyncio.sleep(at)
        actor = self.world.new_actor("job2", f"job2-{k}", "job2-host")
        actor.alive = True  # a host outside the Ray cluster
        runtime = self.world.runtime(actor)
        path = self.root / self.rng.choice(["A", "B"])
        folder = environment_dir(path)
        op_id = f"job2-op-{k}"
        self.faults += 1
        try:
            await runtime.run_blocking(folder.mkdir, 0o777, True, True)
            await runtime.run_blocking(claim_path, folder, op_id, "job-2",
                                       runtime.clock.wall(), CONFIG.lease_s * 2)
        except NemoCkptError as exc:
            self.log(f"job 2's claim of {path.name} refused: {_short(exc)}")
            return
        # This job's claims there that its coordinator wrote within their time to live,
        # by true time: live, whatever either clock says.
        now = self.now()
        fresh = {args[1] for t, _, name, args, _ in self.world.io_log
                 if name == "claim_path" and len(args) > 1 and now - t < CONFIG.lease_s * 2}
        running = {r.op_id for r in self.ops if r.end is None and r.op_id}
        ours = [c.operation for c in read_claims(folder)
                if c.operation in running and c.operation in fresh]
        if ours:
            self.violate(f"a second job claimed {path.name} while {ours[0]} of this job "
                         f"held it: two jobs write one checkpoint path (their clocks differ "
                         f"by {actor.wall_offset - self._coordinator_offset():+.0f}s)")
        self.log(f"job 2 holds {path.name}")
        self.path_claimed_by_job2.setdefault(str(path), self.now())
        with contextlib.suppress(Exception):
            await asyncio.sleep(CONFIG.lease_s)
            await runtime.run_blocking(release_claim, folder, op_id)

    def _coordinator_offset(self) -> float:
        live = self.world.live(COORDINATOR)
        return live[0].wall_offset if live else 0.0

    def swap(self, source: str) -> None:
        """The sandbox's own process acts on ``source`` as the scan is about to read it
        (``HostileSandbox``); never on ``state``, which the turns check."""
        path = Path(source)
        if path.name == "state" or self.rng.random() >= self.plan.hostile:
            return
        kind = self.rng.choice(["link", "link", "fifo", "change"])
        self.faults += 1
        self.log(f"fault: the sandbox's process swaps {path.name} for a {kind}")
        with contextlib.suppress(OSError):
            if kind == "change":
                with open(path, "ab") as f:
                    f.write(b"changed while read")
                return
            path.unlink()
            if kind == "link":  # relative: a tree records the same link on every replay
                path.symlink_to(os.path.relpath(self.secret, path.parent))
            else:
                os.mkfifo(path)
                self.world.fifos.append(source)

    def _check_world(self) -> None:
        _check_world_of(self)

    def _on_blocked(self, actor: SimActor, name: str, where: str) -> None:
        """From the guard's thread: a blocking call has not returned."""
        self.blocked.append(f"a call waits past its deadline: {name} of {actor.name} "
                            f"blocked in {where} (at t={self.now():.4f})")

    # --- crash and restore -------------------------------------------------------------------

    async def _crash_and_restore(self) -> None:
        candidates = []
        for path, saved in sorted(self.rl.saves.items()):
            with contextlib.suppress(Exception):
                if read_manifest(path).snapshot_id == saved.snapshot_id:
                    candidates.append(path)
        if not candidates:
            return
        path = self.rng.choice(candidates)
        saved = self.rl.saves[path]
        self.log(f"CRASH; restore from {Path(path).name} ({saved.snapshot_id})")
        for worker in list(self.workers.values()):
            self.world.kill(worker)
        for actor in self.world.live(HOLDER) + self.world.live(COORDINATOR):
            self.world.kill(actor)
        if self.driver is not None:
            self.world.kill(self.driver.actor)
        self.rollout_tasks.clear()
        try:
            loaded = read_snapshot(path)
        except NemoCkptError as exc:
            self.violate(f"{saved.snapshot_id} committed but its snapshot does not verify "
                         f"at the restore: {type(exc).__name__}: {_short(exc)}"
                         f"{self._zombie_work(0.0)}")
            return
        # RL's half, restored inside restored(): every unfinished rollout of the cut either
        # continues (captured) or starts over as its next attempt.
        self.rl = SimRL()
        driver = Driver(self, f"driver-{len(self.world.actors)}")
        self.driver = driver
        record = OpRecord(driver.name, "restore", path, self.now())
        self.ops.append(record)
        driver.record = record
        raise_inside = self.plan.raise_in_restore and self.rng.random() < 0.5
        task = self.world.spawn(driver.actor, self._restore(driver, path, raise_inside))
        driver.op_task = task
        try:
            restored = await task
        except BaseException as exc:
            record.outcome = type(exc).__name__
            self.log(f"restore {record.op_id} failed: {type(exc).__name__}: {_short(exc)}")
            if not isinstance(exc, asyncio.CancelledError):
                if not isinstance(exc, InjectedError):
                    self._check_error_kind(exc, f"restore {record.op_id}")
                await self._check_failed_restore(record, loaded)
            if not (is_retriable(exc) or isinstance(exc, InjectedError)) \
                    or not driver.actor.alive:
                return
            # RL retries, as is_unavailable says, a few times with a pause between.
            again: BaseException | None = exc
            for _ in range(4):
                await asyncio.sleep(self.rng.uniform(0.5, 2.0))
                self.log("retrying the restore")
                try:
                    restored = await self.world.spawn(
                        driver.actor, self._restore(driver, path, False))
                except BaseException as error:
                    again = error
                    self.log(f"retry failed: {type(error).__name__}: {_short(error)}")
                    if is_retriable(error) and driver.actor.alive:
                        continue
                else:
                    again = None
                break
            if again is not None:
                # A retry may meet a fault of its own: a restore's materialization that
                # fails, or a disk read error (injected), refuses that retry, and rightly.
                injected = "injected" in str(again)
                if not (is_retriable(again) or injected or self.killed_since(
                        record.start, (COORDINATOR, "driver", HOLDER))):
                    self.violate(f"the retry of a failed restore failed: "
                                 f"{type(again).__name__}: {_short(again)}")
                return
        finally:
            record.end = self.now()
            driver.op_task = None
            driver.record = None
        record.outcome = "committed"
        await self._check_restored(restored, loaded)
        self._apply_restore(saved, restored)
        await self._start_workers(fresh=False, restored=restored)

    async def _restore(self, driver: Driver, path: str, raise_inside: bool) -> Any:
        async with driver.ckpt.restored(Path(path)) as restored:
            if raise_inside:
                self.faults += 1
                self.log("fault: RL's restore raises inside restored()")
                raise InjectedError("RL's own restore failed")
            return restored

    def _apply_restore(self, saved: Saved, restored: Any) -> None:
        continued = {(i, r): a for i, r, a in restored.continued_attempts}
        for instance, eps in saved.expected.items():
            for ep in eps:
                nxt = ep.next_attempt()
                self.rl.expected[instance].add(nxt)
                self.rl.where[ep.rollout_id] = (instance, nxt)
                if (instance, ep.rollout_id) not in continued:
                    self.rl.expected[instance].discard(nxt)  # re-dispatched by its worker
                    del self.rl.where[ep.rollout_id]
                    self._restart.append((instance, nxt))
        self.rl.rows = set(saved.rows & restored.staging_keys)
        self.rl.finished = set(saved.finished)

    # --- workers ------------------------------------------------------------------------------

    async def _start_workers(self, fresh: bool, restored: Any = None) -> None:
        infos = None
        for _ in range(5):  # the coordinator may be dying: RL retries, as is_unavailable says
            driver = await self._current_driver()  # or its successor, if it was killed
            if driver is None:
                return
            with contextlib.suppress(BackendUnavailableError):
                infos = await driver.ckpt.holders()
                break
            await asyncio.sleep(1.0)
        if infos is None:
            return
        self.workers = {}
        for info in infos:
            worker = self.world.new_actor("worker", f"worker-{info.instance_id}",
                                          info.node_id)
            self.workers[info.instance_id] = worker
        if fresh:
            self._restart = []
            for info in infos:
                for k in range(self.plan.rollouts_per_node):
                    ep = Ep(f"{info.instance_id}-r{k}", 0)
                    self._spawn_rollout(info.instance_id, ep, 0, True)
            return
        assert restored is not None
        sessions = await self.live_sessions()
        for instance, rollout_id, attempt in sorted(restored.continued_attempts):
            ep = Ep(rollout_id, attempt + 1)
            turns = next((len(s.turns) for s in sessions.get(instance, [])
                          if s.episode == ep), 0)
            self._spawn_rollout(instance, ep, turns, False)
        for instance, ep in self._restart:
            self._spawn_rollout(instance, ep, 0, True)
        self._restart = []

    def _spawn_rollout(self, instance: str, ep: Ep, start: int, fresh: bool) -> None:
        worker = self.workers.get(instance)
        if worker is None:
            return
        task = self.world.spawn(worker, self._rollout(worker, instance, ep, start, fresh))
        self.rollout_tasks[ep.capture_key] = task
        self.rollout_worker[ep.capture_key] = worker

    async def _rollout(self, worker: SimActor, instance: str, ep: Ep, start: int,
                       fresh: bool) -> None:
        transport = self.world.transport(worker, self.config)
        try:
            await asyncio.sleep(self.rng.uniform(0.0, 0.5))
            handle = transport.holder(instance)
            if handle is None:
                return
            client = SessionClient(handle, transport)
            if fresh:
                await self.rl.dispatch(instance, ep)
                directory = None
                if self.sandbox_root is not None:
                    directory = self.sandbox_root / "work" / ep.capture_key
                    shutil.rmtree(directory, ignore_errors=True)
                    directory.mkdir(parents=True)
                    (directory / "state").write_bytes(f"{ep.rollout_id}:0".encode())
                await client.open(ep, f"{ep.rollout_id}:0".encode(), directory=directory)
            for t in range(start, self.plan.turns):
                if self.stop:
                    return
                async with client.turn(ep) as turn:
                    await asyncio.sleep(self.rng.uniform(0.05, 0.6))
                    key = f"{ep.capture_key}/row{t}"
                    await self.rl.write_row(key)
                    state = f"{ep.rollout_id}:{t + 1}".encode()
                    if turn.directory is not None:
                        self._sandbox_turn(ep, turn.directory, turn.state, t, state)
                    turn.complete(f"t{t}".encode(), state, [key])
                await asyncio.sleep(self.rng.uniform(0.0, 0.2))
            await self._finish(instance, ep)
        except Exception as exc:
            self.log(f"rollout {ep.capture_key} gives up: {type(exc).__name__}: {_short(exc)}")
            self._check_error_kind(exc, f"a session call of {ep.capture_key}")

    def _sandbox_turn(self, ep: Ep, directory: Path, before: bytes, t: int,
                      after: bytes) -> None:
        """A turn's work in its directory: it must start as the session's state says
        (after a restore too), then a file is added, one edited, one removed."""
        found = (directory / "state").read_bytes() if (directory / "state").exists() else None
        if found != before:
            self.violate(f"the directory of {ep.capture_key} holds state {found!r} at turn "
                         f"{t}, its session {before!r}")
        (directory / f"t{t}").write_bytes(b"x" * (t + 1))
        if self.plan.sparse and t == 1 and not (directory / "sparse").exists():
            self.faults += 1
            self.log(f"a turn of {ep.capture_key} makes a sparse file")
            with open(directory / "sparse", "wb") as f:
                f.truncate(SPARSE_BYTES)
        (directory / "state").write_bytes(after)
        with contextlib.suppress(FileNotFoundError):
            (directory / f"t{t - 2}").unlink()

    async def _finish(self, instance: str, ep: Ep) -> None:
        """RL records the result and retires the attempt, under the snapshots' lock."""
        for _ in range(20):
            driver = self.driver
            if driver is not None and driver.actor.alive and driver.ckpt.open_operation is None:
                async with self.rl.lock:
                    if driver.ckpt.open_operation is None:
                        try:
                            await driver.ckpt.retire([ep])
                        except NemoCkptError as exc:
                            self.log(f"retire {ep.capture_key}: {type(exc).__name__}")
                        else:
                            if ep.rollout_id in self.rl.where:
                                self.rl.finish(ep.rollout_id)
                            return
            await asyncio.sleep(self.rng.uniform(0.2, 1.0))

    async def _stop_workers(self) -> None:
        self.stop = True
        tasks = [t for t in self.rollout_tasks.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=CONFIG.lease_s + 5)
        for key, task in self.rollout_tasks.items():
            if not task.done():
                self.log(f"stopping rollout {key} (cancelled)")
                task.cancel()
        await asyncio.sleep(CONFIG.phase_timeout_s)

    # --- faults -------------------------------------------------------------------------------

    async def _inject_faults(self) -> None:
        start = self.now()
        for at, kind in self.plan.faults:
            await asyncio.sleep(max(0.0, start + at - self.now()))
            if self._fault(kind):
                self.faults += 1
                self.fired.append((self.now(), kind))

    def _fault(self, kind: str) -> bool:
        world, rng = self.world, self.rng
        if kind == "kill_holder" and world.live(HOLDER):
            victim = rng.choice(world.live(HOLDER))
        elif kind == "kill_coordinator" and world.live(COORDINATOR):
            victim = world.live(COORDINATOR)[0]
        elif kind == "kill_driver" and self.driver is not None and self.driver.actor.alive:
            victim = self.driver.actor
        elif kind == "kill_worker" and [w for w in self.workers.values() if w.alive]:
            victim = rng.choice([w for w in self.workers.values() if w.alive])
        elif kind == "kill_node":
            nodes = [n for n in world.alive_nodes() if n != "node-0"]
            if not nodes:
                return False
            node = rng.choice(nodes)
            self.log(f"fault: node {node} dies")
            world.kill_node(node)
            return True
        elif kind == "cancel_op":
            driver = self.driver
            if driver is None or driver.op_task is None or driver.op_task.done():
                return False
            self.log(f"fault: {driver.name}'s operation is cancelled")
            driver.op_task.cancel()
            return True
        elif kind == "cancel_rollout":
            running = sorted(k for k, t in self.rollout_tasks.items() if not t.done())
            if not running:
                return False
            key = rng.choice(running)
            self.log(f"fault: rollout {key} is cancelled")
            self.rollout_tasks[key].cancel()
            return True
        elif kind in ("clock_jump_holder", "clock_jump_coordinator"):
            actors = world.live(HOLDER if kind == "clock_jump_holder" else COORDINATOR)
            if not actors:
                return False
            actor = rng.choice(actors)
            jump = CONFIG.lease_s * rng.uniform(1.0, 1.5)
            actor.clock_offset += jump
            self.log(f"fault: {actor}'s clock jumps {jump:.1f}s")
            return True
        else:
            return False
        self.log(f"fault: {victim} is killed")
        world.kill(victim)
        return True

    # --- invariants ---------------------------------------------------------------------------

    def _check_one_config(self, driver: Driver, record: OpRecord) -> None:
        """A driver whose config differs from the job's in a field that is not adopted
        never commits through actors made with the job's (ConfigMismatchError)."""
        fixed = [k for k in driver.differs if k not in ADOPTED_FIELDS | DRIVER_FIELDS]
        made = [a.obj._config for a in self.world.live(COORDINATOR)]
        if fixed and any(getattr(c, k) != getattr(driver.config, k)
                         for c in made for k in fixed):
            self.violate(f"{record.op_id} committed through a coordinator made with "
                         f"another config ({', '.join(fixed)} differ): nothing refused it")

    def _zombie_work(self, since: float) -> str:
        """What coordinators Ray had declared dead did after ``since``, for a message."""
        work = [(t, a, name) for t, a, name in self.zombie_io
                if t >= since and a.kind == COORDINATOR]
        if not work:
            return ""
        t, actor, name = work[-1]
        declared = next(d for d, a in self.world.declared if a is actor)
        return (f"; a zombie coordinator ({actor}, declared dead at t={declared:.2f} after "
                f"its node stalled, then run again) ran {name} there at t={t:.2f}: its "
                f"clean-up took the newer snapshot's claim for a dead predecessor's and "
                f"removed its files")

    def _check_commit(self, record: OpRecord) -> None:
        """A snapshot the driver saw commit is the manifest at its path, complete."""
        try:
            loaded = read_snapshot(record.path)
        except Exception as exc:
            self.violate(f"{record.op_id} committed but its snapshot does not verify: "
                         f"{type(exc).__name__}: {_short(exc)}"
                         f"{self._zombie_work(record.start)}")
            return
        named = loaded.manifest.snapshot_id
        later = self._captured_later(record)
        if named != record.op_id and named not in later:
            self.violate(f"{record.op_id} committed but {Path(record.path).name}'s manifest "
                         f"names {named}")
        if record.check_failed:
            self.violate(f"{record.op_id} committed although its check against the cut failed")
        if self.plan.sparse and self.sandbox_root is not None:
            _check_dense(self)

    def _captured_later(self, record: OpRecord) -> set[str | None]:
        """The snapshots into the same path that captured after ``record`` did: a
        holder pauses for one only once the one before released it, after its begin."""
        if record.begun is None:
            return set()
        return {r.op_id for r in self.ops if r.path == record.path and r.begun is not None
                and r.begun > record.begun}

    def _check_dead_name(self, record: OpRecord, exc: BaseException) -> None:
        """An operation begun after the coordinator died (its death noticed before) does
        not fail only because its calls still met the dead actor's name."""
        if not isinstance(exc, BackendUnavailableError) or not record.dead_calls:
            return
        if "the nemo-ckpt coordinator" not in str(exc):
            return  # it failed on a holder (a fault of its own), after reaching a coordinator
        when, method, dead = record.dead_calls[0]
        died = [t for t, a in self.world.kills + self.world.declared if a is dead]
        if not died or died[0] >= record.start or \
                self.killed_since(record.start, (COORDINATOR,)):
            return
        self.violate(f"{record.op_id or 'the ' + record.kind + ' of ' + record.driver} "
                     f"failed (BackendUnavailableError) because its "
                     f"{method} met the dead coordinator's name: {dead} died at "
                     f"t={died[0]:.2f}, before the operation began, and the name still "
                     f"resolved to it at t={when:.2f}")

    async def _check_failed_snapshot(self, record: OpRecord, exc: BaseException) -> None:
        """A failed snapshot resumed every holder before its error reached the driver,
        even after its coordinator died, so long as no coordinator died after its
        driver's abort went out (the abort finds the successor)."""
        if self.killed_since(record.start, ("driver",)):
            return
        after_abort = record.abort_sent if record.abort_sent is not None else self.now()
        if self.killed_since(after_abort - 1e-9, (COORDINATOR,)):
            return
        coordinator_died = self.killed_since(record.start, (COORDINATOR,))
        paused = []
        for actor in self.world.live(HOLDER):
            info = await self._ask(actor, "info")
            if info.operation_id == record.op_id and info.state is not HolderState.RUNNING \
                    and not self.end_in_flight[(actor.serial, info.operation_id)]:
                paused.append(info.instance_id)
                self.paused_reported.add((actor.serial, info.operation_id))
        if paused and coordinator_died:
            dead = [(t, a) for t, a in self.world.kills + self.world.declared
                    if a.kind == COORDINATOR and t > record.start]
            met = [m for _, m, _ in record.dead_calls]
            self.violate(f"{record.op_id} failed ({type(exc).__name__}) after its "
                         f"coordinator {dead[0][1]} died at t={dead[0][0]:.2f}, and its abort "
                         f"met the dead coordinator's name ({len(met)} call(s) to the dead "
                         f"actor: {sorted(set(met))}): it left {paused} paused for it until "
                         f"their lease{self._queue_note(record.op_id)}")
        elif paused:
            self.violate(f"{record.op_id} failed ({type(exc).__name__}) but left {paused} "
                         f"paused for it{self._queue_note(record.op_id)}")
        if coordinator_died:
            return
        if isinstance(exc, LeaseExpiredError) and not self._stalled(record):
            full = self._full_disk_during(record)
            if full is not None:
                over = full[0] + full[1] < self.now()
                self.violate(f"{record.op_id} lost its lease (LeaseExpiredError) although its "
                             f"driver renewed on time: the renewals' claim write met a disk "
                             f"full from {full[0]:.1f}s for {full[1]:.1f}s"
                             + (", which recovered before the commit" if over else "")
                             + self._queue_note(record.op_id))
            elif self.path_claimed_by_job2.get(record.path, float("inf")) <= (
                    record.end if record.end is not None else self.now()):
                self.violate(f"{record.op_id} lost its lease (LeaseExpiredError) although its "
                             f"driver renewed on time: the renewals' claim of the path was "
                             f"refused (a second job claimed it), and the holders' renewal "
                             f"was skipped with it{self._queue_note(record.op_id)}")
            else:
                self.violate(f"{record.op_id} lost its lease although nothing stalled its "
                             f"renewals{self._queue_note(record.op_id)}")

    def _stalled(self, record: OpRecord) -> bool:
        """Whether a fault could have stopped the lease renewals of ``record``."""
        end = record.end if record.end is not None else self.now()
        return any(record.start <= at <= end and (
            kind.startswith(("clock_jump", "cancel", "stall")) or kind in ("kill_coordinator",
                                                                  "kill_driver"))
            for at, kind in self.fired) \
            or any(record.start - CONFIG.lease_s <= at <= end
                   for at, _ in self.world.slow_links) \
            or self.killed_since(record.start, (COORDINATOR, "driver"))

    def _check_error_kind(self, exc: BaseException, what: str) -> None:
        """Every failure the runtime reports is one of its own error classes."""
        if not isinstance(exc, NemoCkptError):
            self.violate(f"{what} raised {type(exc).__name__}, not a nemo-ckpt error: "
                         f"{_short(exc)}")

    async def _check_failed_restore(self, record: OpRecord, loaded: Any) -> None:
        """A failed restore left nothing it restored live: all or nothing."""
        if self.killed_since(record.start, ("driver",)):
            return
        restored = {r.continued().episode for recs in loaded.sessions.values() for r in recs}
        live = []
        for actor in self.world.live(HOLDER):
            if self.end_in_flight[(actor.serial, record.op_id or "")]:
                continue  # its abort is on a slow link: it lands, or the retry adopts it
            live += [f"{actor.name}/{s.episode.capture_key}"
                     for s in await self._ask(actor, "sessions") if s.episode in restored]
        if live:
            self.violate(f"restore {record.op_id} failed but left {sorted(live)} live: not "
                         f"all or nothing")
        if self.plan.slow_reads and not self._stalled(record) and \
                record.outcome in ("LeaseExpiredError", "StaleSnapshotError"):
            self.violate(f"restore {record.op_id} lost its lease during a long read although "
                         f"renewals kept coming")

    async def _check_restored(self, restored: Any, loaded: Any) -> None:
        """Restored sessions equal what was captured, each as its next attempt."""
        sessions = await self.live_sessions()
        for instance, records in loaded.sessions.items():
            if instance not in sessions:
                continue  # its holder died since (lost with its node)
            live = {s.episode: s for s in sessions.get(instance, [])}
            for record in records:
                want = record.continued()
                got = live.get(want.episode)
                if got is not None and self.sandbox_root is not None:
                    self._check_restored_directory(got)
                    got = dataclasses.replace(got, directory=None)
                if got != want:
                    self.violate(f"restored {instance}/{want.episode.capture_key} is {got}, "
                                 f"captured {want}")
        want_attempts = {(i, r.episode.rollout_id, r.episode.attempt)
                         for i, recs in loaded.sessions.items() for r in recs}
        if set(restored.continued_attempts) != want_attempts:
            self.violate("restored.continued_attempts differs from the snapshot's sessions")
        self._check_one_live_session_per_rollout(sessions)

    def _check_restored_directory(self, session: SessionRecord) -> None:
        if session.directory is None:
            self.violate(f"restored {session.episode.capture_key} has no directory")
            return
        state = Path(session.directory) / "state"
        found = state.read_bytes() if state.exists() else None
        if found != session.state:
            self.violate(f"the restored directory of {session.episode.capture_key} holds "
                         f"state {found!r}, its session {session.state!r}")

    def _check_one_live_session_per_rollout(self,
                                            sessions: dict[str, list[SessionRecord]]) -> None:
        where: dict[str, list[str]] = defaultdict(list)
        for instance, records in sessions.items():
            for s in records:
                where[s.episode.rollout_id].append(f"{instance}/{s.episode.capture_key}")
        for rollout_id, places in sorted(where.items()):
            if len(places) > 1:
                self.violate(f"rollout {rollout_id} is live {len(places)} times: {places}")

    async def _monitor(self) -> None:
        """All along: no holder stays paused or restoring for an operation that has
        ended, beyond the time its abort or resume takes to land, unless the process
        that would end it (its driver or the coordinator) died."""
        while True:
            await asyncio.sleep(0.5)
            now = self.now()
            for actor in self.world.live(HOLDER):
                state, op_id = actor.obj.current
                if state is HolderState.RUNNING or op_id is None:
                    continue
                record = next((r for r in self.ops if r.op_id == op_id), None)
                key = (actor.serial, op_id)
                if record is None or record.end is None or self._exempt(op_id) \
                        or key in self.paused_reported or self.end_in_flight[key]:
                    continue
                since = max(self.paused_since.setdefault(key, now), record.end)
                if now - since <= GRACE_S:
                    continue
                self.paused_reported.add(key)
                arrived = self.begin_delivered.get(key)
                ended = self.end_delivered.get(key)
                if arrived is not None and ended is not None and arrived > ended:
                    self.violate(f"{actor.name} is {state.value} for {op_id}: "
                                 f"its begin arrived after its abort or resume, and a late "
                                 f"call paused it again{self._queue_note(op_id)}")
                elif record.outcome == "CancelledError":
                    self.violate(f"{actor.name} is still {state.value} for "
                                 f"{op_id} after its driver was cancelled"
                                 f"{self._queue_note(op_id)}")
                else:
                    self.violate(f"{op_id} failed ({record.outcome}) but left "
                                 f"['{actor.name}'] {state.value} for it"
                                 f"{self._queue_note(op_id)}")

    def _exempt(self, op_id: str | None) -> bool:
        """A holder may stay paused for an operation until its lease lapses only when the
        process that would abort it (its driver or the coordinator) died."""
        record = next((r for r in self.ops if r.op_id == op_id), None)
        if record is None:
            return True  # an id no driver here made (a dead driver's late message)
        return self.killed_since(record.start, (COORDINATOR, "driver"))

    def _queue_note(self, op_id: str | None) -> str:
        """Why ``op_id``'s holders may have stayed paused: its control calls waited (or
        wait now) for a concurrency slot behind turns waiting at a holder's gate."""
        waits = {f"{method} at {holder}" for _, holder, method, op, _, _, _
                 in self.queued_behind_turns if op == op_id}
        for actor in self.world.live(HOLDER):
            for queue in actor.queues.values():
                for method, payload, _, _, ahead in queue:
                    args = pickle.loads(payload) if method not in SESSION_METHODS and \
                        _session_calls(ahead) else ()
                    if args and args[0] == op_id:
                        waits.add(f"{method} at {actor.name}")
        if not waits:
            return ""
        return (f"; a control call queued behind turns and opens waiting at the gate, in the "
                f"holder's one concurrency group: {sorted(waits)}")

    def _check_control_not_queued(self) -> None:
        """A holder's control calls (pause, release, renewals, persist, resume, abort) do
        not wait for a concurrency slot behind turns waiting at its gate."""
        seen = set()
        for when, holder, method, op, waited, turns, limit in self.queued_behind_turns:
            if waited <= GRACE_S or op in seen:
                continue
            seen.add(op)
            record = next((r for r in self.ops if r.op_id == op), None)
            outcome = f"; {op} ended {record.outcome}" if record is not None else ""
            self.violate(f"a control call queued behind turns: {method}({op}) waited "
                         f"{waited:.1f}s for a slot at {holder} behind {turns} (workers' "
                         f"session calls, held by its paused gate), in one concurrency group "
                         f"of limit {limit} (until t={when:.2f}){outcome}")

    async def _check_settled(self) -> None:
        """The drivers stopped and messages landed, well within a lease: no holder waits
        for an operation that a live driver and coordinator could have ended, and no turn
        is in flight for a worker that is still alive."""
        for actor in self.world.live(HOLDER):
            holder = actor.obj
            for key, turn in sorted(getattr(holder, "_turns", {}).items()):
                worker = self.rollout_worker.get(key)
                if self.turn_aborts_in_flight[turn.token]:
                    continue  # its abort is on a slow link
                if worker is not None and worker.alive:
                    self.violate(f"{holder.instance_id} holds a turn of {key} in flight "
                                 f"although its worker went away alive")

    async def _check_final(self) -> None:
        """Past every lease and turn deadline."""
        for message in self.blocked:
            self.violate(message)
        self._check_control_not_queued()
        self._check_world()
        for info in await self.holder_infos():
            if info.state is not HolderState.RUNNING:
                self.violate(f"{info.instance_id} is {info.state.value} for "
                             f"{info.operation_id} past its lease"
                             f"{self._queue_note(info.operation_id)}")
            if info.turns_in_flight:
                self.violate(f"{info.instance_id} has {info.turns_in_flight} turn(s) in "
                             f"flight past the turn deadline")
        self._check_one_live_session_per_rollout(await self.live_sessions())
        for actor in self.world.live(HOLDER):
            bounds = actor.obj.bounds()
            if bounds["history"] > 64 or bounds["drivers"] > 64 \
                    or bounds["aborted_tokens"] > 4096 or bounds["released"]:
                self.violate(f"{actor.name} remembers more than its bounds: {bounds}")
        for actor in self.world.live(COORDINATOR):
            coordinator = actor.obj
            table = coordinator.operations
            if table:  # every operation ended, with one outcome each
                self.violate(f"the coordinator still holds "
                             f"{sorted(o.id for o in table.open_ones())} past every lease")
            if table.bounds()["history"] > 64 or coordinator.folders.locks_held:
                self.violate("the coordinator remembers more than its bounds")
        for path in sorted({r.path for r in self.ops}):
            env = environment_dir(path)
            if not (env / "manifest.json").exists():
                if self.committed.get(path):
                    self.violate(f"{Path(path).name}: committed {self.committed[path][-1]} "
                                 f"but no manifest is there now{self._zombie_work(0.0)}")
                continue
            try:
                loaded = read_snapshot(path)
            except Exception as exc:
                self.violate(f"{Path(path).name}: the manifest does not verify: "
                             f"{type(exc).__name__}: {_short(exc)}{self._zombie_work(0.0)}")
                continue
            sid = loaded.manifest.snapshot_id  # its directories: ``_check_world_of``
            if sid in self.failed_checks:
                self.violate(f"{Path(path).name}: {sid} is committed although its check "
                             f"failed")
            seen = self.committed.get(path, [])
            if seen and seen[-1] != sid:
                last = next(r for r in self.ops if r.op_id == seen[-1])
                later = self._captured_later(last)
                if sid not in later:
                    self.violate(f"{Path(path).name}: {seen[-1]} was committed last, but "
                                 f"the manifest names {sid}")
        for _, _, name, args, _ in self.world.io_log:
            if name == "write_manifest":
                data = args[1]
                sid = json.loads(data)["snapshot_id"] if isinstance(data, bytes) else \
                    data.snapshot_id
                if sid in self.failed_checks:
                    self.violate(f"a manifest was written for {sid}, whose check failed")


def _session_calls(methods: tuple[str, ...]) -> str:
    """The workers' session calls (turns, opens: they wait at a paused holder's gate)
    among ``methods``, counted by method; "" if none."""
    counts: dict[str, int] = defaultdict(int)
    for method in methods:
        if method in SESSION_METHODS:
            counts[method] += 1
    return ", ".join(f"{n} {m}" for m, n in sorted(counts.items()))


def _check_world_of(schedule: Schedule) -> None:
    """The invariants of the world outside the protocol (issue 23): every committed
    snapshot's blobs are there; nothing outside a sandbox was read into one; a sandbox's
    sparse file is not stored densely; a damaged manifest is refused with the project's
    error."""
    root = schedule.root
    if schedule.sandbox_root is not None:
        for path in committed_snapshots(root):
            try:
                manifest = read_manifest(path)
            except Exception:
                continue  # reported by the checks of each path
            problems = verify_directories(path, manifest)
            if problems:
                gcs = "".join(f"; a gc from another host, its clock {skew:+.0f}s from the "
                              f"coordinator's, removed {n} blobs at t={t:.2f}"
                              for t, n, skew in schedule.gc_removals)
                schedule.violate(f"committed snapshot {manifest.snapshot_id} at "
                                 f"{Path(path).name} references a blob that is missing or "
                                 f"damaged ({len(problems)} problem(s)): {problems[0]}{gcs}"
                                 f"{schedule._zombie_work(0.0)}")
        secret = schedule.secret.read_bytes()
        for holder in schedule.world.actors:
            boxes = getattr(holder.obj, "_sandboxes", None)
            cache = getattr(boxes, "_cache", None)
            if cache is not None and any(secret in b for b in cache._memory.values()):
                schedule.violate(f"the secret file outside every sandbox was read into "
                                 f"the node cache of {holder.name} (memory)")
        for where, _, files in os.walk(root):
            for name in files:
                path = Path(where) / name
                if path == schedule.secret:
                    continue
                try:
                    info = path.lstat()
                    if not stat.S_ISREG(info.st_mode):
                        continue
                    if info.st_size < 4096 and secret in path.read_bytes():
                        schedule.violate(f"the secret file outside every sandbox was read "
                                         f"into one: {path.relative_to(root)} holds it")
                except OSError:
                    continue
    if schedule.plan.sparse:
        _check_dense(schedule)
    if schedule.plan.damage is not None:
        _check_damaged_manifest(schedule)


def _check_dense(schedule: Schedule) -> None:
    """No copy of a sandbox's sparse file (in the node caches, the blob store or a
    restored directory) takes its apparent size: the holes stay holes. Checked after
    each commit too (retention and the caches' sweep may remove them later)."""
    root, reported = schedule.root, schedule.dense_reported
    for where, _, files in os.walk(root):
        for name in files:
            path = Path(where) / name
            with contextlib.suppress(OSError):
                info = path.lstat()
                if stat.S_ISREG(info.st_mode) and info.st_size >= SPARSE_BYTES // 2 and \
                        info.st_blocks * 512 >= SPARSE_BYTES // 2 and path not in reported:
                    reported.add(path)
                    schedule.violate(f"a sparse file made in a turn ({SPARSE_BYTES >> 20} MiB "
                                     f"apparent, no blocks) was copied densely: "
                                     f"{path.relative_to(root)} takes "
                                     f"{info.st_blocks * 512 >> 20} MiB")


def _check_damaged_manifest(schedule: Schedule) -> None:
    """A copy of a committed snapshot whose manifest is damaged (a shard length of 1e15,
    or nesting thousands deep) is refused with a nemo-ckpt error, not a traceback."""
    committed = [p for p in committed_snapshots(schedule.root)]
    if not committed:
        return
    copy = schedule.root / "damaged"
    shutil.copytree(environment_dir(committed[0]), environment_dir(copy))
    manifest = environment_dir(copy) / "manifest.json"
    kind = schedule.plan.damage
    if kind == "huge":
        data = json.loads(manifest.read_bytes())
        if not data.get("shards"):
            return
        data["shards"][0]["bytes"] = 10**15
        manifest.write_text(json.dumps(data))
    else:
        manifest.write_text("[" * 100_000 + "]" * 100_000)
    schedule.faults += 1
    try:
        read_snapshot(str(copy))
    except NemoCkptError:
        pass
    except BaseException as exc:
        what = "a shard length of 1e15" if kind == "huge" else "nested 100,000 deep"
        schedule.violate(f"a damaged manifest ({what}) made read_snapshot raise "
                         f"{type(exc).__name__}, not a nemo-ckpt error")
    else:
        schedule.violate(f"a damaged manifest ({kind}) was read as a snapshot")
    shutil.rmtree(copy, ignore_errors=True)


# Which reviewed case (issue 11, then 23, then 29) a violation shows, by its wording.
CASES = [
    ("29.1 a zombie coordinator's clean-up removed a newer snapshot's files",
     ("a zombie coordinator",)),
    ("29.2 a call after the coordinator's death met its dead name",
     ("met the dead coordinator's name",)),
    ("29.3 control calls queued behind waiting turns", ("a control call queued behind",)),
    ("29.6 a driver with another config committed", ("made with another config",)),
    ("23.1 committed snapshot references a missing blob", ("references a blob that is",)),
    ("23.2 a file outside the sandbox read into one", ("the secret file outside every",)),
    ("23.3 a scan blocked on a FIFO", ("opening a FIFO",)),
    ("23.9 a call waits past its deadline (not on a FIFO)", ("a call waits past its deadline",)),
    ("23.4 lease lost although renewed on time", ("although its driver renewed on time",)),
    ("23.5 a sparse file copied densely", ("was copied densely",)),
    ("23.6 a damaged manifest raised a traceback", ("a damaged manifest",)),
    ("23.7 two jobs hold one checkpoint path", ("a second job claimed",)),
    ("23.8 a disk error escaped as OSError", ("raised OSError, not a nemo-ckpt error",)),
    ("1 committed snapshot lost", ("does not verify", "but no manifest is there",
                                   "was committed last, but")),
    ("2 holders left paused by a failed operation", ("paused for it", "restoring for it")),
    ("3 holders left paused by a cancelled driver", ("after its driver was cancelled",)),
    ("4 orphan turn of a cancelled worker", ("although its worker went away alive",)),
    ("5 restore left half-live", ("not all or nothing", "the retry of a failed restore")),
    ("6 restore lost its lease during a long read", ("during a long read",)),
    ("7 late begin paused a holder after its abort", ("a late call paused it again",)),
    ("10 refused snapshot committed", ("check against the cut failed", "whose check failed",
                                       "although its check failed")),
]


def case_of(violation: str) -> str:
    for name, marks in CASES:
        if any(m in violation for m in marks):
            return name
    return "other"


def _short(exc: BaseException) -> str:
    text = str(exc).replace("\n", " ")
    return text if len(text) < 200 else text[:197] + "..."


# --- running many -----------------------------------------------------------------------------


def _scratch_root() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="nemo-ckpt-sim-",
                                 dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))


def run_one(seed: int, tracing: bool = False) -> Result:
    root = _scratch_root()
    try:
        return Schedule(seed, root, tracing).run()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_range(args: tuple[int, int]) -> tuple[int, int, list[Result]]:
    _quiet()
    first, count = args
    faults = 0
    bad = []
    for seed in range(first, first + count):
        result = run_one(seed)
        faults += result.faults
        if result.violations:
            bad.append(result)
    return count, faults, bad


def _quiet() -> None:
    logging.getLogger("nemo_ckpt").setLevel(logging.CRITICAL + 1)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL + 1)


def run_many(first: int, count: int, jobs: int) -> tuple[int, int, list[Result]]:
    chunks = [(first + k, 1) for k in range(count)]
    size = max(1, count // (jobs * 20))
    chunks = [(first + k, min(size, count - k)) for k in range(0, count, size)]
    total = faults = 0
    bad: list[Result] = []
    if jobs <= 1:
        results = map(_run_range, chunks)
        for n, f, b in results:
            total, faults, bad = total + n, faults + f, bad + b
        return total, faults, bad
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        for n, f, b in pool.imap_unordered(_run_range, chunks):
            total, faults, bad = total + n, faults + f, bad + b
    return total, faults, sorted(bad, key=lambda r: r.seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--replay", type=int, metavar="SEED",
                        help="run one schedule and print its trace")
    args = parser.parse_args(argv)
    _quiet()
    if args.replay is not None:
        result = run_one(args.replay, tracing=True)
        print(f"schedule {args.replay}: {Plan.make(args.replay)}")
        print("\n".join(result.trace))
        for v in result.violations:
            print(f"VIOLATION {v}")
        print(f"simulation: 1 schedules, {result.faults} faults injected, "
              f"{len(result.violations)} invariant violations")
        return 1 if result.violations else 0
    start = time.monotonic()
    total, faults, bad = run_many(args.first_seed, args.schedules, args.jobs)
    first: dict[str, tuple[int, int]] = {}  # case -> (first seed, schedules showing it)
    for result in bad:
        for case in sorted({case_of(v) for v in result.violations}):
            seed, n = first.get(case, (result.seed, 0))
            first[case] = (min(seed, result.seed), n + 1)
    for case, (seed, n) in sorted(first.items()):
        example = next(v for r in bad if r.seed == seed for v in r.violations
                       if case_of(v) == case)
        print(f"case {case}: first at seed {seed} ({seed - args.first_seed + 1} schedules), "
              f"in {n} schedules: {example}")
        print(f"  replay: {REPLAY.format(seed=seed)}")
    violations = sum(len(r.violations) for r in bad)
    print(f"simulation: {total} schedules, {faults} faults injected, {violations} invariant "
          f"violations ({time.monotonic() - start:.1f}s, seeds {args.first_seed}.."
          f"{args.first_seed + total - 1})")
    return 1 if bad else 0


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":  # sets iterate the same on every replay
        os.execve(sys.executable, [sys.executable, "-m", "tests.simulation", *sys.argv[1:]],
                  dict(os.environ, PYTHONHASHSEED="0"))
    sys.exit(main())
