"""The CPU one actor process costs to start: a holder and a coordinator against an empty
Ray actor (the baseline: what Ray itself costs), each with nemo-ckpt's bytecode cached
and with every module compiled again at import, as on a machine that sets
PYTHONDONTWRITEBYTECODE and has no ``__pycache__`` (why ``make test`` unsets it and
compiles once: ``Makefile``).

``python -m benchmarks.actor_startup [--repeats N]`` on an embedded local Ray. Fields:

- ``cpu_s``: the actor process's user + system CPU seconds from its start until one
  second after its first call returned (median of the repeats), read from ``/proc``;
- ``x_empty``: ``cpu_s`` over the empty actor's in the same run.

The test suite starts hundreds of actor processes (each job's coordinator and one holder
per node), and on 2 cores their start-up is a large part of ``make test``'s CPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

from benchmarks.common import git_state

_HZ = os.sysconf("SC_CLK_TCK")


class Empty:
    """The baseline: an actor with nothing of nemo-ckpt in it."""

    def pid(self) -> int:
        return os.getpid()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _HZ


def _measure(make: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        actor = make()
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=120)
        time.sleep(1.0)  # what its first second of background work costs too
        samples.append(_cpu_s(pid))
        ray.kill(actor, no_restart=True)
    return statistics.median(samples)


def _holder(options: dict[str, Any]) -> Any:
    from actors.ray_transport import SessionHolderActor

    return SessionHolderActor.options(name=uuid.uuid4().hex, **options).remote(
        "h", namespace=options["namespace"])


def _coordinator(options: dict[str, Any]) -> Any:
    from actors.ray_transport import CheckpointCoordinatorActor
    from nemo_ckpt import CheckpointConfig

    return CheckpointCoordinatorActor.options(name=uuid.uuid4().hex, **options).remote(
        CheckpointConfig(namespace=options["namespace"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.actor_startup",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import compileall

    import actors.ray_transport  # noqa: F401  (compiled here, before the measure)

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def our_bytecode(cached: bool) -> None:
        for package in ("nemo_ckpt", "actors"):
            if cached:
                compileall.compile_dir(os.path.join(root, package), quiet=1)
            else:  # a fresh clone's: none (Python's own and site-packages' stay)
                for folder, _, _ in os.walk(os.path.join(root, package)):
                    if os.path.basename(folder) == "__pycache__":
                        shutil.rmtree(folder)

    # Both ways through a runtime environment (Ray starts such workers another way, the
    # same for the empty actor): cached, and cold (no bytecode of ours on disk and none
    # written, so each actor process compiles every module of ours it imports).
    ways = (("cached", {"NEMO_CKPT_BENCH": "cached"}),
            ("compiled at import", {"PYTHONDONTWRITEBYTECODE": "1"}))
    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
    print(f"commit {git_state()['commit']}, load average {os.getloadavg()[0]:.2f}")
    rows: list[tuple[str, str, float, float]] = []
    try:
        for cache, env in ways:
            our_bytecode(cached=cache == "cached")
            options: dict[str, Any] = {"namespace": "bench-startup",
                                       "runtime_env": {"env_vars": env}}
            empty = ray.remote(num_cpus=0)(Empty).options(runtime_env=options["runtime_env"])
            baseline = _measure(empty.remote, args.repeats)
            rows.append(("empty actor", cache, baseline, baseline))
            rows.append(("holder", cache, _measure(
                functools.partial(_holder, options), args.repeats), baseline))
            rows.append(("coordinator", cache, _measure(
                functools.partial(_coordinator, options), args.repeats), baseline))
    finally:
        ray.shutdown()
        our_bytecode(cached=True)
    print(f"median of {args.repeats}; CPU seconds of one actor process, start to 1 s "
          f"after its first call")
    print("| actor | nemo-ckpt's bytecode | cpu_s | x_empty |")
    print("|---|---|---|---|")
    for name, cache, cpu, baseline in rows:
        print(f"| {name} | {cache} | {cpu:.2f} | {cpu / baseline:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
