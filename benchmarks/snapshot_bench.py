#!/usr/bin/env python3
"""Snapshot and restore benchmark of nemo-ckpt on a local multi-node Ray cluster (issue 6).

For every point of the grid (holders x sessions x state bytes per session) it starts a
fresh set of session holders, one per simulated node of a ``ray.cluster_utils.Cluster``
(head plus workers, each its own raylet), fills them with sessions, and measures, each
repeated and reported as min / median / max:

- the snapshot as a driver sees it: ``entry`` (``snapshot()`` called -> snapshot
  yielded: pause, drain with nothing in flight, capture), ``exit`` (caller saves
  nothing -> persist, commit, resume), and ``paused``, until the last holder's turn
  gate is seen open again by a probe session;
- the write throughput of the snapshot's persist against the disk's own sequential,
  fsynced write throughput, measured in the same run, in the same folder;
- restore (into fresh holders, the shards evicted from the page cache as after a crash)
  against the disk's read throughput, measured the same way restore reads (a whole file
  of the same size, evicted too); the page-cache-warm figures besides;
- a single-writer baseline: pause every holder, pull every session to one process
  (the driver, beside the coordinator), write them to one msgpack file the way a shard
  is written (content hash while writing, temp file, fsync, rename), resume;
- a holder's peak memory during a snapshot over its sessions' size;
- persistence overlap: the whole snapshot (call to the end of the ``async with``) of a
  caller that sleeps for as long as the persist takes, against one that saves nothing.
  (The pause itself now lasts until the context exits, so it holds the caller's save by
  definition, and the persist is never on it.)

A second table gives the turns a crash at a random point costs, with snapshots every K
turn-times and without turn-level recovery (seeded Monte Carlo plus the closed form).

    python -m benchmarks.snapshot_bench --json bench-results.json           # full grid
    python -m benchmarks.snapshot_bench --quick --json bench-results.json   # two points

See benchmarks/README.md for the definitions, the results and their analysis.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

import msgpack
import ray

from benchmarks.common import (
    LocalCluster,
    MiB,
    bench_config,
    disk_read,
    disk_write,
    evict_from_page_cache,
    format_table,
    format_targets,
    holder_pid,
    median,
    populate,
    probed_snapshot,
    proc_status,
    psutil_module,
    ratios,
    restore_once,
    run_record,
    summary,
    target,
    write_json,
)
from benchmarks.fanout import fanout_targets, format_fanout, run_fanout
from benchmarks.object_store import format_object_store, object_store_targets, run_object_store
from benchmarks.scale import format_scale, run_scale, scale_targets
from nemo_ckpt import RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.storage.hashed_files import write_hashed as _write_durably
from nemo_ckpt.storage.shards import SHARD_MAGIC, SHARD_VERSION

log = logging.getLogger("benchmarks.snapshot_bench")

QUICK_POINTS = ((4, 10_000, 1024), (4, 1_000, 64 * 1024))
FULL_HOLDERS = (1, 2, 4)
FULL_SESSIONS = (1_000, 10_000)
FULL_STATE_BYTES = (1024, 64 * 1024)


# --- holder processes' peak memory ----------------------------------------------------------


class PeakRss:
    """Peak resident memory of some processes over a window.

    Uses the kernel's own high-water mark (VmHWM, reset by writing 5 to
    /proc/<pid>/clear_refs), so no short peak is missed; where that reset is not
    allowed it falls back to sampling RSS with psutil every millisecond.
    """

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.method = "VmHWM"
        self._peaks = {p: 0 for p in self.pids}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        try:
            for pid in self.pids:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")
        except OSError:
            self.method = "psutil sampling (1 ms)"
            psutil = psutil_module()
            procs = {p: psutil.Process(p) for p in self.pids}

            def sample() -> None:
                while not self._stop.is_set():
                    for pid, proc in procs.items():
                        with contextlib.suppress(psutil.Error):
                            self._peaks[pid] = max(self._peaks[pid], proc.memory_info().rss)
                    time.sleep(0.001)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            for pid in self.pids:
                self._peaks[pid] = proc_status(pid)["VmHWM"]

    def peak(self, pid: int) -> int:
        return self._peaks[pid]


# --- the single-writer baseline -------------------------------------------------------------


def write_single_file(directory: Path, name: str, records: Iterable[Any]) -> int:
    """Write every session into one msgpack file, exactly as a shard is written (same
    format, content hash while writing, temp file, fsync, rename, folder fsync); the only
    difference from ``write_shard`` is that the file mixes instances."""

    def fill(w: Any) -> None:
        packer = msgpack.Packer(use_bin_type=True)
        w.write(packer.pack({"format": SHARD_MAGIC, "version": SHARD_VERSION,
                             "instance_id": "all"}))
        for record in records:
            w.write(packer.pack(record.to_wire()))

    length, _ = _write_durably(directory, name, fill)
    return length


async def single_writer_snapshot(namespace: str, instances: Sequence[str], directory: Path,
                                 drain_s: float, lease_s: float) -> dict[str, float]:
    """Pause every holder, gather all sessions in this process, write one file, resume."""
    handles = [ray.get_actor(HOLDER_NAME_PREFIX + i, namespace=namespace) for i in instances]
    op = f"snap-baseline-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    await asyncio.gather(*(h.pause.remote(op, drain_s, lease_s) for h in handles))
    t_paused = time.perf_counter()
    try:
        per_holder = await asyncio.gather(*(h.sessions.remote() for h in handles))
        t_gathered = time.perf_counter()
        records = [r for rs in per_holder for r in rs]
        written = await asyncio.to_thread(write_single_file, directory,
                                          f"baseline-{op}.msgpack", records)
        t_written = time.perf_counter()
    finally:
        await asyncio.gather(*(h.resume.remote(op) for h in handles))
    t1 = time.perf_counter()
    del records, per_holder
    return {"paused_ms": (t1 - t0) * 1e3, "pause_ms": (t_paused - t0) * 1e3,
            "gather_ms": (t_gathered - t_paused) * 1e3,
            "write_ms": (t_written - t_gathered) * 1e3, "bytes": float(written)}


# --- one grid point ---------------------------------------------------------------------------


async def measure_point(holders: int, sessions: int, state_bytes: int, repeats: int,
                        workdir: Path, cold_reads: bool, seed: int,
                        pool: bytes) -> dict[str, Any]:
    """Every measurement of one grid point, on a cluster that has ``holders`` nodes."""
    tag = uuid.uuid4().hex[:8]
    ns = f"bench-{tag}"
    config = bench_config(ns, 120.0)
    ckpt = RayEnvironmentCheckpoint(config)
    point_dir = workdir / f"h{holders}-s{sessions}-b{state_bytes}-{tag}"
    point_dir.mkdir(parents=True)
    try:
        infos = await ckpt.ensure_holders()
        instances = [i.instance_id for i in infos]
        if len(instances) != holders or len({i.node_id for i in infos}) != holders:
            raise RuntimeError(f"expected {holders} holders on {holders} nodes, got "
                               f"{[(i.instance_id, i.node_id[:8]) for i in infos]}")
        pids = {i: holder_pid(ns, i) for i in instances}

        # Warm-up, not measured: an empty snapshot exercises every phase (actor methods,
        # thread pools, the manifest) before the holders fill.
        warm = point_dir / "warmup"
        async with ckpt.snapshot(warm):
            pass
        shutil.rmtree(warm, ignore_errors=True)

        rss_before_population = {i: psutil_module().Process(p).memory_info().rss
                                 for i, p in pids.items()}
        populate_s = await populate(ns, instances, sessions, state_bytes, seed)
        held = {i.instance_id: i.sessions for i in await ckpt.holders()}
        if sum(held.values()) != sessions:
            raise RuntimeError(f"populated {sum(held.values())} sessions, expected {sessions}")
        # The sessions' size: the state bytes each holder holds (no turns are opened).
        size_of = {i: held[i] * state_bytes for i in instances}
        rss_after_population = {i: psutil_module().Process(p).memory_info().rss
                                for i, p in pids.items()}
        log.info("  populated %d sessions x %d B over %d holders in %.1f s (%.0f opens/s)",
                 sessions, state_bytes, holders, populate_s, sessions / populate_s)

        clients = [await SessionClient.connect(instance_id=i, namespace=ns)
                   for i in instances]
        # One unmeasured snapshot with the data: warms the write path and gives the
        # snapshot's byte size for the disk baseline written before the first one.
        async with ckpt.snapshot(point_dir / "warmup-data") as snap:
            pass
        assert snap is not None
        size = int(snap.metrics(0.0)["bytes_written"])
        # The overlapped caller sleeps for the median persist of the measured snapshots so
        # far at this point (repetition 0 runs its plain snapshot first). Not the warm-up:
        # its persist, into fresh files, ran up to 2x longer, and a sleep longer than the
        # persist measures the sleep, not the overlap.
        persists_s: list[float] = []
        shutil.rmtree(point_dir / "warmup-data", ignore_errors=True)

        async def plain(rep: dict[str, Any], path: Path) -> None:
            """A snapshot whose caller saves nothing, with the holders' peak memory."""
            rss_before_snapshot = {i: proc_status(p)["VmRSS"] for i, p in pids.items()}
            shmem = max(proc_status(p).get("RssShmem", 0) for p in pids.values())
            with PeakRss(list(pids.values())) as peak:
                snap, times = await probed_snapshot(ckpt, clients, path)
            assert snap is not None and snap.captured_rollouts == sessions
            m = snap.metrics(times["entry_exit_ms"] / 1e3)
            persists_s.append(m["persist_seconds"])
            rep.update(
                **times,
                coord_entry_ms=m["entry_seconds"] * 1e3, drain_ms=m["drain_seconds"] * 1e3,
                capture_ms=m["capture_seconds"] * 1e3,
                persist_ms=m["persist_seconds"] * 1e3, bytes_written=m["bytes_written"],
                peak_ratio=max((peak.peak(pids[i]) - rss_before_population[i]) / size_of[i]
                               for i in instances),
                extra_ratio=max((peak.peak(pids[i]) - rss_before_snapshot[i]) / size_of[i]
                                for i in instances),
                resident_ratio=max((rss_before_snapshot[i] - rss_before_population[i])
                                   / size_of[i] for i in instances),
                rss_shmem=shmem, peak_method=peak.method,
            )

        async def overlapped(rep: dict[str, Any], path: Path) -> None:
            """A snapshot whose caller's own save (a sleep) takes as long as the persist
            (the median so far at this point), so the two can overlap."""
            sleep_s = statistics.median(persists_s)
            snap, times = await probed_snapshot(ckpt, clients, path, sleep_s)
            assert snap is not None
            m = snap.metrics(0.0)
            persists_s.append(m["persist_seconds"])
            rep.update(overlap_sleep_ms=sleep_s * 1e3, overlap_paused_ms=times["paused_ms"],
                       overlap_entry_exit_ms=times["entry_exit_ms"],
                       overlap_entry_ms=times["entry_ms"],
                       overlap_persist_ms=m["persist_seconds"] * 1e3)
            shutil.rmtree(path, ignore_errors=True)

        reps: list[dict[str, Any]] = []
        # Phase A: per repetition, the disk's own write of the same size in the same
        # folder, a snapshot whose caller saves nothing and one whose caller sleeps (in
        # alternating order, so neither always follows the other's writes), and the
        # disk's write again; the faster disk write counts (interference only slows it).
        # Memory is measured here, before the baseline runs: the baseline's `sessions()`
        # replies go through the object store, whose shared pages would then count in
        # the holders' RSS.
        for r in range(repeats):
            rep: dict[str, Any] = {}
            path = point_dir / f"snap-{r}"
            path.mkdir()
            disk_file = path / "disk-baseline.bin"
            disk_before_s = disk_write(disk_file, size, pool)
            disk_file.unlink()
            if r % 2 == 0:
                await plain(rep, path)
                await overlapped(rep, point_dir / f"snap-{r}-overlap")
            else:
                await overlapped(rep, point_dir / f"snap-{r}-overlap")
                await plain(rep, path)
            disk_after_s = disk_write(disk_file, int(rep["bytes_written"]), pool)
            rep.update(disk_write_before_s=disk_before_s, disk_write_after_s=disk_after_s,
                       disk_write_s=min(disk_before_s, disk_after_s))
            reps.append(rep)
            log.info("  rep %d: entry %.1f ms, exit %.1f ms, paused %.1f ms, persist "
                     "%.1f ms (%.0f MB/s; disk %.0f MB/s), overlap paused %.1f ms (sleep "
                     "%.1f, persist %.1f)", r, rep["entry_ms"], rep["exit_ms"],
                     rep["paused_ms"], rep["persist_ms"],
                     rep["bytes_written"] / rep["persist_ms"] / 1e3,
                     rep["bytes_written"] / rep["disk_write_s"] / 1e6,
                     rep["overlap_paused_ms"], rep["overlap_sleep_ms"],
                     rep["overlap_persist_ms"])

        # Phase B: the single-writer baseline, then restore and the disk's read. One
        # unmeasured baseline first, as the design had its unmeasured snapshot.
        warm_dir = point_dir / "warmup-baseline"
        warm_dir.mkdir()
        await single_writer_snapshot(ns, instances, warm_dir, 5.0, 120.0)
        shutil.rmtree(warm_dir, ignore_errors=True)
        for r, rep in enumerate(reps):
            path = point_dir / f"snap-{r}"
            env_dir = path / "environment"
            disk_file = path / "disk-baseline.bin"
            base = await single_writer_snapshot(ns, instances, env_dir, 5.0, 120.0)
            rep.update({f"baseline_{k}": v for k, v in base.items()})
            for f in env_dir.glob("baseline-*.msgpack"):
                f.unlink()
            # Restore (page cache warm: the shards were just written) and the disk read
            # of a just-written file of the same size, read the way read_shard reads.
            rep.update(await restore_once(config, f"{ns}-r{r}", path, sessions, False))
            # The disk's read of a just-written file of the same size, twice; the faster.
            rep["disk_read_s"] = min(disk_read(disk_file)[0], disk_read(disk_file)[0])
            if cold_reads:
                cold = await restore_once(config, f"{ns}-c{r}", path, sessions, True)
                rep["restore_cold_ms"] = cold["restore_ms"]
                rep["restore_cold_prepare_ms"] = cold["restore_prepare_ms"]
                evict_from_page_cache([disk_file])
                rep["disk_read_cold_s"], _ = disk_read(disk_file)
            shutil.rmtree(path, ignore_errors=True)
            log.info("  rep %d: baseline paused %.1f ms (gather %.1f, write %.1f); restore "
                     "%.1f ms; disk read %.1f ms", r,
                     rep["baseline_paused_ms"], rep["baseline_gather_ms"],
                     rep["baseline_write_ms"], rep["restore_ms"], rep["disk_read_s"] * 1e3)

        return _point_record(holders, sessions, state_bytes, reps, populate_s,
                             rss_before_population, rss_after_population, cold_reads)
    finally:
        with contextlib.suppress(Exception):
            ckpt.shutdown()
        shutil.rmtree(point_dir, ignore_errors=True)


