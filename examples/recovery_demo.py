"""The end-to-end turn-level recovery run: the core of ``examples/turn_level_recovery.py``.

``run_demo`` needs a connected Ray cluster (``ray.init(address=...)``) and does, in order:

1. Crash run, first life: starts toy environment workers on every node, the session
   holders (``RayEnvironmentCheckpoint.check_startup``) and a reference data plane;
   dispatches every rollout; snapshots periodically in the order DESIGN.md gives
   (environment snapshot, data-plane cut, ``check_against_cut``, data-plane save).
2. Crash: after ``crash_after_snapshots`` committed snapshots that captured rollouts,
   half a snapshot period later, it kills the workers, the holders, the coordinator and
   the data plane, and drops every driver task, as a preemption would.
3. Crash run, second life: finds the newest committed snapshot, restores both halves
   (``ckpt.restored`` then the data plane's restore inside it), continues the restored
   rollouts on their instances, starts every other unfinished rollout over, and runs
   all to completion (snapshotting on).
4. Reference run: the same seed in a fresh namespace with a fresh data plane, in
   another dispatch order, without snapshots or a crash.
5. Compares the two runs' trajectories turn by turn (and with the toy's pure function),
   and, with sandboxes (the default), every rollout's final directory byte for byte.

With sandboxes, every rollout works in its own directory under a sandbox root made for
the run (a temporary folder, removed at the end); the crash takes the directories with
it, and the restore materializes each continued rollout's directory as its last
snapshotted turn left it.

A crash-run rollout goes through the ledger like RL's would: ``dispatch`` (ledger first),
the worker opens the session and runs its turns, then the driver hands its result to the
backend (``SessionClient.finish``), ``finish``es it in the data plane and
``acknowledge``s it in the backend, with no lock against snapshots
(``nemo_ckpt.receipts``): a snapshot between the hand-in and the acknowledgement holds
the result, and the restore hands it back to the data plane instead of running the
rollout again. The verdict requires that no finished rollout was lost or run twice.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, cast

import ray

from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.driver import RayEnvironmentCheckpoint
from nemo_ckpt.errors import NemoCkptError
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.sessions import SessionClient
from nemo_ckpt.storage.checkpoint_folder import environment_folder, folder_at
from nemo_ckpt.storage.location import (
    LocalLocation,
    as_path_or_url,
    base_name,
    join_location,
    parse_location,
)
from nemo_ckpt.storage.snapshot_files import read_manifest
from nemo_ckpt.testing.data_plane import (
    DATA_PLANE_FILE,
    DataPlaneBarrier,
    DataPlaneRestoreReport,
    DataPlaneStats,
    Trajectory,
    start_data_plane,
    trajectory_result,
)
from nemo_ckpt.testing.toy_env import (
    RolloutOutcome,
    RolloutTask,
    reference_trajectory,
    start_env_workers,
)
from nemo_ckpt.trees.blob_store import BLOB_DIR

__all__ = ["DemoOptions", "DemoProgress", "DemoReport", "DemoError", "run_demo",
           "latest_committed_snapshot", "format_report"]

log = logging.getLogger("nemo_ckpt.demo")

# A checkpoint location as the run hands it on: a folder's Path, or an s3:// URL's text.
Where = Path | str


class DemoError(NemoCkptError):
    """The demo could not run as asked (for example, it finished before the crash point)."""


@dataclass(frozen=True)
class DemoOptions:
    """What ``run_demo`` runs.

    Attributes:
        rollouts: How many rollouts.
        turns: Turns per rollout.
        snapshot_every_s: Seconds between the end of one snapshot and the next.
        crash_after_snapshots: Crash after this many committed snapshots that captured
            rollouts (at least 1), half a snapshot period later.
        checkpoint_dir: Each run writes its snapshots under ``<dir>/run-<time>-<id>/``:
            a folder every node mounts, or an ``s3://bucket/prefix`` URL (as text).
        seed: The toy environment's seed.
        workers_per_node: Environment worker actors per node.
        rollouts_per_worker: Rollouts each worker runs at once.
        turn_seconds: Simulated model and tool time per turn.
        namespace: Prefix of the Ray namespaces the run uses (made unique per run).
        drain_timeout_s: ``CheckpointConfig.drain_timeout_s`` of the run.
        dispatch_ahead: Each worker slot keeps its next rollout dispatched while it
            runs the current one, as an RL controller's queue does.
        node_ids: Nodes to run workers on; default every alive node.
        sandboxes: Give every rollout a sandbox directory its turns work in, and
            compare the directories too.
        trace_file: Where every process of the run appends its OpenTelemetry spans,
            one JSON line each (``CheckpointConfig.trace_file``).
    """

    rollouts: int = 48
    turns: int = 12
    snapshot_every_s: float = 1.0
    crash_after_snapshots: int = 3
    checkpoint_dir: Where = Path("demo-checkpoints")
    seed: int = 0
    workers_per_node: int = 1
    rollouts_per_worker: int = 4
    turn_seconds: float = 0.08
    namespace: str = "nemo-ckpt-demo"
    drain_timeout_s: float = 5.0
    dispatch_ahead: bool = True
    node_ids: Optional[tuple[str, ...]] = None
    sandboxes: bool = True
    trace_file: Optional[Path] = None

    def __post_init__(self) -> None:
        for name in ("rollouts", "turns", "crash_after_snapshots", "workers_per_node",
                     "rollouts_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.snapshot_every_s <= 0 or self.turn_seconds < 0:
            raise ValueError("snapshot_every_s must be positive and turn_seconds not negative")


@dataclass(frozen=True)
class DemoProgress:
    """A progress update for a live line."""

    phase: str
    elapsed_s: float
    turns_run: int
    finished: int
    rollouts: int
    snapshots: int
    last_pause_s: Optional[float]
    note: Optional[str] = None  # an event worth its own line (the crash, the restore)
    namespace: Optional[str] = None  # set once the run's holders are up, on that note


@dataclass(frozen=True)
class DemoReport:
    """What the run showed. ``verified`` is the verdict; see ``to_json`` for the fields."""

    verified: bool
    rollouts: int
    turns_per_rollout: int
    turns_total: int
    turns_restored: int
    turns_rerun: int
    turns_since_last_snapshot: int
    rollouts_restored: int
    rollouts_restarted: int
    rollouts_finished_at_snapshot: int
    results_handed_back: int  # of those, finished only in the backend at the cut
    rollouts_run_twice: tuple[str, ...]  # finished at the cut and run again: must be none
    orphan_rows_cleared: int
    snapshots: int
    pause_seconds_p50: float
    pause_seconds_max: float
    restored_from: str
    snapshot_paths: tuple[str, ...]
    mismatched_rollouts: tuple[str, ...]
    matches_pure_function: bool
    sandboxes: bool
    directories_compared: int
    mismatched_directories: tuple[str, ...]
    snapshot_bytes_written: tuple[int, ...]
    snapshot_new_blob_bytes: tuple[int, ...]
    nodes: int
    seed: int
    crash_run_seconds: float
    reference_run_seconds: float
    wall_seconds: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready map of every field."""
        data = asdict(self)
        data["snapshot_paths"] = list(self.snapshot_paths)
        data["mismatched_rollouts"] = list(self.mismatched_rollouts)
        data["rollouts_run_twice"] = list(self.rollouts_run_twice)
        data["mismatched_directories"] = list(self.mismatched_directories)
        data["snapshot_bytes_written"] = list(self.snapshot_bytes_written)
        data["snapshot_new_blob_bytes"] = list(self.snapshot_new_blob_bytes)
        return data


