"""What the benchmarks share: the local cluster, a benchmark job's config and its
sessions, the holders' processes and memory, the disk's own baselines, a snapshot and a
restore timed as a driver sees them, the coordinator's phase log lines, statistics, and
the reporting (tables, HOLDS/MISSED targets, the JSON results' run record)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import json
import logging
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import ray

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.interfaces import EnvironmentEpisode

T = TypeVar("T")
MiB = 1 << 20
_DISK_CHUNK = 4 * MiB  # the same chunk size the shard writer uses
# Opens in flight per holder while populating (asyncio.gather over Ray calls). More in
# flight is barely faster on a small machine, but leaves the holders' heaps larger: each
# call's buffers are freed into the allocator, not to the OS, and would count as the
# holder's memory.
POPULATE_IN_FLIGHT_PER_HOLDER = 64
_REPO = Path(__file__).resolve().parent.parent


# --- the cluster -------------------------------------------------------------------------


class LocalCluster:
    """A ``ray.cluster_utils.Cluster`` grown node by node; this process is its driver."""

    def __init__(self, object_store_bytes: int) -> None:
        from ray.cluster_utils import Cluster

        self._store = object_store_bytes
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False,
            "object_store_memory": object_store_bytes})
        try:
            ray.init(address=self.cluster.address, log_to_driver=False,
                     logging_level=logging.WARNING)
        except BaseException:
            self.cluster.shutdown()
            raise
        self.nodes = 1

    def grow_to(self, nodes: int) -> None:
        while self.nodes < nodes:
            self.cluster.add_node(num_cpus=1, object_store_memory=self._store)
            self.nodes += 1
        self.cluster.wait_for_nodes()
        deadline = time.monotonic() + 60
        while sum(1 for n in ray.nodes() if n.get("Alive")) < nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local cluster did not reach {nodes} nodes")
            time.sleep(0.2)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            ray.shutdown()
        self.cluster.shutdown()


# --- a benchmark job ------------------------------------------------------------------------


def bench_config(namespace: str, timeout_s: float) -> CheckpointConfig:
    """A benchmark job's config: snapshots without a cut, and leases and phase timeouts
    long enough that a slow shared machine times the work instead of failing it."""
    return CheckpointConfig(allow_unchecked_snapshots=True, namespace=namespace,
                            drain_timeout_s=5.0, lease_s=timeout_s,
                            phase_timeout_s=timeout_s, persist_timeout_s=1200.0)


async def populate(namespace: str, instances: Sequence[str], sessions: int,
                   state_bytes: int, seed: int) -> float:
    """Open ``sessions`` sessions round-robin over the holders; returns seconds taken.

    Each open is one ``SessionClient.open`` call (one Ray actor call); the driver keeps
    POPULATE_IN_FLIGHT_PER_HOLDER of them in flight per holder with asyncio.gather.
    (Opening from a task pinned on each node was no faster: the per-call work of Ray and
    the holders bounds it either way.)
    """
    rng = random.Random(seed)
    blob = rng.randbytes(state_bytes + 4096)
    clients = [await SessionClient.connect(instance_id=i, namespace=namespace)
               for i in instances]
    batch = POPULATE_IN_FLIGHT_PER_HOLDER * len(clients)
    start = time.perf_counter()
    for lo in range(0, sessions, batch):
        calls = []
        for k in range(lo, min(sessions, lo + batch)):
            off = (k * 7919) % 4096
            calls.append(clients[k % len(clients)].open(
                EnvironmentEpisode(f"rollout-{k:06d}", 0), blob[off:off + state_bytes]))
        await asyncio.gather(*calls)
    return time.perf_counter() - start


# --- processes and their memory ---------------------------------------------------------------


def psutil_module() -> Any:
    """psutil is not a dependency of the project: Ray vendors it (ray/thirdparty_files)
    and puts it on sys.path once ray is imported, so it is imported here, after ray."""
    import psutil

    return psutil


def actor_pid(namespace: str, name: str) -> int:
    """The OS pid of a named actor, from the GCS actor table.

    ``ray.util.state`` would need the dashboard, which the benchmark cluster does not
    start; the GCS table behind ``ray._private.state`` has the pid without it.
    """
    from ray._private import state as ray_state

    handle = ray.get_actor(name, namespace=namespace)
    entry = ray_state.actors(handle._actor_id.hex())
    pid = int(entry.get("Pid") or 0)
    if pid <= 0:
        raise RuntimeError(f"no pid for actor {name} in the GCS actor table: {entry}")
    return pid


def holder_pid(namespace: str, instance_id: str) -> int:
    return actor_pid(namespace, HOLDER_NAME_PREFIX + instance_id)


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The kB fields of /proc/<pid>/status we use, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def private_bytes(pid: int) -> int:
    """A process's private resident memory (RssAnon), in bytes."""
    return proc_status(pid).get("RssAnon", 0)