def _point_record(holders: int, sessions: int, state_bytes: int, reps: list[dict[str, Any]],
                  populate_s: float, rss0: dict[str, int], rss1: dict[str, int],
                  cold_reads: bool) -> dict[str, Any]:
    col = {k: [r[k] for r in reps] for k in reps[0] if isinstance(reps[0][k], (int, float))}
    mb = 1e6
    write_mb_s = [r["bytes_written"] / (r["persist_ms"] / 1e3) / mb for r in reps]
    disk_w_mb_s = [r["bytes_written"] / r["disk_write_s"] / mb for r in reps]
    restore_mb_s = [r["bytes_written"] / (r["restore_ms"] / 1e3) / mb for r in reps]
    disk_r_mb_s = [r["bytes_written"] / r["disk_read_s"] / mb for r in reps]
    point: dict[str, Any] = {
        "holders": holders, "sessions": sessions, "state_bytes": state_bytes,
        "repeats": len(reps),
    }
    for key in ("entry_ms", "exit_ms", "paused_ms", "entry_exit_ms", "restore_ms",
                "persist_ms",
                "coord_entry_ms", "drain_ms", "capture_ms", "restore_prepare_ms",
                "overlap_paused_ms", "overlap_entry_exit_ms", "overlap_sleep_ms",
                "overlap_persist_ms"):
        point.update(summary(key, col[key]))
    point.update(summary("baseline_single_writer_paused_ms", col["baseline_paused_ms"]))
    point.update({
        "baseline_gather_ms_median": round(median(col["baseline_gather_ms"]), 2),
        "baseline_write_ms_median": round(median(col["baseline_write_ms"]), 2),
        "baseline_speedup": round(median(col["baseline_paused_ms"])
                                  / median(col["paused_ms"]), 2),
        "bytes_written": int(median(col["bytes_written"])),
        "write_mb_s_median": round(median(write_mb_s), 1),
        "disk_write_mb_s_median": round(median(disk_w_mb_s), 1),
        # Paired per repetition (same run, same folder, same size), then the median.
        "write_ratio_to_disk": round(median(ratios(write_mb_s, disk_w_mb_s)), 3),
        "restore_mb_s_median": round(median(restore_mb_s), 1),
        "disk_read_mb_s_median": round(median(disk_r_mb_s), 1),
        "restore_ratio_to_disk": round(median(ratios(restore_mb_s, disk_r_mb_s)), 3),
        "holder_peak_memory_ratio": round(median(col["peak_ratio"]), 3),
        "holder_peak_memory_ratio_max": round(max(col["peak_ratio"]), 3),
        "holder_resident_ratio": round(median(col["resident_ratio"]), 3),
        "holder_snapshot_extra_ratio": round(median(col["extra_ratio"]), 3),
        "holder_rss_shmem_bytes_max": int(max(col["rss_shmem"])),
        "holder_peak_method": reps[0]["peak_method"],
        "holder_rss_before_population_mb": round(max(rss0.values()) / MiB, 1),
        "holder_rss_after_population_mb": round(max(rss1.values()) / MiB, 1),
        # The whole snapshot of a caller sleeping as long as the persist, over one saving
        # nothing: what the caller's save adds once the persist runs beside it.
        "overlap_growth_ratio": round(median(
            g - 1.0 for g in ratios(col["overlap_entry_exit_ms"], col["entry_exit_ms"])), 3),
        # How much of the caller's save the persist hid: 1 = all of it (perfect overlap),
        # 0 = none (persist after the caller's block, one after the other).
        "overlap_hidden_fraction": round(median(
            1.0 - (r["overlap_entry_exit_ms"] - r["entry_exit_ms"]) / r["overlap_sleep_ms"]
            for r in reps), 3),
        "populate_s": round(populate_s, 2),
        "populate_opens_per_s": round(sessions / populate_s, 0),
    })
    # The disk's own read speed is a read from the disk: with the files evicted from the
    # page cache on both sides, restore_* are the evicted figures and the warm ones move
    # to restore_warm_* (a page-cache read runs at memory speed, 2-18 GB/s here).
    if cold_reads:
        warm = [k for k in point if k.startswith(("restore_ms_", "restore_prepare_ms_"))
                or k in ("restore_mb_s_median", "disk_read_mb_s_median",
                         "restore_ratio_to_disk")]
        for k in warm:
            point[k.replace("restore_", "restore_warm_", 1)
                  .replace("disk_read_", "disk_read_warm_", 1)] = point.pop(k)
        cold_mb_s = [r["bytes_written"] / (r["restore_cold_ms"] / 1e3) / mb for r in reps]
        disk_rc = [r["bytes_written"] / r["disk_read_cold_s"] / mb for r in reps]
        point.update(summary("restore_ms", col["restore_cold_ms"]))
        point.update(summary("restore_prepare_ms", col["restore_cold_prepare_ms"]))
        point.update({
            "restore_reference": "evicted",
            "restore_mb_s_median": round(median(cold_mb_s), 1),
            "disk_read_mb_s_median": round(median(disk_rc), 1),
            "restore_ratio_to_disk": round(median(ratios(cold_mb_s, disk_rc)), 3),
        })
    else:
        point["restore_reference"] = "page cache (--no-cold-reads)"
    point["repetitions"] = [{k: (round(v, 3) if isinstance(v, float) else v)
                             for k, v in r.items()} for r in reps]
    return point


