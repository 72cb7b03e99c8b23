#!/usr/bin/env python3
"""Turn-level recovery, end to end, on a real multi-node Ray cluster (``make demo``).

Starts an embedded local cluster of ``--nodes`` simulated nodes (each its own raylet),
or joins an existing one with ``--address``. Then it runs toy multi-turn rollouts on
environment workers on every node, snapshots both halves (environment sessions and
the reference data plane) periodically, crashes the job hard mid-run, restores, runs
every rollout to completion, runs the same seed again without a crash, and compares
the two runs turn by turn. Exits 1 when they differ.

    python examples/turn_level_recovery.py --nodes 3 --rollouts 48 --turns 12
    python examples/turn_level_recovery.py --address auto --checkpoint-dir /mnt/shared/ckpt
    python examples/turn_level_recovery.py --checkpoint-dir s3://bucket/demo  # AWS_* env

Every option is checked before Ray starts (a bad one is a usage error, exit 2). Exit 1:
the runs differ, or an expected failure (no cluster, a folder the nodes do not share),
reported as one line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from nemo_ckpt.connect import connect, ray_address
from nemo_ckpt.errors import NemoCkptError
from nemo_ckpt.options import (
    at_least,
    checkpoint_path,
    non_negative_float,
    output_file_problem,
    positive_float,
    writable_folder_problem,
)
from recovery_demo import (
    DemoError,
    DemoOptions,
    DemoProgress,
    DemoReport,
    format_report,
    run_demo,
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The options, every one checked here, before Ray starts: a bad one is a usage
    error (exit 2) in a fraction of a second."""
    defaults = DemoOptions()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=at_least(1), default=3,
                   help="simulated nodes of the embedded cluster (head included)")
    p.add_argument("--rollouts", type=at_least(1), default=defaults.rollouts)
    p.add_argument("--turns", type=at_least(1), default=defaults.turns,
                   help="turns per rollout")
    p.add_argument("--snapshot-every", type=positive_float, default=defaults.snapshot_every_s,
                   metavar="SECONDS", help="seconds between snapshots")
    p.add_argument("--crash-after-snapshots", type=at_least(1),
                   default=defaults.crash_after_snapshots,
                   help="crash after this many committed snapshots that hold rollouts (the "
                        "restart needs one)")
    p.add_argument("--checkpoint-dir", type=checkpoint_path, default=defaults.checkpoint_dir,
                   help="snapshots go to <dir>/run-<time>-<id>/snapshot-NNNN; on an "
                        "existing cluster a folder every node shares, or an "
                        "s3://bucket/prefix URL (endpoint and credentials from the AWS_* "
                        "environment; `make demo-s3` runs against a local server)")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--address", type=ray_address, default=None,
                   help="join this Ray cluster (HOST:PORT of its head, or 'auto') instead "
                        "of starting one; a cluster with token authentication needs "
                        "RAY_AUTH_MODE=token and its token (README)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the report as JSON here")
    p.add_argument("--workers-per-node", type=at_least(1), default=defaults.workers_per_node)
    p.add_argument("--rollouts-per-worker", type=at_least(1),
                   default=defaults.rollouts_per_worker)
    p.add_argument("--turn-seconds", type=non_negative_float, default=defaults.turn_seconds,
                   help="simulated model and tool time per turn")
    p.add_argument("--no-sandboxes", dest="sandboxes", action="store_false",
                   help="run the rollouts without sandbox directories (by default each "
                        "one works in its own, and the run compares them byte for byte)")
    p.add_argument("--trace-file", type=Path, default=None, metavar="PATH",
                   help="append every finished OpenTelemetry span of the run's processes "
                        "(driver, coordinator, holders) here, one JSON line each (needs "
                        "opentelemetry-api and opentelemetry-sdk)")
    p.add_argument("--verbose", action="store_true", help="show nemo_ckpt's log")
    args = p.parse_args(argv)
    # A URL's bucket is probed from every node by check_startup, once Ray is up.
    problem = writable_folder_problem(args.checkpoint_dir) \
        if isinstance(args.checkpoint_dir, Path) else None
    if problem is not None:
        p.error(f"argument --checkpoint-dir: {problem}")
    if args.json is not None:
        problem = output_file_problem(args.json)
        if problem is not None:
            p.error(f"argument --json: {problem}")
    if args.trace_file is not None:
        problem = output_file_problem(args.trace_file)
        if problem is not None:
            p.error(f"argument --trace-file: {problem}")
        args.trace_file = args.trace_file.resolve()
    try:
        args.options = DemoOptions(
            rollouts=args.rollouts, turns=args.turns, snapshot_every_s=args.snapshot_every,
            crash_after_snapshots=args.crash_after_snapshots,
            checkpoint_dir=args.checkpoint_dir, seed=args.seed,
            workers_per_node=args.workers_per_node,
            rollouts_per_worker=args.rollouts_per_worker, turn_seconds=args.turn_seconds,
            sandboxes=args.sandboxes, trace_file=args.trace_file)
    except ValueError as exc:  # a rule DemoOptions keeps that the types above do not
        p.error(str(exc))
    return args


