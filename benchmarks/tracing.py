"""Tracing's cost on the pause (``nemo_ckpt.tracing``): the holders' pause, from
``snapshot()`` to the last holder's gate seen open (``GateProbe``), of two jobs on one
embedded Ray instance, in alternating order, repeat by repeat:

- ``untraced``: the OpenTelemetry API installed but no SDK in the actors' processes, as a
  job that does not trace runs (spans are made, and recorded nowhere);
- ``traced``: ``CheckpointConfig.trace_file`` set, so the driver, the coordinator and the
  holder record every span and append it to a file as a JSON line.

Both have the same sessions and share the machine's load, so their medians and their
ratio are comparable within the run.

    python -m benchmarks.tracing [--sessions 2000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.common import bench_config, on_local_ray, populate, probed_snapshot
from nemo_ckpt import RayEnvironmentCheckpoint, SessionClient


async def measure(work: Path, sessions: int, repeats: int) -> dict[str, list[float]]:
    paused: dict[str, list[float]] = {"untraced": [], "traced": []}
    jobs: dict[str, tuple[RayEnvironmentCheckpoint, list[SessionClient]]] = {}
    spans = work / "spans.jsonl"
    for mode in paused:
        config = bench_config(f"bench-tracing-{mode}", 60.0).model_copy(update={
            "checkpoint_root": work / mode,
            "trace_file": spans if mode == "traced" else None})
        ckpt = RayEnvironmentCheckpoint(config)
        holders = await ckpt.ensure_holders()
        instances = [h.instance_id for h in holders]
        await populate(config.namespace, instances, sessions, 1024, seed=1)
        clients = [await SessionClient.connect(instance_id=i, namespace=config.namespace)
                   for i in instances]
        jobs[mode] = (ckpt, clients)
    for r in range(repeats + 1):  # the first of each: a warm-up, not counted
        for mode in (paused if r % 2 else reversed(list(paused))):
            ckpt, clients = jobs[mode]
            _, figures = await probed_snapshot(ckpt, clients, work / mode / f"s{r}")
            if r:
                paused[mode].append(figures["paused_ms"])
    lines = spans.read_text().splitlines()
    print(f"tracing: the traced job wrote {len(lines)} spans to its trace file")
    for ckpt, _ in jobs.values():
        await ckpt.shutdown(wait=True)
    return paused


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    paused = on_local_ray(lambda work: measure(work, args.sessions, args.repeats),
                          "bench-tracing-")
    off, on = (statistics.median(paused[m]) for m in ("untraced", "traced"))
    print(f"tracing: holders paused (median of {args.repeats}, {args.sessions} sessions "
          f"x 1 KiB on one holder): untraced {off:.1f} ms, traced {on:.1f} ms, "
          f"ratio {on / off:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