# --- the crash-cost model ------------------------------------------------------------------------


def crash_cost_table(slots: int, rollouts: int, turns: int, ks: Sequence[int], trials: int,
                     seed: int, sigma: float) -> dict[str, Any]:
    """Turns a crash at a uniformly random time costs, by seeded Monte Carlo.

    The workload: ``rollouts`` rollouts of ``turns`` turns each, run asynchronously by
    ``slots`` environment workers (a worker takes the next rollout as soon as its rollout
    finishes); turn durations are lognormal with mean 1 (the time unit is one mean turn)
    and shape ``sigma``. One crash happens at a uniform random time in the run.

    - Without turn-level recovery: every rollout in flight at the crash starts over, so
      the committed turns of every unfinished rollout are lost. Finished rollouts are
      kept (generous to the baseline: RL consumed them).
    - With a snapshot every K time units (both halves at one cut, K mean turn-times, so
      a rollout advances about K turns between snapshots): the restore goes back to the
      last cut, so every turn committed after it is lost, including turns of rollouts
      that finished after it (conservative for turn-level recovery).
    - In both, the turns in flight at the crash are lost; reported apart. The pauses the
      snapshots cost are not in this table (see paused_ms in the first one).

    Closed forms (steady state, fixed turns per rollout): with snapshots every K,
    E[lost] = slots * K / 2 (turns commit at rate ``slots`` and the crash falls
    uniformly within an interval); without, an unfinished rollout has committed a uniform
    0..T-1 turns, so E[lost] = slots * (T - 1) / 2. The ratio is (T - 1) / K.
    """
    import bisect
    import heapq

    rng = random.Random(seed)
    mu = -sigma * sigma / 2  # lognormal with mean 1
    lost: dict[str, list[int]] = {str(k): [] for k in ks}
    lost["none"] = []
    in_flight_counts: list[int] = []
    for _ in range(trials):
        free = [(0.0, w) for w in range(slots)]
        runs: list[tuple[float, list[float]]] = []  # (start, commit time of each turn)
        for _r in range(rollouts):
            start, w = heapq.heappop(free)
            t = start
            commits = []
            for _t in range(turns):
                t += rng.lognormvariate(mu, sigma)
                commits.append(t)
            heapq.heappush(free, (t, w))
            runs.append((start, commits))
        makespan = max(c[-1] for _s, c in runs)
        crash = rng.uniform(0.0, makespan)
        none = 0
        in_flight = 0
        for start, c in runs:
            if start <= crash < c[-1]:
                in_flight += 1
                none += bisect.bisect_right(c, crash)
        lost["none"].append(none)
        in_flight_counts.append(in_flight)
        for k in ks:
            cut = math.floor(crash / k) * k
            lost[str(k)].append(sum(bisect.bisect_right(c, crash) - bisect.bisect_right(c, cut)
                                    for _s, c in runs))
    none_mean = statistics.fmean(lost["none"])
    rows = []
    for key in [str(k) for k in ks] + ["none"]:
        vals = sorted(lost[key])
        mean = statistics.fmean(vals)
        closed = slots * (turns - 1) / 2 if key == "none" else slots * int(key) / 2
        rows.append({
            "snapshot_every_turns": None if key == "none" else int(key),
            "lost_turns_mean": round(mean, 1),
            "lost_turns_p95": vals[min(len(vals) - 1, int(0.95 * len(vals)))],
            "lost_turns_closed_form": round(closed, 1),
            "lost_vs_no_recovery": round(mean / none_mean, 3) if none_mean else None,
        })
    return {
        "model": {"slots": slots, "rollouts": rollouts, "turns_per_rollout": turns,
                  "turn_time": f"lognormal, mean 1, sigma {sigma}", "trials": trials,
                  "seed": seed,
                  "turns_in_flight_at_crash_mean":
                      round(statistics.fmean(in_flight_counts), 1)},
        "rows": rows,
    }