# --- disk baselines ----------------------------------------------------------------------------


def disk_write(path: Path, size: int, pool: bytes) -> float:
    """Write ``size`` bytes sequentially in 4 MiB chunks, fsync, close: seconds taken.

    The disk's own sequential, fsynced write throughput for a file of the same total size
    as a snapshot, in the same folder. The data (random, cycled from ``pool``) exists
    before the clock starts.
    """
    view = memoryview(pool)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        off = 0
        left = size
        while left > 0:
            n = min(left, _DISK_CHUNK, len(pool) - off)
            f.write(view[off:off + n])
            left -= n
            off = (off + n) % len(pool)
        os.fsync(f.fileno())
    return time.perf_counter() - start


def disk_read(path: Path) -> tuple[float, int]:
    """Read a whole file the way ``read_shard`` does (open, fstat, one read): seconds."""
    start = time.perf_counter()
    with open(path, "rb") as f:
        os.fstat(f.fileno())
        data = f.read()
    return time.perf_counter() - start, len(data)


def evict_from_page_cache(paths: Iterable[Path]) -> None:
    """Ask the kernel to drop these files' clean pages (POSIX_FADV_DONTNEED).

    Unprivileged and per file, unlike drop_caches; on a VM the host may still cache the
    blocks, so the next read is colder, not necessarily from the device.
    """
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- a snapshot and a restore, as a driver sees them ------------------------------------------


class GateProbe:
    """When each holder's turn gate opens again, seen by an environment worker.

    Inside the snapshot block (holders paused), one probe per holder calls
    ``SessionClient.open`` for a fresh episode: the holder makes it wait at the closed
    turn gate, so the call returns when that holder resumes. The paused time is then
    from calling ``snapshot()`` to the last holder's gate opening (plus one call's
    return), whatever order the runtime resumes and commits in. The probe sessions
    are opened after the capture, so no snapshot holds them; they are closed afterwards.
    """

    def __init__(self, clients: Sequence[SessionClient]) -> None:
        self._clients = list(clients)
        self._tasks: list[asyncio.Future[Any]] = []
        self._opened: list[float] = []
        self._episodes: list[EnvironmentEpisode] = []

    def start(self) -> None:
        for c in self._clients:
            ep = EnvironmentEpisode(f"probe-{uuid.uuid4().hex[:12]}", 0)
            self._episodes.append(ep)
            task = asyncio.ensure_future(c.open(ep, b""))
            task.add_done_callback(lambda _t: self._opened.append(time.perf_counter()))
            self._tasks.append(task)

    async def gates_open_at(self) -> float:
        """perf_counter time when the last holder's gate was seen open."""
        await asyncio.gather(*self._tasks)
        return max(self._opened)

    async def close(self) -> None:
        await asyncio.gather(*(c.close(ep)
                               for c, ep in zip(self._clients, self._episodes, strict=True)))


async def probed_snapshot(ckpt: RayEnvironmentCheckpoint, clients: Sequence[SessionClient],
                          path: Any, block_s: float = 0.0) -> tuple[Any, dict[str, float]]:
    """One snapshot into ``path`` whose caller's block sleeps ``block_s`` (0: it saves
    nothing), with a ``GateProbe``. Returns the snapshot and, in ms: ``entry`` (call ->
    yield), ``exit`` (end of the block -> return), ``entry_exit`` (call -> return) and
    ``paused`` (call -> the last holder's gate seen open)."""
    probe = GateProbe(clients)
    t0 = time.perf_counter()
    async with ckpt.snapshot(path) as snap:
        t1 = t_block = time.perf_counter()
        probe.start()
        if block_s:
            await asyncio.sleep(block_s)
            t_block = time.perf_counter()
    t2 = time.perf_counter()
    t_open = await probe.gates_open_at()
    await probe.close()
    return snap, {"entry_ms": (t1 - t0) * 1e3, "exit_ms": (t2 - t_block) * 1e3,
                  "entry_exit_ms": (t2 - t0) * 1e3, "paused_ms": (t_open - t0) * 1e3}


async def restore_once(config: CheckpointConfig, namespace: str, path: Path | str,
                       sessions: int, evict: bool) -> dict[str, float]:
    """Restore ``path`` as a restarted job would: into fresh holders (a new namespace,
    one holder per node, created before the clock starts), then kill them.

    With ``evict``, the shards are dropped from the page cache first (a folder only).
    A URL is passed as text, which ``restored()`` takes beside the contract's ``Path``.
    """
    ckpt_r = RayEnvironmentCheckpoint(config.model_copy(update={"namespace": namespace}))
    try:
        await ckpt_r.ensure_holders()
        if evict:
            evict_from_page_cache(sorted((Path(path) / "environment").glob("shard-*.msgpack")))
        t0 = time.perf_counter()
        async with ckpt_r.restored(path) as restored:  # type: ignore[arg-type]
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        figures = ckpt_r.last_restore_metrics
    finally:
        with contextlib.suppress(Exception):
            ckpt_r.shutdown()
    if len(restored.continued_attempts) != sessions:
        raise RuntimeError(f"restored {len(restored.continued_attempts)} sessions, expected "
                           f"{sessions}")
    assert figures is not None
    return {"restore_ms": (t2 - t0) * 1e3, "restore_prepare_ms": (t1 - t0) * 1e3,
            "restore_read_ms": figures["read_seconds"] * 1e3}


