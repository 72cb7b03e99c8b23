#!/usr/bin/env python3
"""Sample the coordinator, one holder and the driver with py-spy during snapshots and
restores, and print where their CPU time goes (idle threads left out).

py-spy is not a dependency of the project; install it for an investigation only:
``.venv/bin/pip install py-spy``. It needs ptrace rights over the Ray processes (root, or
``kernel.yama.ptrace_scope=0``).

    python -m benchmarks.profile_snapshot --holders 4 --sessions 10000 --state-bytes 1024
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import LocalCluster, MiB, actor_pid, holder_pid, populate

# Frames where a thread waits rather than works.
_IDLE = ("thread.py:81)", "Condition.wait", "worker.py:1069)", "EpollSelector.select",
         "Event.wait", "listen_error_messages", "PythonGCThread.run", "select (selectors")


def summarize(path: Path, top: int) -> str:
    """Inclusive and self shares of the busy samples of a py-spy raw (collapsed) file."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or any(mark in stack for mark in _IDLE):
            continue
        n = int(count)
        total += n
        frames = [f for f in stack.split(";") if f]
        for frame in set(frames):
            inclusive[frame] += n
        if frames:
            own[frames[-1]] += n
    lines = [f"{total} busy samples"]
    if not total:
        return lines[0]
    lines.append("  inclusive:")
    lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(top)]
    lines.append("  self:")
    lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top // 2)]
    return "\n".join(lines)


async def run(args: argparse.Namespace, out: Path) -> dict[str, Path]:
    from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint

    ns = f"profile-{uuid.uuid4().hex[:6]}"
    cfg = CheckpointConfig(allow_unchecked_snapshots=True,
                           namespace=ns, lease_s=120.0, phase_timeout_s=120.0)
    ckpt = RayEnvironmentCheckpoint(cfg)
    work = Path(tempfile.mkdtemp(prefix="nemo-ckpt-profile-"))
    spies: list[subprocess.Popen[bytes]] = []
    files: dict[str, Path] = {}
    try:
        infos = await ckpt.ensure_holders()
        instances = [i.instance_id for i in infos]
        await populate(ns, instances, args.sessions, args.state_bytes, 0)
        async with ckpt.snapshot(work / "warmup"):
            pass
        pids = {"coordinator": actor_pid(ns, cfg.coordinator_name),
                "holder-0": holder_pid(ns, instances[0]), "driver": os.getpid()}
        for name, pid in pids.items():
            files[name] = out / f"{name}.txt"
            spies.append(subprocess.Popen(
                [args.py_spy, "record", "--pid", str(pid), "--rate", str(args.rate),
                 "--format", "raw", "--idle", "-o", str(files[name])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        await asyncio.sleep(2.0)  # py-spy attaches
        t = time.perf_counter()
        for r in range(args.snapshots):
            async with ckpt.snapshot(work / f"s{r}"):
                pass
            if r:
                shutil.rmtree(work / f"s{r - 1}", ignore_errors=True)
        print(f"{args.snapshots} snapshots in {time.perf_counter() - t:.1f} s (py-spy at "
              f"{args.rate} Hz slows everything down)")
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(timeout=30)
        with contextlib.suppress(Exception):
            ckpt.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return files


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--holders", type=int, default=4)
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--state-bytes", type=int, default=1024)
    p.add_argument("--snapshots", type=int, default=20)
    p.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=24)
    p.add_argument("--out", type=Path, default=None,
                   help="keep the raw py-spy files here (default: a temporary folder)")
    p.add_argument("--py-spy", default=shutil.which("py-spy")
                   or str(Path(sys.executable).parent / "py-spy"))
    args = p.parse_args()
    if not Path(args.py_spy).exists():
        print("py-spy not found: .venv/bin/pip install py-spy", file=sys.stderr)
        return 1
    out = args.out or Path(tempfile.mkdtemp(prefix="nemo-ckpt-pyspy-"))
    out.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(2048 * MiB)
    try:
        cluster.grow_to(args.holders)
        files = asyncio.run(run(args, out))
    finally:
        cluster.shutdown()
    for name, path in files.items():
        print(f"\n== {name} ({path})")
        print(summarize(path, args.top) if path.exists() else "no samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