# --- reporting --------------------------------------------------------------------------------


def _fmt_range(p: dict[str, Any], key: str) -> str:
    if f"{key}_median" not in p:
        return "-"
    return f"{p[f'{key}_median']:.1f} ({p[f'{key}_min']:.1f}-{p[f'{key}_max']:.1f})"


def point_tables(points: list[dict[str, Any]]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The two result tables (title, header, rows), for the terminal and for markdown."""
    times = []
    ratios = []
    for p in points:
        key = [str(p["holders"]), str(p["sessions"]), _kib(p["state_bytes"])]
        times.append(key + [
            _fmt_range(p, "entry_ms"), _fmt_range(p, "exit_ms"), _fmt_range(p, "paused_ms"),
            _fmt_range(p, "baseline_single_writer_paused_ms"), f"{p['baseline_speedup']:.2f}",
            _fmt_range(p, "restore_ms")])
        warm = p.get("restore_warm_ratio_to_disk")
        ratios.append(key + [
            f"{p['write_mb_s_median']:.0f} / {p['disk_write_mb_s_median']:.0f}",
            f"{p['write_ratio_to_disk']:.2f}",
            f"{p['restore_mb_s_median']:.0f} / {p['disk_read_mb_s_median']:.0f}",
            f"{p['restore_ratio_to_disk']:.2f}",
            "-" if warm is None else f"{warm:.2f}",
            f"{p['holder_peak_memory_ratio']:.2f} ({p['holder_resident_ratio']:.2f} + "
            f"{p['holder_snapshot_extra_ratio']:.2f})",
            f"{p['overlap_growth_ratio']:+.0%} ({p['overlap_hidden_fraction']:.2f})",
            f"{p['populate_s']:.1f}"])
    return [
        ("milliseconds, median (min-max)",
         ["holders", "sessions", "state", "entry_ms", "exit_ms", "paused_ms",
          "baseline_single_writer_paused_ms", "baseline / paused", "restore_ms"], times),
        ("throughput (MB/s, medians) and ratios",
         ["holders", "sessions", "state", "write / disk MB/s", "write_ratio_to_disk",
          "restore / disk read MB/s", "restore_ratio_to_disk", "restore ratio, page cache",
          "holder_peak_memory_ratio (resident + snapshot extra)",
          "overlap growth (hidden fraction)", "populate s"], ratios),
    ]


def format_points(points: list[dict[str, Any]]) -> str:
    out = []
    for title, header, rows in point_tables(points):
        out.append(title)
        out.extend(format_table(header, rows))
        out.append("")
    return "\n".join(out).rstrip()


def format_markdown(doc: dict[str, Any]) -> str:
    """The results as markdown tables (for benchmarks/README.md)."""
    def table(header: list[str], rows: list[list[str]]) -> list[str]:
        return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                + ["| " + " | ".join(r) + " |" for r in rows])

    run = doc.get("run", {})
    src = run.get("runtime_source", {})
    dirty = " + uncommitted changes" if src.get("runtime_changes_not_committed") else ""
    load = run.get("loadavg_1_5_15_before")
    lines = [f"`{run.get('command', '')}`: finished {run.get('finished', run.get('when', ''))}, "
             f"{run.get('cpus')} CPUs, "
             f"Ray {run.get('ray')}, runtime at {src.get('commit')}{dirty}, "
             f"{run.get('repeats')} repeats, {run.get('wall_seconds')} s"
             + (f", load average {load[0]:.1f} at the start" if load else ""), ""]
    for title, header, rows in point_tables(doc["points"]):
        lines += [f"*{title}*", "", *table(header, rows), ""]
    crash = doc["crash_cost"]
    m = crash["model"]
    lines += [f"*turns lost to one crash at a uniformly random time: {m['slots']} workers, "
              f"{m['rollouts']} rollouts x {m['turns_per_rollout']} turns, turn time "
              f"{m['turn_time']}, {m['trials']} trials, seed {m['seed']}*", ""]
    lines += table(["snapshot every K turns", "turns lost, mean", "p95", "closed form",
                    "vs. no turn-level recovery"],
                   [["none (no turn-level recovery)" if r["snapshot_every_turns"] is None
                     else str(r["snapshot_every_turns"]), f"{r['lost_turns_mean']:.1f}",
                     str(r["lost_turns_p95"]), f"{r['lost_turns_closed_form']:.1f}",
                     f"{r['lost_vs_no_recovery']:.3f}"] for r in crash["rows"]])
    lines += ["", "*targets*", ""]
    lines += table(["target", "point", "value", "limit", "holds"],
                   [[t["target"], t["point"], str(t["value"]), t["limit"],
                     "yes" if t["holds"] else "**no**"] for t in doc["targets"]])
    return "\n".join(lines) + "\n"


def format_crash_table(table: dict[str, Any]) -> str:
    m = table["model"]
    lines = [f"turns lost to one crash at a random time: {m['slots']} workers, "
             f"{m['rollouts']} rollouts x {m['turns_per_rollout']} turns, turn time "
             f"{m['turn_time']}, {m['trials']} trials, seed {m['seed']}",
             "snapshot every (turns)  lost mean   lost p95   closed form   vs none",
             ]
    for r in table["rows"]:
        k = "none (no turn-level)" if r["snapshot_every_turns"] is None \
            else str(r["snapshot_every_turns"])
        lines.append(f"{k:>22}  {r['lost_turns_mean']:>9.1f}  {r['lost_turns_p95']:>9}"
                     f"  {r['lost_turns_closed_form']:>12.1f}  {r['lost_vs_no_recovery']:>7.3f}")
    lines.append(f"(plus ~{m['turns_in_flight_at_crash_mean']} turns in flight at the crash, "
                 f"lost either way)")
    return "\n".join(lines)


def _kib(n: int) -> str:
    return f"{n // 1024}KiB" if n % 1024 == 0 else f"{n}B"


def check_targets(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each against the points it applies to."""
    out = []

    def add(name: str, p: dict[str, Any], value: float, ok: bool, limit: str) -> None:
        out.append(target(name, f"{p['holders']}h x {p['sessions']} x "
                                f"{_kib(p['state_bytes'])}", value, ok, limit))

    for p in points:
        if (p["holders"], p["sessions"], p["state_bytes"]) == (4, 10_000, 1024):
            add("entry_ms_median", p, p["entry_ms_median"], p["entry_ms_median"] <= 20,
                "<= 20")
        if p["state_bytes"] == 64 * 1024:
            add("write_ratio_to_disk", p, p["write_ratio_to_disk"],
                p["write_ratio_to_disk"] >= 0.7, ">= 0.7")
            add("restore_ratio_to_disk", p, p["restore_ratio_to_disk"],
                p["restore_ratio_to_disk"] >= 0.7, ">= 0.7")
        if p["holders"] == 4:
            add("baseline_speedup (baseline paused / paused)", p, p["baseline_speedup"],
                p["baseline_speedup"] >= 1.5, ">= 1.5")
        add("overlap_growth_ratio", p, p["overlap_growth_ratio"],
            p["overlap_growth_ratio"] <= 0.10, "<= 0.10")
        add("holder_peak_memory_ratio", p, p["holder_peak_memory_ratio"],
            p["holder_peak_memory_ratio"] <= 1.5, "<= 1.5")
    return out


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="two points only: 4h x 10k x 1KiB and 4h x 1k x 64KiB, then the "
                        "quick scale series (10k and 100k sessions, 64 instances at 20k), "
                        "and the quick fan-out model (benchmarks/fanout.py)")
    p.add_argument("--scale", action="store_true",
                   help="the scale series only (benchmarks/scale.py): 4 holders at 10k, "
                        "100k, 150k and 1M sessions of 1 KiB, 64 instances at 100k, the "
                        "cut check at 10k-1M x 16 keys, a turn's overhead")
    p.add_argument("--object-store", action="store_true",
                   help="the object-store series only (benchmarks/object_store.py): "
                        "snapshots into a bucket of a local SeaweedFS server against "
                        "obstore's own put and get and against a folder; with --quick, "
                        "its first point only")
    p.add_argument("--holders", default=",".join(map(str, FULL_HOLDERS)),
                   help="comma-separated holder counts (= nodes) of the full grid")
    p.add_argument("--sessions", default=",".join(map(str, FULL_SESSIONS)),
                   help="comma-separated session counts (total over the holders)")
    p.add_argument("--state-bytes", default=",".join(map(str, FULL_STATE_BYTES)),
                   help="comma-separated state sizes per session, in bytes")
    p.add_argument("--repeats", type=int, default=None,
                   help="repetitions per point, at least 3 (default: 5 with --quick, else 3)")
    p.add_argument("--dir", type=Path, default=None,
                   help="folder for snapshots and the disk baselines (default: a fresh "
                        "temporary folder, removed afterwards)")
    p.add_argument("--no-cold-reads", dest="cold_reads", action="store_false",
                   help="skip the extra restore and disk read after evicting the files "
                        "from the page cache (POSIX_FADV_DONTNEED)")
    p.add_argument("--object-store-mb", type=int, default=2048,
                   help="object store per simulated node (the baseline's gather uses it)")
    p.add_argument("--object-store-server", choices=("seaweedfs", "rclone"),
                   default="seaweedfs",
                   help="the S3 server of the object-store series (issue 26 asks for both)")
    p.add_argument("--crash-trials", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="write {'points': [...], ...} here")
    p.add_argument("--markdown", type=Path, default=None, metavar="PATH",
                   help="also write the tables as markdown here")
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="run nothing: print (and --markdown) the tables of a results file")
    p.add_argument("-v", "--verbose", action="store_true", help="log every repetition")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 5 if args.quick else 3
    if args.repeats < 3:
        p.error("--repeats must be at least 3")
    return args