ProgressFn = Callable[[DemoProgress], None]


def _as_contract_path(where: Where) -> Path:
    # The contract types a checkpoint path as Path; a URL goes as its text (a Path would
    # collapse its "//"), which RayEnvironmentCheckpoint takes (nemo_ckpt.storage.location).
    return cast(Path, where)


def _child(where: Where, name: str) -> Where:
    return as_path_or_url(join_location(where, name))


def _snapshot_numbers(run_dir: Where) -> dict[int, str]:
    """The ``snapshot-NNNN`` folders under ``run_dir``, by number."""
    found = {}
    for name in folder_at(run_dir).subfolders():
        prefix, _, number = name.partition("-")
        if prefix == "snapshot" and number.isdigit():
            found[int(number)] = name
    return found


def latest_committed_snapshot(run_dir: Where) -> Where:
    """The newest ``snapshot-NNNN`` under ``run_dir`` (a folder or a URL) holding both
    halves: the environment's manifest (written last, the commit point) and the data
    plane's file."""
    found = _snapshot_numbers(run_dir)
    for number in sorted(found, reverse=True):
        path = _child(run_dir, found[number])
        if "manifest.json" in environment_folder(path).names() \
                and DATA_PLANE_FILE in folder_at(path).names():
            return path
    raise DemoError(f"no committed snapshot under {run_dir}; nothing to restore from")


