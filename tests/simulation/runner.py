"""Runs many seeded schedules of the deterministic simulation on several processes, or
replays one with its trace; prints each violated case with its first seed and the
command that replays it."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .checkers import case_of
from .plan import Plan
from .schedule import Schedule
from .state import Result

DESCRIPTION = ("The deterministic simulation: many seeded schedules of the real driver, "
               "coordinator and holders, with environment workers running turns, RL's "
               "ledger and barrier, retire, a crash and restore, a second driver, and "
               "faults at any await; invariants after each.")
REPLAY = ".venv/bin/python -m tests.simulation --replay {seed}"


def _scratch_root() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="nemo-ckpt-sim-",
                                 dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))


def run_one(seed: int, tracing: bool = False) -> Result:
    root = _scratch_root()
    # The collector off while the schedule runs: when it runs (and finalizes what the
    # schedule dropped) depends on the process's allocations, not on the seed.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with _quiet():
            try:
                return Schedule(seed, root, tracing).run()
            finally:
                # What the schedule dropped, finalized now (its futures' "never retrieved"
                # warnings included). With the collector off, everything the schedule made
                # is still in the youngest generation: collecting only that one spares a
                # long test session's heap, which a full collection walked per schedule.
                gc.collect(0)
    finally:
        if collecting:
            gc.enable()
        shutil.rmtree(root, ignore_errors=True)


def _run_range(args: tuple[int, int]) -> tuple[int, int, list[Result]]:
    first, count = args
    faults = 0
    bad = []
    for seed in range(first, first + count):
        result = run_one(seed)
        faults += result.faults
        if result.violations:
            bad.append(result)
    return count, faults, bad


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The package's and asyncio's loggers silenced while a schedule runs, then as they
    were: a test process goes on with its own logging. A schedule's faults log thousands
    of warnings, which a test's log capture would format and keep (tripling its time)."""
    loggers = [logging.getLogger("nemo_ckpt"), logging.getLogger("asyncio")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


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
    parser = argparse.ArgumentParser(prog="python -m tests.simulation", description=DESCRIPTION)
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--replay", type=int, metavar="SEED",
                        help="run one schedule and print its trace")
    args = parser.parse_args(argv)
    with _quiet():
        return _main(args)


def _main(args: argparse.Namespace) -> int:
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