def grid(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    if args.quick:
        return list(QUICK_POINTS)
    hs = [int(x) for x in args.holders.split(",")]
    ss = [int(x) for x in args.sessions.split(",")]
    bs = [int(x) for x in args.state_bytes.split(",")]
    return [(h, s, b) for h in sorted(hs) for s in ss for b in bs]


async def run_points(points: list[tuple[int, int, int]], cluster: LocalCluster,
                     args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    pool = random.Random(args.seed).randbytes(64 * MiB)  # the disk baseline's data
    results = []
    for h, s, b in points:
        cluster.grow_to(h)
        print(f"point: {h} holders x {s} sessions x {_kib(b)} ...", flush=True)
        t = time.perf_counter()
        point = await measure_point(h, s, b, args.repeats, workdir, args.cold_reads,
                                    args.seed, pool)
        print(f"  done in {time.perf_counter() - t:.0f} s: entry {point['entry_ms_median']}"
              f" ms, paused {point['paused_ms_median']} ms, baseline "
              f"{point['baseline_single_writer_paused_ms_median']} ms", flush=True)
        results.append(point)
    return results


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        doc = json.loads(args.render.read_text())
        for p in doc["points"]:
            # Results from before the overlap was measured on the whole snapshot.
            p.setdefault("overlap_growth_ratio", p.get("overlap_paused_growth_ratio"))
        print(format_points(doc["points"]))
        print()
        print(format_crash_table(doc["crash_cost"]))
        if args.markdown is not None:
            args.markdown.write_text(format_markdown(doc))
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    logging.getLogger("nemo_ckpt").setLevel(logging.WARNING)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    points = [] if args.scale or args.object_store else grid(args)
    # Nodes are only ever added, so run the grid in increasing holder count.
    points.sort(key=lambda p: p[0])
    own_dir = args.dir is None
    workdir = Path(tempfile.mkdtemp(prefix="nemo-ckpt-bench-")) if own_dir \
        else args.dir / f"nemo-ckpt-bench-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load_before = os.getloadavg()
    print(f"nemo-ckpt snapshot benchmark: {len(points)} point(s), {args.repeats} repeats, "
          f"folder {workdir} ({os.cpu_count()} CPUs)", flush=True)
    cluster = None
    server = None
    objects = None
    scale = None
    fanout = None
    try:
        if args.object_store:
            from tests.s3_server import BUCKET, SERVERS

            # Before the cluster: its workers find the server through the AWS_* environment.
            server = SERVERS[args.object_store_server](workdir / "s3")
            server.start()
            os.environ.update(server.env())
        t = time.perf_counter()
        cluster = LocalCluster(args.object_store_mb * MiB)
        print(f"local Ray cluster up in {time.perf_counter() - t:.1f} s", flush=True)
        results = asyncio.run(run_points(points, cluster, args, workdir))
        if args.object_store:
            cluster.grow_to(4)
            objects = asyncio.run(run_object_store(
                args.quick, f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:6]}", workdir,
                args.repeats, server.version() if server is not None else "SeaweedFS"))
        if args.scale or (args.quick and not args.object_store):
            cluster.grow_to(4)
            pool = random.Random(args.seed).randbytes(64 * MiB)
            scale = asyncio.run(run_scale(args.quick, workdir, pool, 3))
        if not args.scale and not args.object_store:  # the fan-out model (issue 26)
            cluster.grow_to(4)
            fanout = asyncio.run(run_fanout(args.quick, workdir, 3 if args.quick else 5))
    finally:
        if cluster is not None:
            cluster.shutdown()
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    crash = crash_cost_table(slots=64, rollouts=512, turns=16, ks=(1, 2, 4, 8),
                             trials=args.crash_trials, seed=args.seed, sigma=0.6)
    targets = check_targets(results) if results else []
    if scale is not None:
        targets += scale_targets(scale)
    if objects is not None:
        targets += object_store_targets(objects)
    if fanout is not None:
        targets += fanout_targets(fanout)
    print()
    if results:
        print(format_points(results))
        print()
    print(format_crash_table(crash))
    if scale is not None:
        print()
        print(format_scale(scale))
    if objects is not None:
        print()
        print(format_object_store(objects))
    if fanout is not None:
        print()
        print(format_fanout(fanout))
    print()
    print(format_targets(targets))
    elapsed = time.perf_counter() - started
    print(f"\nwall time {elapsed:.0f} s")
    if args.json is not None or args.markdown is not None:
        run = run_record(__spec__.name if __spec__ else None, started, load_before)
        run.update({"quick": args.quick, "scale": args.scale,
                    "object_store": args.object_store, "repeats": args.repeats,
                    "cold_reads": args.cold_reads, "definitions": DEFINITIONS})
        doc = {"points": results, "scale": scale, "object_store": objects, "fanout": fanout,
               "crash_cost": crash, "targets": targets, "run": run}
        if args.json is not None:
            write_json(args.json, doc)
        if args.markdown is not None:
            args.markdown.write_text(format_markdown(doc))
    return 0


