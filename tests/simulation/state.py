"""What the parts of a schedule share: its plan, its world, its RNG, the records of the
operations and processes the workload runs and the faults meet, and the trace and the
violations. The workload, the faults and the checkers each hold one ``State``
(``Part``), so none of them reaches into another's bookkeeping."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.sim import SimActor, SimWorld
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.driver import RayEnvironmentCheckpoint
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.transport import COORDINATOR, HOLDER

from .plan import CONFIG, Plan
from .rl import NemoRL, SimRL

SECRET = b"the-secret-outside-every-sandbox"


def secret_bytes(seed: int) -> bytes:
    """What the file outside every sandbox holds in schedule ``seed`` (``HostileSandbox``)."""
    return SECRET + f"-{seed}".encode()


# RL's half of a managed snapshot, as the simulation's RL writes it into the folder.
RL_HALF = "rl_half"


def remove_rl_half(path: str) -> None:
    """``RlHalf.remove``, for every manager of the schedule."""
    with contextlib.suppress(FileNotFoundError):
        (Path(path) / RL_HALF).unlink()


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
    entry_failed: float | None = None  # when a snapshot failed before its block began
    failed_at: float | None = None  # a restore's first attempt failed (RL may retry)
    failed_id: str | None = None  # its id then: None if it never reached the coordinator
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

    def __init__(self, sim: State, name: str, config: CheckpointConfig | None = None
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
        self.manager: Any = None  # its RolloutCheckpointManager (Plan.manager), made once
        sim.drivers[self.actor] = self



class State:
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
        # In some schedules the coordinator reaches its few holders through relays, as
        # it does from ``relay_min_holders`` on (drawn apart: the plan's draws stay).
        self.relays = random.Random(f"relays-{seed}").random() < 0.4
        if self.relays:
            self.config = self.config.model_copy(update={"relay_min_holders": 2})
        self.rl = SimRL()
        # RL's side as NeMo RL's objects are, in the nemo_rl schedules (the workload's).
        self.nemo: NemoRL | None = None
        # RL's saves, committed with the environment's snapshot: path -> ``rl.Saved`` (or
        # ``rl.NemoSaved``); a restore starts a new RL process, which has none yet.
        self.saves: dict[str, Any] = {}
        self.tracing = tracing
        self.trace: list[str] = []
        self.violations: list[str] = []
        self.faults = 0
        self.rng = random.Random(f"run-{seed}")
        # What the workload runs:
        self.ops: list[OpRecord] = []
        self.committed: dict[str, list[str]] = defaultdict(list)  # path -> ids seen committed
        self.managed_removing: set[str] = set()  # managed snapshots retention began to remove
        self.next_managed_name = ""  # the folder a managed snapshot takes next
        self.failed_checks: set[str] = set()
        self.driver: Driver | None = None
        self.drivers: dict[SimActor, Driver] = {}
        self.workers: dict[str, SimActor] = {}  # instance -> worker pseudo-actor
        self.rollout_tasks: dict[str, asyncio.Task[Any]] = {}  # capture key -> its task
        self.rollout_worker: dict[str, SimActor] = {}  # capture key -> worker
        # What the faults did:
        self.fired: list[tuple[float, str]] = []
        self.enospc_hit: set[int] = set()  # windows that refused a write
        self.secret = root / "secret.txt"  # the file outside every sandbox
        self.path_claimed_by_job2: dict[str, float] = {}  # path -> when
        # (when, blobs removed, the gc's clock minus the coordinator's) of each gc pass
        self.gc_removals: list[tuple[float, int, float]] = []
        self.removed: dict[str, float] = {}  # path -> when a user's retention removed it
        # claim file -> the process that wrote it last, and when (``DiskFaults``)
        self.claim_writers: dict[str, tuple[SimActor | None, float]] = {}

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

    def killed_since(self, start: float, kinds: Iterable[str]) -> bool:
        """Whether an actor of ``kinds`` died, or Ray declared it dead, after ``start``."""
        kinds = set(kinds)
        return any(t > start and a.kind in kinds
                   for t, a in self.world.kills + self.world.declared)

    def coordinator_offset(self) -> float:
        live = self.world.live(COORDINATOR)
        return live[0].wall_offset if live else 0.0

    # --- inspection (in-process, not through the transport) ---------------------------------

    async def ask(self, actor: SimActor, method: str, *args: Any) -> Any:
        """Call a holder's method in-process, as a task of the holder (whatever it
        starts dies with it)."""
        return await self.world.spawn(actor, getattr(actor.obj, method)(*args))

    async def holder_infos(self) -> list[Any]:
        return [await self.ask(a, "info") for a in self.world.live(HOLDER)]

    async def live_sessions(self) -> dict[str, list[SessionRecord]]:
        return {a.name: await self.ask(a, "sessions") for a in self.world.live(HOLDER)}


class Part:
    """A part of a schedule (its workload, its faults, its checkers): the shared ``State``
    as ``s``, and the fixed parts of it by their own names."""

    def __init__(self, s: State) -> None:
        self.s = s
        self.seed, self.plan, self.world, self.rng = s.seed, s.plan, s.world, s.rng
        self.root, self.sandbox_root, self.config = s.root, s.sandbox_root, s.config
        self.secret = s.secret
        self.now, self.log, self.violate = s.now, s.log, s.violate
        self.killed_since = s.killed_since


def short(exc: BaseException) -> str:
    text = str(exc).replace("\n", " ")
    return text if len(text) < 200 else text[:197] + "..."
