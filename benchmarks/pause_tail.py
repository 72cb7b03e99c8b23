"""The pause's tail at one point of the scale series (``benchmarks.scale``): how long the
holders stay paused after ``snapshot()`` has yielded, ``paused - entry``, whose target is
"paused <= entry + 20 ms" at 4 holders x 150k sessions x 1 KiB.

Only that point, in a few minutes: 4 holders on a local cluster of 4 simulated nodes,
populated once; then, repeat by repeat, one snapshot (an empty block, as the scale
series takes it) by each of two drivers of the same job, in alternating order:

- ``direct``: ``RayEnvironmentCheckpoint`` as it is, which releases the holders itself as
  its block exits, beside its commit to the coordinator;
- ``via coordinator``: the same driver with its own release left out, so the holders
  resume only when the coordinator's release reaches them (driver -> coordinator ->
  holders), as before issue 26.

Both share the holders, their sessions and the machine's load, so their medians and
their ratio are comparable within the run. With ``--series``, the point is then also
measured as the scale series measures it (``benchmarks.scale.measure_scale_point``:
fresh holders, 3 snapshots by one driver, the first without handles yet, a restore),
with the series' targets at that point.

    python -m benchmarks.pause_tail [--sessions 150000] [--repeats 5] [--series]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import random
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import GateProbe, LocalCluster, bench_config, format_targets
from benchmarks.scale import (
    NODES,
    STATE_BYTES,
    format_scale,
    measure_scale_point,
    populate_bulk,
    scale_targets,
    with_growth,
)
from nemo_ckpt import RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.protocol.coordinator_api import SnapshotBegun

MiB = 1 << 20
TAIL_TARGET_MS = 20.0


class ViaCoordinator(RayEnvironmentCheckpoint):
    """The driver without its own release: the coordinator's alone resumes the holders."""

    def _release_holders(self, begun: SnapshotBegun) -> int:
        del begun
        return 0


async def one_snapshot(ckpt: RayEnvironmentCheckpoint, clients: list[SessionClient],
                       path: Path) -> dict[str, float]:
    """One snapshot with an empty block and a gate probe; in ms from ``snapshot()``."""
    probe = GateProbe(clients)
    t0 = time.perf_counter()
    async with ckpt.snapshot(path):
        t_entry = time.perf_counter()
        probe.start()
        await asyncio.sleep(0)
        t_block = time.perf_counter()
    t_exit = time.perf_counter()
    opened = await probe.gates_open_at()
    await probe.close()
    return {"entry_ms": (t_entry - t0) * 1e3, "paused_ms": (opened - t0) * 1e3,
            "tail_ms": (opened - t_entry) * 1e3, "exit_ms": (t_exit - t_block) * 1e3}


async def measure(sessions: int, repeats: int, workdir: Path) -> dict[str, Any]:
    ns = f"tail-{uuid.uuid4().hex[:8]}"
    config = bench_config(ns, 600.0)
    arms: dict[str, RayEnvironmentCheckpoint] = {
        "direct": RayEnvironmentCheckpoint(config), "via coordinator": ViaCoordinator(config)}
    first = arms["direct"]
    try:
        infos = await first.ensure_holders()
        names = sorted(i.instance_id for i in infos)
        clients = [await SessionClient.connect(instance_id=i, namespace=ns) for i in names]
        populate_s = await populate_bulk(clients, sessions, STATE_BYTES, "rollout")
        runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
        # A warm-up snapshot each (not counted): the first one's driver has no holder
        # handles yet, and every process's first snapshot pays its imports.
        order = list(arms)
        for r in range(repeats + 1):
            for arm in (order if r % 2 == 0 else order[::-1]):
                path = workdir / f"{arm.replace(' ', '-')}-{r}"
                gc.collect()
                figures = await one_snapshot(arms[arm], clients, path)
                if r > 0:
                    runs[arm].append(figures)
                shutil.rmtree(path, ignore_errors=True)
                await asyncio.sleep(0.5)  # the commit's clean-up and the heap trims
        out: dict[str, Any] = {"instances": len(names), "sessions": sessions,
                               "populate_s": round(populate_s, 1), "repeats": repeats}
        for arm, reps in runs.items():
            out[arm] = {key: round(statistics.median(rep[key] for rep in reps), 1)
                        for key in reps[0]}
            out[arm]["tails_ms"] = [round(rep["tail_ms"], 1) for rep in reps]
            out[arm]["exits_ms"] = [round(rep["exit_ms"]) for rep in reps]
        return out
    finally:
        first.shutdown()


def report(result: dict[str, Any]) -> str:
    lines = [f"the pause's tail at {result['instances']} holders x {result['sessions']} "
             f"sessions x 1 KiB ({result['repeats']} snapshots each, medians, ms):"]
    for arm in ("direct", "via coordinator"):
        f = result[arm]
        lines.append(f"  {arm:>16}: entry {f['entry_ms']:.1f}, paused {f['paused_ms']:.1f}, "
                     f"paused - entry {f['tail_ms']:.1f} (each: {f['tails_ms']}), "
                     f"exit {f['exit_ms']:.1f} (each: {f['exits_ms']})")
    direct, via = result["direct"]["tail_ms"], result["via coordinator"]["tail_ms"]
    lines.append(f"  paused - entry, direct / via coordinator: {direct / via:.2f}")
    holds = direct <= TAIL_TARGET_MS
    lines.append(f"  paused <= entry + {TAIL_TARGET_MS:.0f} ms (direct): "
                 f"{'HOLDS' if holds else 'MISSED'} ({direct:.1f} ms over the entry)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pause_tail", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=150_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--object-store-mb", type=int, default=512)
    p.add_argument("--series", action="store_true",
                   help="also measure the point as the scale series does, with its targets")
    args = p.parse_args(argv)
    logging.getLogger("nemo_ckpt").setLevel(logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="nemo-ckpt-tail-"))
    cluster = LocalCluster(args.object_store_mb * MiB)
    try:
        cluster.grow_to(NODES)
        result = asyncio.run(measure(args.sessions, args.repeats, workdir))
        series = None
        if args.series:
            pool = random.Random(0).randbytes(64 * MiB)  # the disk baseline's data
            point = asyncio.run(measure_scale_point(NODES, args.sessions, 3, workdir, pool))
            series = {"points": with_growth([point]), "cut_check": [], "turn_overhead": []}
    finally:
        cluster.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    print(report(result))
    if series is not None:
        print(format_scale(series))
        print(format_targets(scale_targets(series)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