def _next_snapshot_number(run_dir: Where) -> int:
    return max(_snapshot_numbers(run_dir), default=0) + 1


@dataclass
class _Item:
    rollout_id: str
    instance_id: Optional[str] = None  # set for a continued rollout
    episode: Optional[EnvironmentEpisode] = None


@dataclass
class _SnapshotTaken:
    path: Where
    pause_s: float
    captured: int
    rows_at_cut: int
    bytes_written: int = 0  # shards, trees files and new blobs
    new_blob_bytes: int = 0  # of those, the sandboxes' new files and trees


class _Job:
    """One driver life: dispatches rollouts over the workers, snapshots periodically."""

    def __init__(self, *, label: str, options: DemoOptions, ckpt: RayEnvironmentCheckpoint,
                 data_plane: Any, workers: dict[str, list[Any]], run_dir: Optional[Where],
                 progress: Optional[ProgressFn], first_snapshot: int = 1,
                 sandbox_root: Optional[Path] = None) -> None:
        self.label = label
        self.options = options
        self.ckpt = ckpt
        self.dp = data_plane
        self.barrier = DataPlaneBarrier(data_plane)
        self.workers = workers
        self.run_dir = run_dir  # None: no snapshots
        self.sandbox_root = sandbox_root
        self.progress = progress
        self._clients: dict[str, SessionClient] = {}  # the driver's, to hand results in
        self.snapshots: list[_SnapshotTaken] = []
        self.outcomes: dict[str, RolloutOutcome] = {}
        self.captured_snapshots = 0
        self.snapshot_taken = asyncio.Event()
        self.done = asyncio.Event()
        self.failed: Optional[BaseException] = None
        self.crashing = False
        self._next_snapshot = first_snapshot
        self._fresh: collections.deque[_Item] = collections.deque()
        self._continued: dict[str, collections.deque[_Item]] = {}
        self._instance_node: dict[str, str] = {}
        self._active: collections.Counter[str] = collections.Counter()
        self._remaining = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self.started = time.monotonic()

    async def start(self, continued: Sequence[tuple[str, EnvironmentEpisode]],
                    fresh: Sequence[str]) -> None:
        """Start running ``continued`` (on their instances) and ``fresh`` rollouts."""
        self._instance_node = {h.instance_id: h.node_id for h in await self.ckpt.holders()}
        for instance_id, ep in continued:
            node = self._instance_node.get(instance_id, "")
            self._continued.setdefault(node, collections.deque()).append(
                _Item(ep.rollout_id, instance_id, ep))
        self._fresh.extend(_Item(r) for r in fresh)
        self._remaining = len(continued) + len(fresh)
        self.started = time.monotonic()
        if self._remaining == 0:
            self.done.set()
        for node, handles in self.workers.items():
            for worker in handles:
                for _ in range(self.options.rollouts_per_worker):
                    self._spawn(self._runner(worker, node))
        if self.run_dir is not None:
            self._spawn(self._snapshot_loop())
        if self.progress is not None:
            self._spawn(self._progress_loop())

    async def wait(self) -> None:
        """Until every rollout finished; re-raises the first failure."""
        done = asyncio.ensure_future(self.done.wait())
        try:
            while not done.done():
                await asyncio.wait({done}, timeout=0.2)
                if self.failed is not None:
                    raise self.failed
        finally:
            done.cancel()
        if self.failed is not None:
            raise self.failed

    async def wait_for_crash_point(self, snapshots: int) -> None:
        """Until ``snapshots`` committed snapshots captured rollouts, then half a period.

        The half period ends early when every rollout finished.
        """
        while self.captured_snapshots < snapshots:
            if self.done.is_set():
                raise DemoError(
                    f"every rollout finished after {self.captured_snapshots} snapshot(s), "
                    f"before the crash point ({snapshots}); run more rollouts or turns, or "
                    f"snapshot more often")
            if self.failed is not None:
                raise self.failed
            self.snapshot_taken.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.snapshot_taken.wait(), 0.2)
        # Rollouts finishing meanwhile (a slow or loaded machine) do not spoil the crash:
        # the last snapshot holds them mid-rollout, so the restore still continues them.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.done.wait(), self.options.snapshot_every_s / 2)

    async def crash(self) -> DataPlaneStats:
        """Kill workers, holders, coordinator and data plane; drop every driver task.

        Returns the data plane's counts just before it died (workers already dead, so
        no turn runs after them).
        """
        self.crashing = True
        for handles in self.workers.values():
            for worker in handles:
                ray.kill(worker, no_restart=True)
        stats: DataPlaneStats = await self.dp.stats.remote()
        self.ckpt.shutdown()
        ray.kill(self.dp, no_restart=True)
        await self.stop()
        return stats

    async def stop(self) -> None:
        """Cancel every task of this job and wait for them."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def snapshot(self) -> _SnapshotTaken:
        """One snapshot, in DESIGN.md's order; finishes run beside it, without a lock."""
        assert self.run_dir is not None
        path = _child(self.run_dir, f"snapshot-{self._next_snapshot:04d}")
        self._next_snapshot += 1
        started = time.monotonic()
        async with self.ckpt.snapshot(_as_contract_path(path)) as snap:
            async with self.barrier.checkpoint() as cut:
                if snap is not None:
                    await snap.check_against_cut(cut)
                await self.barrier.save(cut, path)
                rows_at_cut = cut.rows_written
        taken = _SnapshotTaken(path, time.monotonic() - started,
                               snap.captured_rollouts if snap is not None else 0,
                               rows_at_cut)
        if snap is not None:
            manifest = read_manifest(path)
            taken.bytes_written = int(manifest.metrics.get("bytes_written", 0))
            taken.new_blob_bytes = sum(s.trees.new_blob_bytes for s in manifest.shards
                                       if s.trees is not None)
        self.snapshots.append(taken)
        if taken.captured:
            self.captured_snapshots += 1
        self.snapshot_taken.set()
        return taken

    # --- tasks ----------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or self.crashing:
            return
        exc = task.exception()
        if exc is not None and self.failed is None:
            self.failed = exc

    def _next(self, node: str) -> Optional[_Item]:
        # A continued rollout goes back to its instance: prefer this node's own.
        own = self._continued.get(node)
        if own:
            return own.popleft()
        if self._fresh:
            return self._fresh.popleft()
        for queue in self._continued.values():
            if queue:
                return queue.popleft()
        return None

    def _pick_instance(self, node: str) -> str:
        here = [i for i, n in self._instance_node.items() if n == node]
        pool = here or list(self._instance_node)
        return min(pool, key=lambda i: (self._active[i], i))

    async def _claim(self, node: str) -> Optional[tuple[str, EnvironmentEpisode, bool]]:
        """The next rollout for a runner on ``node``: ``(instance, episode, fresh)``."""
        item = self._next(node)
        if item is None:
            return None
        if item.episode is not None:
            assert item.instance_id is not None
            self._active[item.instance_id] += 1
            return item.instance_id, item.episode, False
        instance_id = self._pick_instance(node)
        self._active[instance_id] += 1
        # The ledger records the dispatch before the environment opens the session.
        episode: EnvironmentEpisode = await self.dp.dispatch.remote(item.rollout_id,
                                                                    instance_id)
        return instance_id, episode, True

    async def _runner(self, worker: Any, node: str) -> None:
        pending = await self._claim(node)
        while pending is not None:
            instance_id, episode, fresh = pending
            task = RolloutTask(episode=episode, instance_id=instance_id,
                               namespace=self.ckpt.config.namespace,
                               seed=self.options.seed, turns=self.options.turns, fresh=fresh,
                               sandbox_root=None if self.sandbox_root is None
                               else str(self.sandbox_root))
            running = asyncio.ensure_future(_awaited(worker.run_rollout.remote(task, self.dp)))
            # Like RL's controller, keep the next rollout dispatched and queued for this
            # slot: a snapshot then finds it expected but not held (it restarts, losing
            # no turn), the case the cut check counts as not held.
            pending = await self._claim(node) if self.options.dispatch_ahead else None
            outcome: RolloutOutcome = await running
            self.outcomes[episode.rollout_id] = outcome
            records = outcome.decoded_records()
            # The result goes to the backend first, then RL records it, then the backend
            # lets go: a snapshot anywhere in between holds it (nemo_ckpt.receipts).
            client = await self._client(instance_id)
            await client.finish(episode, trajectory_result(records, outcome.staging_keys))
            await self.dp.finish.remote(episode, records, list(outcome.staging_keys))
            await self.ckpt.acknowledge([episode])
            self._active[instance_id] -= 1
            self._remaining -= 1
            if self._remaining == 0:
                self.done.set()
            if pending is None:
                pending = await self._claim(node)

    async def _client(self, instance_id: str) -> SessionClient:
        if instance_id not in self._clients:
            self._clients[instance_id] = await SessionClient.connect(
                instance_id=instance_id, namespace=self.ckpt.config.namespace)
        return self._clients[instance_id]

    async def _snapshot_loop(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.done.wait(), self.options.snapshot_every_s)
            if self.done.is_set():
                return
            try:
                await self.snapshot()
            except Exception as exc:
                if not self.ckpt.is_unavailable(exc):
                    raise
                log.warning("%s: snapshot skipped, backend briefly unavailable: %s",
                            self.label, exc)

    async def report_progress(self) -> None:
        """Send one progress update (if a progress callback was given)."""
        if self.progress is None:
            return
        stats: DataPlaneStats = await self.dp.stats.remote()
        self.progress(DemoProgress(
            phase=self.label, elapsed_s=time.monotonic() - self.started,
            turns_run=stats.rows_written, finished=stats.finished,
            rollouts=self.options.rollouts, snapshots=len(self.snapshots),
            last_pause_s=self.snapshots[-1].pause_s if self.snapshots else None))

    async def _progress_loop(self) -> None:
        while not self.done.is_set():
            await self.report_progress()
            await asyncio.sleep(0.25)


