"""The faults of a schedule, apart from the workload they hit and the checks that judge
the outcome: processes killed (holders, the coordinator, drivers, workers, whole nodes),
operations and rollouts cancelled, clocks jumping past leases, shard, manifest and
sandbox writes failing or torn, slow reads, a cut that does not match the capture;
the world outside the protocol (issue 23: ``DiskFaults`` at every ``Folder`` call, a gc
from another host, a retention script, a second job, a ``HostileSandbox``); and Ray as it
behaves (issue 29: deaths noticed late, stalls declared dead that run again as zombies,
a concurrency limit). Each is drawn by the plan, fired at its time or at its trigger."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import math
import os
import random
import shutil
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from actors.sim import SimActor
from nemo_ckpt.catalog.listing import remove_snapshot
from nemo_ckpt.errors import CheckpointPathBusyError, NemoCkptError, SnapshotWriteError
from nemo_ckpt.manager.config import RolloutCheckpointConfig
from nemo_ckpt.manager.record import RECORD_FILE
from nemo_ckpt.manager.rollout_manager import RolloutCheckpointManager
from nemo_ckpt.storage.checkpoint_folder import environment_dir
from nemo_ckpt.storage.folder import unlistable
from nemo_ckpt.storage.local_folder import LocalFolder, write_failure
from nemo_ckpt.storage.path_claims import claim_path, release_claim
from nemo_ckpt.testing.data_plane import StaticCut
from nemo_ckpt.transport import COORDINATOR, HOLDER, RELAY
from nemo_ckpt.trees.collection import collect_blobs
from nemo_ckpt.trees.scan import _Scanner

from .checkers import Checkers
from .plan import CONFIG, TRIGGERS
from .state import RL_HALF, Part, State, remove_rl_half, secret_bytes, short

# The folder a hostile writer's manifest is planted in (``Faults.plant``).
PLANTED_DIR = "planted"
# ... and the link named as a manager's partial snapshot (in manager schedules).
PLANTED_LINK = "rollout-link.partial"

# --- disk faults at every Folder call -------------------------------------------------


class DiskFaults:
    """Faults at every ``Folder`` call an actor makes in a blocking call (every folder
    here is a ``LocalFolder``, so its methods are wrapped, once per process): writes
    (shards, manifests, path claims, blob-store holds and collection claims, blobs) and
    removals that raise after they happened (the file is in place, or gone), reads that
    raise EIO, and windows of virtual time in which every write finds the disk full.
    Errors are raised as the folder raises them (``Folder``'s contract: a write or a
    removal ``SnapshotWriteError``, a listing ``CheckpointPathError``, a read ``OSError``).
    A conditional write (``expect``) may also land and then meet the conflict a bucket
    client's retry of it meets (issue 34: the server wrote it, its answer was a 500, the
    retry gets a 412): ``FileExistsError``. Who wrote each claim file last is kept
    (``State.claim_writers``)."""

    active: Faults | None = None
    _installed = False

    @classmethod
    def install(cls, faults: Faults) -> None:
        cls.active = faults
        if cls._installed:
            return
        cls._installed = True
        for method, kind in (("prepare", "write"), ("write_stream", "write"),
                             ("write_bytes", "write"), ("remove", "remove"),
                             ("read", "read"), ("read_chunks", "read"),
                             ("names", "read")):
            setattr(LocalFolder, method, cls._wrap(getattr(LocalFolder, method), kind))

    @classmethod
    @contextlib.contextmanager
    def off(cls) -> Iterator[None]:
        """No disk faults for the calls made inside (RL's own disk: its half of a rollout
        snapshot, which the simulation's RL writes as it did before issue 52)."""
        active, cls.active = cls.active, None
        try:
            yield
        finally:
            cls.active = active

    @staticmethod
    def _as_raised(method: str, target: str, error: OSError) -> Exception:
        if method == "names":
            return unlistable(target, error)
        if method in ("read", "read_chunks"):
            return error
        return SnapshotWriteError(target, write_failure(target, error))

    @classmethod
    def _wrap(cls, original: Any, kind: str) -> Any:
        def faulty(folder: LocalFolder, *args: Any, **kwargs: Any) -> Any:
            faults = cls.active
            if faults is None or faults.world.running is None:
                return original(folder, *args, **kwargs)  # the checkers' own calls
            target = folder.describe(args[0] if args and isinstance(args[0], str) else "")
            name = original.__name__
            expect = kwargs.get("expect", args[3] if len(args) > 3 else None)
            conditional = name == "write_bytes" and expect is not None
            fault = faults.disk_fault("conditional" if conditional else kind, target)
            if fault == "enospc":
                raise SnapshotWriteError(target, write_failure(
                    target, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
            if fault == "eio":
                raise cls._as_raised(original.__name__, target, OSError(
                    errno.EIO, f"{os.strerror(errno.EIO)} (injected): {target}"))
            result = original(folder, *args, **kwargs)
            if kind == "write" and Path(target).name.startswith(".claim-"):
                faults.s.claim_writers[target] = (faults.world.running, faults.now())
            if fault == "landed":
                raise FileExistsError(f"{target} exists or changed (injected: the write "
                                      f"landed, its answer was lost, and its retry met it)")
            if fault == "after":
                raise cls._as_raised(original.__name__, target, OSError(
                    errno.EIO, f"{os.strerror(errno.EIO)} after the fsync and the rename "
                               f"(injected)"))
            return result

        faulty.__name__ = original.__name__
        return faulty


# --- a hostile process inside a sandbox -----------------------------------------------



class HostileSandbox:
    """The process inside a sandbox (model-generated code), acting just before the scan
    opens a file it listed: it swaps the file for a symlink to a secret file outside
    every sandbox, for a FIFO, or changes it. The scan's ``_Scanner._file`` opens each
    listed file (``nemo_ckpt/trees/scan.py``), so it is wrapped (once per process) here
    alone."""

    active: Faults | None = None
    _installed = False

    @classmethod
    def install(cls, faults: Faults) -> None:
        cls.active = faults
        if cls._installed:
            return
        cls._installed = True
        original = _Scanner._file

        def read_file(scanner: _Scanner, fd: int, name: str, path: str, *args: Any,
                      **kwargs: Any) -> Any:
            faults = cls.active
            if faults is not None and faults.plan.hostile:
                faults.swap(os.fsdecode(path))
            return original(scanner, fd, name, path, *args, **kwargs)

        _Scanner._file = read_file  # type: ignore[method-assign, assignment]
        made = _Scanner.__init__

        def every_file_racy(scanner: _Scanner, *args: Any, **kwargs: Any) -> None:
            made(scanner, *args, **kwargs)
            if cls.active is not None:
                # Which files a scan skips as unchanged depends on real time (their real
                # mtimes against the scan's real start: the racy window), and every file
                # it reads draws from the schedule's RNG above: in a schedule, every file
                # is racy and read, so a seed replays the same under any load.
                scanner.racy_after = -(1 << 62)

        _Scanner.__init__ = every_file_racy  # type: ignore[method-assign]


# --- the schedule's faults ----------------------------------------------------------------


class Faults(Part):

    def __init__(self, s: State, check: Checkers) -> None:
        super().__init__(s)
        self.check = check  # for what a fault can only judge as it acts (a second job)
        self.triggered: dict[tuple[str, str], int] = defaultdict(int)
        self.retired: set[str] = set()  # paths a user's retention script removed
        self.relay_rng = random.Random(f"relay-kills-{s.seed}")
        self.relay_kills = 0
        # What a manager's retention removing a snapshot tells the workload (Schedule).
        self.on_managed_event: Any = lambda event, path: None
        self.hang_ends: float | None = None  # when the coordinator's hang ends (Plan.hang)
        self._install_io_faults()
        DiskFaults.install(self)
        HostileSandbox.install(self)
        self.secret.write_bytes(secret_bytes(self.seed))
        self._install_ray()
        self._install_releases()
        self._install_reply_loss()
        self._install_slow_open()

    def withdraw(self) -> None:
        """The process-wide hooks (``DiskFaults``, ``HostileSandbox``) off at the schedule's
        end: the wrappers stay installed, but act for no one until the next schedule, so a
        test that runs after schedules in the same process scans and writes for real."""
        if DiskFaults.active is self:
            DiskFaults.active = None
        if HostileSandbox.active is self:
            HostileSandbox.active = None

    # --- at a message or a file operation (the world's hooks): the planned triggers -------

    def on_deliver(self, target: SimActor, method: str, args: tuple[Any, ...]) -> None:
        aimed = f"holder.{method}"
        if target.kind == HOLDER and aimed in TRIGGERS["kill_at"]:
            method = aimed
        if self._trigger("kill_at", method):
            self.log(f"fault: {target} is killed as {method} arrives")
            self.world.kill(target)

    def after_io(self, actor: SimActor, name: str) -> None:
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

    def on_send(self, caller: SimActor, callee: SimActor, method: str,
                args: tuple[Any, ...]) -> None:
        if caller.kind == RELAY:
            self._relay_dies(caller, method)
            return
        driver = self.s.drivers.get(caller)
        if driver is None:
            return
        if method == "release" and callee.kind == HOLDER and self.plan.release_kill:
            self.direct_releases += 1
            if self.direct_releases == self.plan.release_kill:
                # Its commit has left; the rest of its releases never do.
                self.s.faults += 1
                self.s.fired.append((self.now(), "kill_driver_at_release"))
                self.log(f"fault: {driver.name} dies as it releases {callee} itself")
                self.world.kill(caller)
                return
        task = driver.op_task
        if task is not None and not task.done() and self._trigger("cancel_at", method):
            self.log(f"fault: {driver.name}'s operation is cancelled as it sends {method}")
            self.world.loop.call_later(self.rng.uniform(0.0, 0.02), task.cancel)

    def _relay_dies(self, relay: SimActor, method: str) -> None:
        """A relay dies mid-phase, right after passing one call on: the holders it
        reached so far have it, the others never will (a few per schedule, drawn apart
        from the plan)."""
        if self.relay_kills < 3 and self.relay_rng.random() < 0.03:
            self.relay_kills += 1
            self.s.faults += 1
            self.s.fired.append((self.now(), f"kill_relay:{method}"))
            self.log(f"fault: {relay} is killed right after passing {method} on")
            self.world.kill(relay)

    def _trigger(self, kind: str, method: str) -> bool:
        """Whether a planned trigger fires now (each fires once, at its n-th call)."""
        for k, m, nth in self.plan.triggers:
            if k == kind and m == method:
                self.triggered[(k, m)] += 1
                if self.triggered[(k, m)] == nth:
                    self.s.faults += 1
                    self.s.fired.append((self.now(), f"{kind}:{method}"))
                    return True
        return False

    # --- at a planned time: kills, cancellations, clock jumps -----------------------------

    async def inject_faults(self) -> None:
        start = self.now()
        for at, kind in self.plan.faults:
            await asyncio.sleep(max(0.0, start + at - self.now()))
            if self._fault(kind):
                self.s.faults += 1
                self.s.fired.append((self.now(), kind))

    def _fault(self, kind: str) -> bool:
        world, rng = self.world, self.rng
        if kind == "kill_holder" and world.live(HOLDER):
            victim = rng.choice(world.live(HOLDER))
        elif kind == "kill_coordinator" and world.live(COORDINATOR):
            victim = world.live(COORDINATOR)[0]
        elif kind == "kill_driver" and self.s.driver is not None and self.s.driver.actor.alive:
            victim = self.s.driver.actor
        elif kind == "kill_worker" and [w for w in self.s.workers.values() if w.alive]:
            victim = rng.choice([w for w in self.s.workers.values() if w.alive])
        elif kind == "kill_node":
            nodes = [n for n in world.alive_nodes() if n != "node-0"]
            if not nodes:
                return False
            node = rng.choice(nodes)
            self.log(f"fault: node {node} dies")
            world.kill_node(node)
            return True
        elif kind == "cancel_op":
            driver = self.s.driver
            if driver is None or driver.op_task is None or driver.op_task.done():
                return False
            self.log(f"fault: {driver.name}'s operation is cancelled")
            driver.op_task.cancel()
            return True
        elif kind == "cancel_rollout":
            running = sorted(k for k, t in self.s.rollout_tasks.items() if not t.done())
            if not running:
                return False
            key = rng.choice(running)
            self.log(f"fault: rollout {key} is cancelled")
            self.s.rollout_tasks[key].cancel()
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

    # --- Ray as it behaves (issue 29) -----------------------------------------------------

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
        self.manifests_written = 0

    def _install_releases(self) -> None:
        """How the releases a driver sends the holders itself travel (issue 26): late
        (past the commit, into the next snapshot's pause), lost, or twice. Its own RNG."""
        self.direct_releases = 0
        link, rng = self.plan.release_link, random.Random(f"release-run-{self.seed}")
        if link is None:
            return

        def route(caller: SimActor, target: SimActor, method: str) -> tuple[float, ...] | None:
            if method != "release" or caller.kind != "driver":
                return None
            self.s.faults += 1
            self.log(f"fault: {caller.name}'s release of {target} is {link}")
            if link == "lost":
                return ()
            if link == "slow":
                return (rng.uniform(0.5, 8.0),)
            return (rng.uniform(0.0005, 0.05), rng.uniform(0.0, 8.0))

        self.world.route = route

    def _install_reply_loss(self) -> None:
        """At-most-once delivery as Ray gives it (issue 34): the answer of a call that ran
        is lost on its way back (a connection reset), for any call between workers, the
        driver, the coordinator and the holders. Its own RNG."""
        chance, rng = self.plan.reply_loss, random.Random(f"reply-loss-run-{self.seed}")
        if not chance:
            return

        def lose(target: SimActor, method: str) -> bool:
            if rng.random() >= chance:
                return False
            self.s.faults += 1
            self.s.fired.append((self.now(), f"lose_reply:{method}"))
            self.log(f"fault: the answer of {method} from {target} is lost")
            return True

        self.world.lose_reply = lose

    def _install_slow_open(self) -> None:
        """The answer to a worker's ``open_session`` travels for up to three seconds
        (``Plan.slow_open``, issue 56): the session is open on its holder while its
        worker has not yet begun the init turn, so a snapshot's pause lands in between
        and captures the session with no turns. Its own RNG."""
        if not self.plan.slow_open:
            return
        rng, delay = random.Random(f"slow-open-run-{self.seed}"), self.world.message_delay

        def slow(target: SimActor, method: str, reply: bool) -> float:
            if reply and method == "open_session":
                return rng.uniform(0.3, 3.0)
            return delay(target, method, reply)

        self.world.message_delay = slow

    async def inject_stalls(self) -> None:
        start = self.now()
        faults = list(self.plan.stalls)
        if self.plan.coordinator_node_dies is not None:
            faults.append((self.plan.coordinator_node_dies, "coordinator_node", 0.0))
        if self.plan.hang is not None:
            faults.append((self.plan.hang[0], "hang", self.plan.hang[1]))
        for at, kind, seconds in sorted(faults):
            await asyncio.sleep(max(0.0, start + at - self.now()))
            if kind == "hang":  # issue 56 case 2: alive to Ray, answering nothing
                actors = self.world.live(COORDINATOR)
                if actors:
                    self.s.faults += 1
                    self.s.fired.append((self.now(), "stall:hang"))
                    self.log(f"fault: the coordinator hangs for {seconds:.1f}s, never "
                             f"declared dead: {actors}")
                    self.world.stall(actors, seconds, math.inf)
                    self.hang_ends = self.now() + seconds
                continue
            if kind == "coordinator_node":  # issue 29 case 2: the node is removed
                for coordinator in self.world.live(COORDINATOR):
                    node = coordinator.node
                    actors = [a for a in self.world.live(COORDINATOR) + self.world.live(HOLDER)
                              if a.node == node]
                    self.s.faults += 1
                    self.s.fired.append((self.now(), "kill_coordinator"))
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

    def _stall(self, actors: list[SimActor], seconds: float, node: str | None,
               why: str) -> None:
        detect = self.plan.detect_s
        self.s.faults += 1
        self.s.fired.append((self.now(), f"stall:{why}"))
        declared = f"; Ray declares it dead at {detect:.1f}s" if seconds > detect else ""
        self.log(f"fault: {why}: {actors} stall for {seconds:.1f}s{declared}")
        self.world.stall(actors, seconds, detect, node)

    # --- the disk: failed, torn and slow file operations, a full disk ---------------------

    def _install_io_faults(self) -> None:
        plan = self.plan
        rng = self.rng

        def decide(name: str, args: tuple[Any, ...]) -> str | None:
            if name == "write_held_shard":
                if rng.random() < plan.io_fail:
                    self.s.faults += 1
                    self.log("fault: a shard write fails")
                    return "fail"
                if rng.random() < plan.io_tear:
                    self.s.faults += 1
                    self.log("fault: a holder dies in the middle of its shard write")
                    return "tear"
            if name in ("persist", "prepare_restore") and plan.sandboxes:
                # A sandbox's blobs and trees file, or a restore's directories.
                if rng.random() < plan.io_fail:
                    self.s.faults += 1
                    self.log(f"fault: a sandbox {name} fails")
                    return "fail"
                if name == "persist" and rng.random() < plan.io_tear:
                    self.s.faults += 1
                    self.log("fault: a holder dies in the middle of writing its blobs")
                    return "tear"
            if name == "write_manifest" and rng.random() < plan.io_fail / 2:
                self.s.faults += 1
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
        if kind == "conditional":
            if plan.disk_landed and self.rng.random() < plan.disk_landed:
                form = self.rng.choice(["landed", "after"])
                self.s.faults += 1
                self.log(f"fault: a conditional write of {Path(target).name} lands, then "
                         + ("its retry meets it (a 412)" if form == "landed" else
                            "raises (a 500 after the retries)"))
                return form
            kind = "write"
        if kind == "write":
            for k, (start, seconds) in enumerate(plan.enospc):
                if start <= now <= start + seconds:
                    if k not in self.s.enospc_hit:
                        self.s.enospc_hit.add(k)
                        self.s.faults += 1
                        self.log(f"fault: the disk is full from {start:.1f}s for "
                                 f"{seconds:.1f}s")
                    return "enospc"
        if kind in ("write", "remove") and plan.disk_after and \
                self.rng.random() < plan.disk_after:
            self.s.faults += 1
            self.log(f"fault: a {kind} of {Path(target).name} raises after it happened")
            return "after"
        if kind == "read" and plan.disk_read_fail and self.rng.random() < plan.disk_read_fail:
            self.s.faults += 1
            self.log(f"fault: a read of {Path(target).name} raises EIO")
            return "eio"
        return None

    # --- RL: a cut that does not match the capture ----------------------------------------

    def corrupt(self, cut: StaticCut) -> StaticCut:
        """A cut RL could not have taken with this capture: a row or an episode missing."""
        self.s.faults += 1
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

    def corrupt_listing(self, keys: frozenset[str]) -> frozenset[str]:
        """NeMo RL's staging listing as RL could not have taken it with this capture: a
        row missing, or one no session wrote (``Plan.bad_cut`` in the nemo_rl schedules)."""
        self.s.faults += 1
        self.log("fault: the staging listing does not match the capture")
        if keys and self.rng.random() < 0.5:
            return keys - {sorted(keys)[self.rng.randrange(len(keys))]}
        return keys | {"a-row-no-session-wrote"}

    # --- the world outside the protocol (issue 23): other processes and hosts -------------

    def outside_actors(self) -> list[Any]:
        plan, out = self.plan, []
        if self.sandbox_root is not None and plan.gc_every:
            out.append(self._gc_process())
        out += [self._retention(at) for at in plan.retention]
        out += [self._second_job(at, k) for k, at in enumerate(plan.second_job)]
        if plan.second_manager:
            out.append(self._second_manager())
        return out

    async def _gc_process(self) -> None:
        """``nemo-ckpt gc ROOT`` run now and then from another host (its own clocks)."""
        actor = self.world.new_actor("gc", "gc", "gc-host")
        actor.alive = True  # a host outside the Ray cluster
        runtime = self.world.runtime(actor)
        while True:
            await asyncio.sleep(self.plan.gc_every * self.rng.uniform(0.5, 1.5))
            self.s.faults += 1
            self.log(f"gc from another host (its clock {actor.wall_offset:+.0f}s)")
            try:
                report = await runtime.run_blocking(
                    collect_blobs, str(self.root), "gc-cli", 30.0, False, runtime.clock.wall)
            except (NemoCkptError, OSError) as exc:
                self.log(f"gc: {type(exc).__name__}: {short(exc)}")
                if isinstance(exc, CheckpointPathBusyError):
                    self.check.check_gc_refused("gc-cli", exc)
            else:
                self.log(f"gc removed {report.removed} blobs")
                if report.removed:
                    self.s.gc_removals.append((self.now(), report.removed, actor.wall_offset
                                               - self.s.coordinator_offset()))

    async def _retention(self, at: float) -> None:
        """A user's retention script on another host removes the oldest committed
        snapshot (``remove_snapshot``), whatever this job is doing there: one a snapshot
        writes or a restore reads must be refused, nothing of it removed."""
        await asyncio.sleep(at)
        actor = self.world.new_actor("retention", "retention", "retention-host")
        actor.alive = True  # a host outside the Ray cluster
        runtime = self.world.runtime(actor)
        for path in sorted(self.s.committed, key=lambda p: self.s.committed[p] and
                           self.s.committed[p][-1] or ""):
            if not self.s.committed[path] or \
                    not (environment_dir(path) / "manifest.json").exists():
                continue
            self.s.faults += 1
            running = [r.op_id for r in self.s.ops if r.end is None and r.path == path]
            self.log(f"retention removes {Path(path).name} ({self.s.committed[path][-1]})"
                     + (f" while {running} run there" if running else ""))
            try:
                await runtime.run_blocking(functools.partial(
                    remove_snapshot, path, wait_s=0.0, clock=runtime.clock.monotonic,
                    snapshot_id=self.s.committed[path][-1]))
            except (NemoCkptError, OSError, asyncio.CancelledError) as exc:
                # Cancelled: the script never heard back; what is on disk tells.
                self.log(f"retention failed: {type(exc).__name__}: {short(exc)}")
                if (environment_dir(path) / "manifest.json").exists():
                    return  # refused, or failed before the manifest went: still committed
            self.retired.add(path)
            self.s.removed[path] = self.now()
            self.s.committed.pop(path)
            self.s.saves.pop(path, None)
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
        self.s.faults += 1
        try:
            await runtime.run_blocking(folder.mkdir, 0o777, True, True)
            await runtime.run_blocking(claim_path, folder, op_id, "job-2",
                                       runtime.clock.wall(), CONFIG.lease_s * 2)
        except NemoCkptError as exc:
            self.log(f"job 2's claim of {path.name} refused: {short(exc)}")
            return
        self.check.check_one_job_per_path(path, actor)
        self.log(f"job 2 holds {path.name}")
        self.s.path_claimed_by_job2.setdefault(str(path), self.now())
        with contextlib.suppress(Exception):
            await asyncio.sleep(CONFIG.lease_s)
            await runtime.run_blocking(release_claim, folder, op_id)

    # --- hostile files in the root (issue 50, case 5) ----------------------------------------

    def plant(self) -> None:
        """A hostile writer's files in the root: a FIFO as the manifest of a folder of its
        own, or a link there to a FIFO in a hidden folder. Every read of the root (a
        commit's numbering, a gc, a collection, the manager's listing and sweep) must
        refuse it at once: one that opens it waits, and the guard reports it."""
        kind = self.plan.planted
        if kind is None:
            return
        manifest = environment_dir(self.root / PLANTED_DIR) / "manifest.json"
        manifest.parent.mkdir(parents=True)
        fifo = manifest if kind == "fifo" else self.root / ".outside" / "target.fifo"
        fifo.parent.mkdir(exist_ok=True)
        os.mkfifo(fifo)
        self.world.fifos.append(str(fifo))
        if kind == "link":
            manifest.symlink_to(fifo)
        self.s.faults += 1
        self.log(f"fault: a {kind} planted as {manifest.relative_to(self.root)}")
        if self.plan.manager:
            # Case 8: a link named as a manager's partial snapshot, to another folder
            # holding RL's half and a record, which no sweep may remove through it.
            elsewhere = self.root / ".outside" / "elsewhere"
            elsewhere.mkdir(parents=True)
            for name in (RL_HALF, RECORD_FILE):
                (elsewhere / name).write_bytes(b"not the manager's")
            (self.root / PLANTED_LINK).symlink_to(elsewhere, target_is_directory=True)
            self.log(f"fault: a link planted as {PLANTED_LINK}")

    def unplant(self) -> None:
        """Before the final checks, which read every manifest outside the guard: what the
        link planted as a partial snapshot points at is all there."""
        elsewhere = self.root / ".outside" / "elsewhere"
        if elsewhere.exists():
            gone = [name for name in (RL_HALF, RECORD_FILE) if not (elsewhere / name).exists()]
            if gone:
                self.check.violate(f"a sweep removed {', '.join(gone)} through the link "
                                   f"planted as {PLANTED_LINK}, outside the root's folders")
        with contextlib.suppress(FileNotFoundError):
            (self.root / PLANTED_LINK).unlink()
        shutil.rmtree(self.root / PLANTED_DIR, ignore_errors=True)
        shutil.rmtree(self.root / ".outside", ignore_errors=True)

    async def _second_manager(self) -> None:
        """A second job's ``RolloutCheckpointManager`` on the same root (issue 50, case 7:
        two jobs, or a restarted job beside its predecessor) runs its retention now and
        then: its sweep must never take this job's snapshot in progress for a leftover
        (``Workload._managed_snapshot`` checks each returned snapshot has its record)."""
        actor = self.world.new_actor("manager2", "manager-2", "job2-host")
        actor.alive = True  # a host outside the Ray cluster
        runtime = self.world.runtime(actor)
        workload = self

        class Elsewhere:  # the second job's checkpoint: only its file work is used here
            run_blocking = staticmethod(runtime.run_blocking)

            def snapshot(self, *args: Any) -> Any:
                raise AssertionError("the second manager only runs its retention")

            restored = checkpoint = snapshot  # its barrier too

            def is_unavailable(self, error: BaseException) -> bool:
                return False

        class Half:
            async def save(self, cut: Any, path: str) -> None:
                raise AssertionError("the second manager takes no snapshot")

            restore = save

            async def remove(self, path: str) -> None:
                remove_rl_half(path)
                workload.log(f"manager 2 removes RL's half of {Path(path).name}")

        manager = RolloutCheckpointManager(
            Elsewhere(), Elsewhere(), Half(),
            RolloutCheckpointConfig(root=str(self.root), snapshot_attempt_interval_s=1.0,
                                    keep_latest_k=2),
            clock=runtime.clock.monotonic, on_event=self.on_managed_event)
        last = 0.0
        for at in self.plan.second_manager:
            await asyncio.sleep(at - last)
            last = at
            self.s.faults += 1
            try:
                removed = await manager.apply_retention()
            except (NemoCkptError, OSError) as exc:
                self.log(f"manager 2's retention: {type(exc).__name__}: {short(exc)}")
                continue
            self.log(f"manager 2's retention removed {[Path(p).name for p in removed]}")

    def swap(self, source: str) -> None:
        """The sandbox's own process acts on ``source`` as the scan is about to read it
        (``HostileSandbox``); never on ``state``, which the turns check."""
        path = Path(source)
        if path.name == "state" or self.rng.random() >= self.plan.hostile:
            return
        kind = self.rng.choice(["link", "link", "fifo", "change"])
        self.s.faults += 1
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