class LiveLine:
    """One progress line, redrawn in place on a terminal, printed now and then if not."""

    def __init__(self, address: Optional[str] = None) -> None:
        self.address = address  # the cluster's address as `nemo-ckpt status` needs it
        self._tty = sys.stderr.isatty()
        self._last_print = 0.0
        self._phase = ""
        self._width = 0
        self._complete = False  # this phase's "all finished" line was printed

    def __call__(self, p: DemoProgress) -> None:
        if p.note is not None:
            if self._tty and self._phase:
                sys.stderr.write("\n")
            print(f"[{p.phase:>13}] {p.note}", file=sys.stderr, flush=True)
            if p.namespace is not None and self.address is not None:
                print(f"[{p.phase:>13}] see them while the run lasts: nemo-ckpt status "
                      f"--address {self.address} --namespace {p.namespace}",
                      file=sys.stderr, flush=True)
            self._phase = ""
            return
        pause = f"  last pause {p.last_pause_s * 1000:4.0f} ms" if p.last_pause_s else ""
        line = (f"[{p.phase:>13}] {p.elapsed_s:5.1f}s  turns run {p.turns_run:5d}  "
                f"finished {p.finished:4d}/{p.rollouts}  snapshots {p.snapshots:3d}{pause}")
        if self._tty:
            if p.phase != self._phase and self._phase:
                sys.stderr.write("\n")
            sys.stderr.write("\r" + line.ljust(self._width))
            self._width = len(line)
            sys.stderr.flush()
        else:
            if p.phase != self._phase:
                self._complete = False
            complete = p.finished == p.rollouts
            due = time.monotonic() - self._last_print > 2.0
            if p.phase != self._phase or (complete and not self._complete) \
                    or (due and not complete):
                print(line, file=sys.stderr, flush=True)
                self._last_print = time.monotonic()
            self._complete = self._complete or complete
        self._phase = p.phase

    def close(self) -> None:
        if self._tty and self._phase:
            sys.stderr.write("\n")
            sys.stderr.flush()
        self._phase = ""


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray
    from ray.cluster_utils import Cluster

    if not args.verbose:
        logging.getLogger("ray").setLevel(logging.WARNING)

    started = time.monotonic()
    cluster: Any = None
    line = LiveLine()
    try:
        if args.address:
            connect(args.address, log_to_driver=args.verbose, logging_level=logging.WARNING)
            where = f"existing cluster at {args.address}"
            line.address = args.address
        else:
            print(f"starting a local Ray cluster of {args.nodes} nodes ...", file=sys.stderr,
                  flush=True)
            cluster = Cluster(initialize_head=True,
                              head_node_args={"num_cpus": 1, "include_dashboard": False})
            for _ in range(args.nodes - 1):
                cluster.add_node(num_cpus=1)
            ray.init(address=cluster.address, log_to_driver=args.verbose,
                     logging_level=logging.WARNING)
            cluster.wait_for_nodes()
            where = f"local cluster of {args.nodes} nodes at {cluster.address}"
            line.address = cluster.address
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        print(f"cluster up in {time.monotonic() - started:.1f}s ({where}, {nodes} alive "
              f"nodes)", file=sys.stderr, flush=True)
        report: DemoReport = asyncio.run(run_demo(args.options, progress=line))
    except DemoError as exc:
        line.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NemoCkptError as exc:  # ClusterConnectionError, StartupCheckError ...
        # Expected failures (no cluster, a checkpoint folder the nodes do not share ...):
        # what happened and what to do, without a traceback.
        line.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        line.close()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    total = time.monotonic() - started
    # The JSON goes first: nothing printed below can lose a finished run's result.
    json_problem = None
    if args.json is not None:
        data = report.to_json()
        data["wall_seconds_with_cluster"] = total
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            json_problem = f"could not write the report to {args.json}: {exc}"
    print()
    print(f"turn-level recovery: {report.nodes} nodes, seed {report.seed}, "
          f"restored from {report.restored_from}")
    print(format_report(report))
    print(f"  {'wall time':<24}  {total:.1f} s (crash run {report.crash_run_seconds:.1f} s, "
          f"reference run {report.reference_run_seconds:.1f} s)")
    if report.mismatched_rollouts:
        print(f"rollouts that differ from the crash-free run: "
              f"{', '.join(report.mismatched_rollouts[:20])}")
    if report.mismatched_directories:
        print(f"rollouts whose final directory differs from the crash-free run's: "
              f"{', '.join(report.mismatched_directories[:20])}")
    dirs = " and every rollout's directory, byte for byte" if report.sandboxes else ""
    print(f"VERIFIED: the final trajectories equal the crash-free run's, turn by turn{dirs}"
          if report.verified else "NOT VERIFIED: the runs differ")
    if json_problem is not None:
        sys.stdout.flush()
        print(f"error: {json_problem}; the report above is the run's result", file=sys.stderr)
        return 1
    return 0 if report.verified else 1


if __name__ == "__main__":
    sys.exit(main())