# --- the run ------------------------------------------------------------------------------


def _note(progress: Optional[ProgressFn], phase: str, stats: DataPlaneStats,
          options: DemoOptions, job: _Job, text: str) -> None:
    if progress is not None:
        progress(DemoProgress(
            phase=phase, elapsed_s=time.monotonic() - job.started,
            turns_run=stats.rows_written, finished=stats.finished,
            rollouts=options.rollouts, snapshots=len(job.snapshots),
            last_pause_s=None, note=text))


async def _awaited(ref: Any) -> Any:
    return await ref


def _alive_nodes() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


async def _ready(workers: dict[str, list[Any]]) -> None:
    await asyncio.gather(*(w.node_id.remote() for ws in workers.values() for w in ws))


async def _wait_names_gone(namespace: str, timeout_s: float = 30.0) -> None:
    """Until the killed holders and coordinator have released their names, so the next
    life's ``get_if_exists`` creates new actors instead of finding dead ones."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a.get("namespace") == namespace]
        if not left:
            return
        if time.monotonic() > deadline:
            raise DemoError(f"actors {left} of namespace {namespace} did not die within "
                            f"{timeout_s:.0f}s")
        await asyncio.sleep(0.1)


def _checkpoint_config(namespace: str, root: Optional[Where], options: DemoOptions,
                       sandbox_root: Optional[Path] = None) -> CheckpointConfig:
    return CheckpointConfig(namespace=namespace, checkpoint_root=root,
                            drain_timeout_s=options.drain_timeout_s,
                            sandbox_root=sandbox_root, trace_file=options.trace_file)


def _kill_quietly(handles: Iterable[Any]) -> None:
    for h in handles:
        with contextlib.suppress(Exception):
            ray.kill(h, no_restart=True)


def _shutdown_namespace(namespace: str) -> None:
    # The namespace is this run's own: everything named in it is ours.
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a.get("namespace") == namespace:
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(a["name"], namespace=namespace))


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, deepest first."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    return missing


def _remove_run_folders(created: list[Path]) -> None:
    """Remove a failed run's folder and the empty parents the run created."""
    if created:
        shutil.rmtree(created[0], ignore_errors=True)
    for folder in created[1:]:
        with contextlib.suppress(OSError):  # not empty: something else uses it
            folder.rmdir()