# --- the coordinator's phase log lines ----------------------------------------------------------

# Where and how the coordinator logs each phase of a snapshot or a restore (docs/METRICS.md,
# "Each phase of a snapshot or restore logs one structured line"): the only place the
# benchmarks name them.
PHASE_LOGGER = "nemo_ckpt.coordinator"
_PHASE_PREFIX = "nemo_ckpt "


class PhaseLog(logging.Handler):
    """The coordinator's phase lines logged in this process, decoded: ``operation``,
    ``phase``, ``seconds``, ``holders`` (each holder's seconds) and ``slowest``. Only a
    coordinator running in this process logs here; an actor's lines stay in its own."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []
        self._logger = logging.getLogger(PHASE_LOGGER)
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith(_PHASE_PREFIX + "{"):
            return
        line = json.loads(message[len(_PHASE_PREFIX):])
        if line.get("event") == "phase":
            self.lines.append(line)

    def __enter__(self) -> PhaseLog:
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)

    def of(self, operation: str) -> dict[str, dict[str, Any]]:
        """The lines of one operation, by phase."""
        return {line["phase"]: line for line in self.lines if line["operation"] == operation}


# --- statistics ----------------------------------------------------------------------------------


def median(values: Iterable[float | None]) -> float:
    """The median of the values that are numbers (NaN when there are none)."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(statistics.median(vals)) if vals else float("nan")


def summary(prefix: str, values: Sequence[float | None], digits: int = 2) -> dict[str, float]:
    """``<prefix>_min``, ``_median`` and ``_max`` of the values that are numbers."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {}
    return {f"{prefix}_min": round(min(vals), digits),
            f"{prefix}_median": round(statistics.median(vals), digits),
            f"{prefix}_max": round(max(vals), digits)}


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Element-wise a / b: ratios paired by repetition."""
    return [x / y for x, y in zip(a, b, strict=True)]


# --- reporting ------------------------------------------------------------------------------------


def format_table(header: Sequence[object], rows: Sequence[Sequence[object]],
                 indent: str = "") -> list[str]:
    """The header and rows as right-aligned columns, two spaces apart."""
    cells = [[str(c) for c in r] for r in (header, *rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return [indent + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
            for r in cells]


def target(name: str, point: str, value: Any, holds: bool, limit: str) -> dict[str, Any]:
    """One target of an issue, against the point it was measured at."""
    return {"target": name, "point": point, "value": value, "limit": limit,
            "holds": bool(holds)}


def verdict(holds: bool) -> str:
    return f"{'HOLDS' if holds else 'MISSED':6}"


def on_local_ray(run: Callable[[Path], Coroutine[Any, Any, T]], prefix: str) -> T:
    """``run(work)`` on an embedded Ray instance of its own (even where another cluster on
    this machine would be joined by default), in a scratch folder removed after."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    try:
        return asyncio.run(run(work))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def print_verdicts(results: Iterable[tuple[str, bool, str]]) -> None:
    """Each target as HOLDS or MISSED, with its detail below it."""
    for target, holds, detail in results:
        print(f"  {verdict(holds)} {target}")
        print(f"         {detail}")


def format_targets(targets: Iterable[dict[str, Any]]) -> str:
    lines = ["targets:"]
    lines += [f"  {verdict(t['holds'])} {t['target']:<45} {t['point']:<20} {t['value']} "
              f"(target {t['limit']})" for t in targets]
    return "\n".join(lines)


def run_record(module: str | None, started: float,
               load_before: tuple[float, float, float]) -> dict[str, Any]:
    """What a results file says of the run: the command, the machine and its load, and
    which runtime was measured."""
    command = [Path(sys.executable).name, *(["-m", module] if module else []), *sys.argv[1:]]
    return {
        "command": " ".join(command),
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "ray": ray.__version__, "platform": platform.platform(),
        "wall_seconds": round(time.perf_counter() - started, 1),
        # The machine is shared: its load says how noisy the numbers are.
        "loadavg_1_5_15_before": [round(x, 2) for x in load_before],
        "loadavg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
        "runtime_source": git_state(),
    }


def git_state() -> dict[str, Any]:
    """Which runtime was measured: the commit, and whether its code had local changes."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=_REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = git("status", "--porcelain", "--", "nemo_ckpt", "actors")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "runtime_changes_not_committed": changed.splitlines() if changed else []}


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
