"""The CPU the same Python work costs on each interpreter the machine has: why ``make``
makes ``.venv`` from the system's ``/usr/bin/python3`` where it can (``Makefile``,
``PYTHON``). The baseline is the ``python3`` first on the path (pyenv's, here).

``python -m benchmarks.interpreters [--repeats N] [--python PATH ...]``. Each workload
runs in a fresh process of each interpreter in turn, ``--repeats`` times (alternating, so
that a noisy machine slows both alike). Standard library only, so that any interpreter
runs it without a venv; each stands for a part of ``make test``:

- ``asyncio``: tasks, timers and futures on one event loop (the simulation's schedules);
- ``codecs``: JSON and pickle round trips of nested records (messages and snapshots);
- ``imports``: a fresh process importing a broad set of the standard library, 10 times
  (a Ray worker's start is mostly imports: ``benchmarks.actor_startup``).

Fields: ``cpu_s``, the child's user + system CPU seconds (median of the repeats);
``x_base``, ``cpu_s`` over the baseline's in the same run.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys

from benchmarks.common import format_table, git_state, median

ASYNCIO = """
import asyncio
async def worker(n):
    loop = asyncio.get_running_loop()
    for i in range(n):
        await asyncio.sleep(0)
        fut = loop.create_future()
        loop.call_later(0.0, fut.set_result, i)
        await fut
async def main():
    await asyncio.gather(*(worker(400) for _ in range(300)))
asyncio.run(main())
"""

CODECS = """
import json, pickle
record = {"rollout": "r-%d" % 7, "turns": [{"i": i, "text": "x" * 64, "keys": [str(i)] * 4}
                                         for i in range(40)], "state": list(range(200))}
for _ in range(1500):
    json.loads(json.dumps(record, sort_keys=True))
    pickle.loads(pickle.dumps(record))
"""

IMPORTS = """
import subprocess, sys
code = ("import asyncio, json, logging, email.parser, http.client, urllib.request, ssl, "
        "concurrent.futures, dataclasses, typing, inspect, argparse, decimal, tarfile, "
        "zipfile, xml.etree.ElementTree, unittest, uuid, sqlite3, html.entities")
for _ in range(10):
    subprocess.run([sys.executable, "-c", code], check=True)
"""

WORKLOADS = {"asyncio": ASYNCIO, "codecs": CODECS, "imports": IMPORTS}


def _cpu_s(python: str, code: str) -> float:
    """The user + system CPU of ``python -c code`` and of its children."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([python, "-c", code], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _interpreters(given: list[str]) -> list[str]:
    """The baseline (the path's ``python3``) first, then each other one, once each."""
    found = given or [p for p in (shutil.which("python3", path=_path_outside_venv()),
                                  "/usr/bin/python3") if p]
    seen: dict[str, str] = {}
    for python in found:
        # The interpreter itself, not a launcher in front of it (pyenv's shim is a shell
        # script, whose own start would count against it).
        real = subprocess.run([python, "-c", "import sys; print(sys.executable)"],
                              capture_output=True, text=True, check=True).stdout.strip()
        seen.setdefault(os.path.realpath(real), real)
    return list(seen.values())


def _path_outside_venv() -> str:
    venv = os.environ.get("VIRTUAL_ENV", sys.prefix)
    return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if not p.startswith(venv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.interpreters",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--python", action="append", default=[],
                        help="an interpreter to measure (repeatable); the first is the "
                             "baseline (default: the path's python3, then /usr/bin/python3)")
    args = parser.parse_args(argv)
    pythons = _interpreters(args.python)
    if len(pythons) < 2:
        print(f"only one interpreter here ({pythons}): nothing to compare")
        return 0
    versions = {p: subprocess.run([p, "-c", "import sys; print(sys.version.split()[0])"],
                                  capture_output=True, text=True, check=True).stdout.strip()
                for p in pythons}
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for name, code in WORKLOADS.items():
            for python in pythons:
                samples.setdefault((name, python), []).append(_cpu_s(python, code))
    rows = []
    for name in WORKLOADS:
        base = median(samples[(name, pythons[0])])
        for python in pythons:
            cpu = median(samples[(name, python)])
            rows.append((name, f"{python} ({versions[python]})", f"{cpu:.3f}",
                         f"{cpu / base:.2f}x"))
    print(f"commit {git_state()['commit']}, load average {os.getloadavg()[0]:.2f}")
    print("\n".join(format_table(("workload", "interpreter", "cpu_s", "x_base"), rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