def _remove_run_objects(run_dir: str) -> None:
    """Remove what a failed run wrote under its prefix in a bucket: each snapshot's
    data-plane file and environment objects (a prefix goes with its last object)."""
    try:
        for name in _snapshot_numbers(run_dir).values():
            snapshot = _child(run_dir, name)
            for folder in (environment_folder(snapshot), folder_at(snapshot)):
                folder.remove(folder.names())
        blobs = folder_at(join_location(run_dir, BLOB_DIR))
        for prefix in blobs.subfolders():
            fan = folder_at(join_location(run_dir, BLOB_DIR, prefix))
            fan.remove(fan.names())
        blobs.remove(blobs.names())
    except (OSError, NemoCkptError) as exc:
        log.warning("could not remove the failed run's objects under %s: %s", run_dir, exc)


async def run_demo(options: DemoOptions, progress: Optional[ProgressFn] = None) -> DemoReport:
    """Run the crash run and the reference run, compare them, and report (module doc).

    Needs ``ray.init`` done. Leaves the crash run's committed snapshots under
    ``options.checkpoint_dir``; every actor it started is gone when it returns. A run
    that raises leaves no folder behind: its run folder goes, and so do the parents it
    created.
    """
    if not ray.is_initialized():
        raise DemoError("connect to a Ray cluster first (ray.init(address=...))")
    stamp = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    location = parse_location(options.checkpoint_dir)
    run_dir: Where
    if isinstance(location, LocalLocation):
        run_dir = location.path.resolve() / f"run-{stamp}"
        created = _missing_folders(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        clean_up: Callable[[], None] = lambda: _remove_run_folders(created)  # noqa: E731
    else:  # a prefix exists once written to: nothing to create
        run_dir = url = join_location(str(location), f"run-{stamp}")
        clean_up = lambda: _remove_run_objects(url)  # noqa: E731
    sandbox_root = Path(tempfile.mkdtemp(prefix=f"nemo-ckpt-demo-{stamp}-")) / "sandboxes" \
        if options.sandboxes else None
    try:
        return await _run(options, progress, run_dir, stamp, sandbox_root)
    except BaseException:
        clean_up()
        raise
    finally:
        if sandbox_root is not None:
            shutil.rmtree(sandbox_root.parent, ignore_errors=True)


async def _run(options: DemoOptions, progress: Optional[ProgressFn], run_dir: Where,
               stamp: str, sandbox_root: Optional[Path]) -> DemoReport:
    wall = time.monotonic()
    nodes = list(options.node_ids) if options.node_ids else _alive_nodes()
    namespace = f"{options.namespace}-{stamp}"
    ref_namespace = f"{namespace}-reference"
    rollout_ids = [f"r{i:04d}" for i in range(options.rollouts)]
    actors: list[Any] = []  # every worker and data plane started, for the finally

    def workers_for_run() -> dict[str, list[Any]]:
        ws = start_env_workers(nodes, options.workers_per_node, options.turn_seconds)
        actors.extend(w for handles in ws.values() for w in handles)
        return ws

    def data_plane() -> Any:
        dp = start_data_plane()
        actors.append(dp)
        return dp

    try:
        # 1. Crash run, first life.
        ckpt = RayEnvironmentCheckpoint(
            _checkpoint_config(namespace, run_dir, options, sandbox_root))
        workers = workers_for_run()
        dp = data_plane()
        await asyncio.gather(ckpt.check_startup(), _ready(workers))
        if progress is not None:
            holders = len(await ckpt.holders())
            progress(DemoProgress(
                phase="holders", elapsed_s=0.0, turns_run=0, finished=0,
                rollouts=options.rollouts, snapshots=0, last_pause_s=None,
                note=f"{holders} session holders up in Ray namespace {namespace}",
                namespace=namespace))
        crash_started = time.monotonic()
        if sandbox_root is not None:
            sandbox_root.mkdir(parents=True, exist_ok=True)
        first = _Job(label="crash run", options=options, ckpt=ckpt, data_plane=dp,
                     workers=workers, run_dir=run_dir, progress=progress,
                     sandbox_root=sandbox_root)
        await first.start(continued=(), fresh=rollout_ids)
        try:
            await first.wait_for_crash_point(options.crash_after_snapshots)
        except BaseException:
            await first.stop()
            raise

        # 2. Crash.
        at_crash = await first.crash()
        await _wait_names_gone(namespace)
        _note(progress, "crash", at_crash, options, first,
              f"CRASH: killed {sum(map(len, workers.values()))} workers, the session "
              f"holders, the coordinator and the data plane")

        if sandbox_root is not None:  # the crash took the nodes' disks with it
            shutil.rmtree(sandbox_root)
            sandbox_root.mkdir()

        # 3. Crash run, second life: restore both halves, then run everything to the end.
        path = latest_committed_snapshot(run_dir)
        ckpt = RayEnvironmentCheckpoint(
            _checkpoint_config(namespace, run_dir, options, sandbox_root))
        workers = workers_for_run()
        dp = data_plane()
        barrier = DataPlaneBarrier(dp)
        async with ckpt.restored(_as_contract_path(path)) as restored:
            report: DataPlaneRestoreReport = await barrier.restore(
                path, restored, ckpt.restored_results)
        # The data plane recorded the results the backend kept: the backend lets go.
        await ckpt.acknowledge([r.episode for r in ckpt.restored_results])
        await _ready(workers)
        _note(progress, "restore", await dp.stats.remote(), options, first,
              f"restored {base_name(path)}: {len(report.continued)} rollouts continue "
              f"mid-rollout, {len(report.restarted)} start over, {len(report.finished)} "
              f"were finished and {len(report.recorded)} handed back finished, "
              f"{report.orphans_cleared} orphan rows cleared")
        continued_ids = {ep.rollout_id for _, ep in report.continued}
        finished = set(report.finished) | set(report.recorded)
        fresh = [r for r in rollout_ids if r not in finished and r not in continued_ids]
        second = _Job(label="after restore", options=options, ckpt=ckpt, data_plane=dp,
                      workers=workers, run_dir=run_dir, progress=progress,
                      first_snapshot=_next_snapshot_number(run_dir),
                      sandbox_root=sandbox_root)
        await second.start(continued=report.continued, fresh=fresh)
        try:
            await second.wait()
            await second.report_progress()
        finally:
            await second.stop()
        end_stats: DataPlaneStats = await dp.stats.remote()
        crash_trajectories: dict[str, Trajectory] = await dp.trajectories.remote()
        crash_seconds = time.monotonic() - crash_started
        ckpt.shutdown()

        # 4. Reference run: same seed, no crash, no snapshots, another order.
        ref_started = time.monotonic()
        # Its sandboxes need a blob store's root like any job's; it never snapshots.
        ref_ckpt = RayEnvironmentCheckpoint(_checkpoint_config(
            ref_namespace, run_dir if sandbox_root is not None else None, options,
            sandbox_root))
        await ref_ckpt.ensure_holders()
        ref_dp = data_plane()
        reference = _Job(label="reference run", options=options, ckpt=ref_ckpt,
                         data_plane=ref_dp, workers=workers, run_dir=None, progress=progress,
                         sandbox_root=sandbox_root)
        await reference.start(continued=(), fresh=list(reversed(rollout_ids)))
        try:
            await reference.wait()
            await reference.report_progress()
        finally:
            await reference.stop()
        ref_trajectories: dict[str, Trajectory] = await ref_dp.trajectories.remote()
        ref_seconds = time.monotonic() - ref_started
        ref_ckpt.shutdown()
    finally:
        _kill_quietly(actors)
        _shutdown_namespace(namespace)
        _shutdown_namespace(ref_namespace)

    # 5. Compare.
    mismatched = tuple(r for r in rollout_ids
                       if r not in crash_trajectories or r not in ref_trajectories
                       or crash_trajectories[r].steps != ref_trajectories[r].steps)
    pure = all(r in ref_trajectories and ref_trajectories[r].steps
               == reference_trajectory(options.seed, r, options.turns) for r in rollout_ids)
    # The crash run's final directories: of the rollouts that finished in its first life
    # and were not run again, and of everything the second life ran.
    crash_outcomes = {**first.outcomes, **second.outcomes}
    compared = [r for r in rollout_ids if options.sandboxes]
    bad_directories = tuple(
        r for r in compared
        if r not in crash_outcomes or r not in reference.outcomes
        or crash_outcomes[r].directory is None
        or crash_outcomes[r].directory != reference.outcomes[r].directory)
    turns_total = options.rollouts * options.turns
    turns_run_after = end_stats.rows_written - report.rows_written_at_cut
    snapshots = first.snapshots + second.snapshots
    pauses = [s.pause_s for s in snapshots]
    restored_turns = sum(o.turns_at_start for r, o in second.outcomes.items()
                         if r in continued_ids)
    # The oracle of finished rollouts: none lost (every one has its trajectory, checked
    # above), none that was finished at the cut run again after the restore.
    run_twice = tuple(sorted(finished & set(second.outcomes)))
    return DemoReport(
        verified=not mismatched and not bad_directories and not run_twice
        and len(crash_trajectories) == options.rollouts,
        rollouts=options.rollouts,
        turns_per_rollout=options.turns,
        turns_total=turns_total,
        turns_restored=restored_turns,
        # Every turn writes one staging row: rows written in both lives, minus the
        # turns the rollouts need, is the work the crash cost.
        turns_rerun=at_crash.rows_written + turns_run_after - turns_total,
        turns_since_last_snapshot=at_crash.rows_written - report.rows_written_at_cut,
        rollouts_restored=len(report.continued),
        rollouts_restarted=len(report.restarted),
        rollouts_finished_at_snapshot=len(finished),
        results_handed_back=len(report.recorded),
        rollouts_run_twice=run_twice,
        orphan_rows_cleared=report.orphans_cleared,
        snapshots=len(snapshots),
        pause_seconds_p50=statistics.median(pauses) if pauses else 0.0,
        pause_seconds_max=max(pauses, default=0.0),
        restored_from=str(path),
        snapshot_paths=tuple(str(s.path) for s in snapshots),
        mismatched_rollouts=mismatched,
        matches_pure_function=pure,
        sandboxes=options.sandboxes,
        directories_compared=len(compared),
        mismatched_directories=bad_directories,
        snapshot_bytes_written=tuple(s.bytes_written for s in snapshots),
        # Of the snapshots that captured rollouts: one taken before any session opened
        # holds nothing, so writes nothing.
        snapshot_new_blob_bytes=tuple(s.new_blob_bytes for s in snapshots if s.captured),
        nodes=len(nodes),
        seed=options.seed,
        crash_run_seconds=crash_seconds,
        reference_run_seconds=ref_seconds,
        wall_seconds=time.monotonic() - wall,
    )


def _bytes_line(report: DemoReport) -> str:
    written = report.snapshot_bytes_written
    line = f"median {_kib(statistics.median(written))}, max {_kib(max(written))}"
    if report.sandboxes:
        line += (f" (sandbox blobs: first {_kib(report.snapshot_new_blob_bytes[0])}, then "
                 f"median {_kib(statistics.median(report.snapshot_new_blob_bytes[1:] or [0]))})")
    return line


def _kib(n: float) -> str:
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n:.0f} B"