DEFINITIONS = {
    "sessions": "total over the holders, spread round-robin; each opened with "
                "state_bytes of state and no turns",
    "entry_ms": "driver clock, from calling snapshot() to the yield (pause, drain with no "
                "turn in flight, capture; the writes start as the coordinator replies)",
    "exit_ms": "driver clock, from the yield to the end of the async with (caller saves "
               "nothing): persist remainder, manifest commit, resume",
    "paused_ms": "from calling snapshot() until the last holder's turn gate is seen open "
                 "again by a probe open_session issued inside the block (it waits at the "
                 "closed gate); an upper bound of the holders' gate-closed time by one "
                 "call's return. entry_exit_ms is entry_ms + exit_ms",
    "write_ratio_to_disk": "per repetition (bytes_written / max holder persist time) over "
                           "(same size / time of a 4 MiB-chunked sequential write + fsync in "
                           "the same folder); median",
    "restore_ms": "driver clock, restored() called to the end of its async with (caller "
                  "does nothing inside), into fresh holders (a new namespace; the holders "
                  "are created before the clock starts, as check_startup would); the "
                  "shards evicted from the page cache first (POSIX_FADV_DONTNEED), as after "
                  "a crash. restore_warm_ms: the same with the shards just written",
    "restore_ratio_to_disk": "per repetition (bytes / restore_ms) over (same size / time "
                             "to read a file of that size as read_shard does, evicted from "
                             "the page cache first): the disk's own read speed; median. "
                             "restore_warm_ratio_to_disk: both sides page-cache warm",
    "baseline_single_writer_paused_ms": "pause every holder, pull all sessions "
                                        "(SessionHolder.sessions) into the driver, write one "
                                        "msgpack file as a shard is written, resume",
    "holder_peak_memory_ratio": "max over holders of (peak RSS during the snapshot "
                                "[VmHWM] - RSS of the idle holder before population) / "
                                "the state bytes it holds; median over repetitions",
    "holder_resident_ratio": "(RSS just before the snapshot - RSS before population) / "
                             "state bytes: what merely holding the sessions costs",
    "holder_snapshot_extra_ratio": "(peak RSS during snapshot - RSS just before it) / "
                                   "state bytes: what the snapshot adds",
    "disk_write": "one file of the snapshot's byte size, random data, 4 MiB writes, one "
                  "fsync, in the snapshot's folder, right before and right after each "
                  "snapshot; the faster of the two (conservative for the ratio)",
    "disk_read": "the disk-baseline file read right after the restores, as read_shard "
                 "reads (open, fstat, one read), after POSIX_FADV_DONTNEED on it; warm: "
                 "read twice without evicting, the faster",
    "overlap_growth_ratio": "per repetition, entry_exit_ms (snapshot() called to the end "
                            "of the async with) of a caller that sleeps for the persist "
                            "time (median persist_seconds of this point's measured "
                            "snapshots so far) inside the block, over entry_exit_ms of the "
                            "repetition's snapshot whose caller saves nothing, minus 1; "
                            "median. The two run back to back, in alternating order. (The "
                            "pause lasts until the context exits, so the caller's save is "
                            "on it by definition; overlap_paused_ms records it)",
    "overlap_hidden_fraction": "per repetition 1 - (time added to the whole snapshot) / "
                               "(sleep): the share of the caller's save hidden by the "
                               "overlap; median",
}


if __name__ == "__main__":
    sys.exit(main())