def format_report(report: DemoReport) -> str:
    """The short table the example prints."""
    rows = [
        ("verified", "yes" if report.verified else "NO"),
        ("rollouts", f"{report.rollouts} x {report.turns_per_rollout} turns"),
        ("turns", str(report.turns_total)),
        ("turns restored", f"{report.turns_restored} (in {report.rollouts_restored} "
                           f"rollouts continued mid-run)"),
        ("turns re-run after crash", f"{report.turns_rerun} (run since the last snapshot: "
                                     f"{report.turns_since_last_snapshot})"),
        ("rollouts restarted", f"{report.rollouts_restarted} (dispatched, no session "
                               f"captured: started over from turn 0)"),
        ("rollouts kept finished", f"{report.rollouts_finished_at_snapshot} ("
                                   f"{report.results_handed_back} handed back by the "
                                   f"backend; run twice: "
                                   f"{len(report.rollouts_run_twice)})"),
        ("snapshots", str(report.snapshots)),
        *([("directories", f"{report.directories_compared} compared byte for byte, "
                           f"{len(report.mismatched_directories)} differ")]
          if report.sandboxes else []),
        *([("bytes per snapshot", _bytes_line(report))] if report.snapshot_bytes_written
          else []),
        ("snapshot pause p50", f"{report.pause_seconds_p50 * 1000:.0f} ms"),
        ("snapshot pause max", f"{report.pause_seconds_max * 1000:.0f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)

