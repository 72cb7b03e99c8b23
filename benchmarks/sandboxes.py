"""Sandbox directories (issue 13): what they cost at a turn commit, in a snapshot and a
restore, with every target printed HOLDS or MISSED and each ratio against a baseline
measured in the same run.

One embedded single-node Ray instance. ``--sandboxes`` directories, each a copy of one
repository of ``--files`` files of ``--file-bytes`` bytes, are owned by as many
sessions of one job (A); job B holds the same sessions without directories. Then:

1. the store after A's first snapshot, against one repository;
2. one turn per sandbox that rewrites one small file; the tree capture at its commit,
   timed in-process on a copy of a sandbox (the holder's own code, without the call);
3. A's second snapshot: the bytes it wrote against a full copy of every directory, and
   the store against one repository plus the changed bytes;
4. the pause of A against B's (alternately first, medians);
5. A's snapshot restored into a fresh job with an empty node: the directories'
   materialization against writing the same files straight from memory.

    .venv/bin/python -m benchmarks.sandboxes            # 1,000 x 1,000 files of 10 kB
    .venv/bin/python -m benchmarks.sandboxes --quick    # 100 sandboxes
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import time
from pathlib import Path

from actors.holder.sandboxes import Sandboxes
from benchmarks.common import on_local_ray, print_verdicts
from nemo_ckpt import RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.storage.snapshot_files import read_manifest

PAUSE_ROUNDS = 15


def make_repository(where: Path, files: int, file_bytes: int, seed: int = 0) -> int:
    """``files`` files of random bytes in ~33-file directories; returns their bytes."""
    rng = random.Random(seed)
    per_dir = 33
    for i in range(files):
        d = where / f"pkg{i // per_dir:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i:04d}.py").write_bytes(rng.randbytes(file_bytes))
    return files * file_bytes


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "blobs").rglob("*") if p.is_file()
               and not p.name.startswith("."))


def write_files(target: Path, contents: dict[str, bytes]) -> None:
    """The baseline of a restore: the same files, written straight from memory."""
    for rel, data in contents.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def stat_walk_ms(root: Path, rounds: int) -> list[float]:
    """The floor of any scan that checks every file: list every directory, lstat
    every entry, nothing else."""
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        pending = [os.fspath(root)]
        while pending:
            for item in os.scandir(pending.pop()):
                item.stat(follow_symlinks=False)
                if item.is_dir(follow_symlinks=False):
                    pending.append(item.path)
        out.append((time.perf_counter() - t) * 1000)
    return out


def tree_capture_ms(repo: Path, work: Path, rounds: int) -> list[float]:
    """Each round rewrites one file of a sandbox copy, then records its tree as the
    holder does at a turn commit (``Sandboxes.record``)."""
    sandbox = work / "capture"
    shutil.copytree(repo, sandbox, symlinks=True)
    boxes = Sandboxes("bench", str(work), None)
    files = sorted(p for p in sandbox.rglob("*.py"))
    recorded = boxes.record(sandbox, None)
    time.sleep(0.05)  # past the racy window: only changed files are re-read from here
    recorded = boxes.record(sandbox, recorded)
    rng = random.Random(1)
    out = []
    for i in range(rounds):
        path = files[(i * 37) % len(files)]
        path.write_bytes(rng.randbytes(path.stat().st_size))
        t = time.perf_counter()
        recorded = boxes.record(sandbox, recorded)
        out.append((time.perf_counter() - t) * 1000)
    return out


async def pause_s(ckpt: RayEnvironmentCheckpoint, path: Path) -> float:
    """Seconds from the snapshot's start to its yield: the holders are paused for it."""
    t = time.perf_counter()
    async with ckpt.snapshot(path):
        paused = time.perf_counter() - t
    return paused


async def run(args: argparse.Namespace, work: Path) -> list[tuple[str, bool, str]]:
    n, files, file_bytes = args.sandboxes, args.files, args.file_bytes
    repo_bytes = files * file_bytes
    repo = work / "repository"
    make_repository(repo, files, file_bytes)
    sandbox_root = work / "sandboxes"
    root = work / "ckpt"
    t = time.perf_counter()
    dirs = []
    for i in range(n):
        d = sandbox_root / "work" / f"s{i:05d}"
        shutil.copytree(repo, d)
        dirs.append(d)
    print(f"made {n} sandboxes of {files} files ({n * repo_bytes / 1e9:.2f} GB) in "
          f"{time.perf_counter() - t:.1f} s")

    def config(namespace: str, sandboxes: bool) -> CheckpointConfig:
        return CheckpointConfig(allow_unchecked_snapshots=True,
                                namespace=namespace, checkpoint_root=root,
                                sandbox_root=sandbox_root if sandboxes else None,
                                persist_timeout_s=3600, phase_timeout_s=600)

    a = RayEnvironmentCheckpoint(config("bench-a", True))
    b = RayEnvironmentCheckpoint(config("bench-b", False))
    await a.ensure_holders()
    await b.ensure_holders()
    client_a = await SessionClient.connect(namespace="bench-a")
    client_b = await SessionClient.connect(namespace="bench-b")
    eps = [EnvironmentEpisode(f"r{i:05d}", 0) for i in range(n)]
    t = time.perf_counter()
    for k in range(0, n, 100):
        await client_a.open_many([(ep, b"s" * 1024, str(d))  # type: ignore[misc]
                                  for ep, d in zip(eps[k:k + 100], dirs[k:k + 100],
                                                   strict=True)])
    print(f"opened {n} sessions with directories in {time.perf_counter() - t:.1f} s "
          f"(each directory scanned and hashed once)")
    await client_b.open_many([(ep, b"s" * 1024) for ep in eps])

    results: list[tuple[str, bool, str]] = []
    first = root / "a-0001"
    async with a.snapshot(first):
        pass
    store_1 = store_bytes(root)
    ratio = store_1 / repo_bytes
    results.append(("store after the first snapshot <= 1.1x one repository", ratio <= 1.1,
                    f"{store_1 / 1e6:.1f} MB = {ratio:.3f}x one repository "
                    f"({repo_bytes / 1e6:.1f} MB), for {n} sandboxes"))

    # One turn per sandbox: rewrite one small file.
    rng = random.Random(2)
    changed = 0
    commit_ms = []
    for i, (ep, d) in enumerate(zip(eps, dirs, strict=True)):
        target = sorted((d / f"pkg{(i % (files // 33 or 1)):03d}").iterdir())[0]
        t = time.perf_counter()
        async with client_a.turn(ep) as turn:
            data = rng.randbytes(target.stat().st_size)
            target.write_bytes(data)
            changed += len(data)
            turn.complete(b"turn", b"s" * 1024)
        commit_ms.append((time.perf_counter() - t) * 1000)
    capture = tree_capture_ms(repo, work, 200)
    floor = statistics.median(stat_walk_ms(repo, 200))
    median = statistics.median(capture)
    results.append(("tree capture at turn commit, 1 file of 1,000 changed <= 5 ms median",
                    median <= 5.0,
                    f"{median:.2f} ms median, p90 {statistics.quantiles(capture, n=10)[-1]:.2f}"
                    f" ms over {len(capture)} commits of {files} files = {median / floor:.2f}x"
                    f" a bare lstat of every entry ({floor:.2f} ms); the whole turn through "
                    f"Ray, call included: {statistics.median(commit_ms):.1f} ms"))

    second = root / "a-0002"
    async with a.snapshot(second):
        pass
    written = int(read_manifest(second).metrics["bytes_written"])
    full = n * repo_bytes
    results.append(("second snapshot writes <= 1% of a full copy", written <= 0.01 * full,
                    f"{written / 1e6:.2f} MB = {100 * written / full:.3f}% of "
                    f"{full / 1e9:.2f} GB"))
    store_2 = store_bytes(root)
    budget = repo_bytes + changed
    results.append(("store <= 1.1x one repository plus the changed bytes",
                    store_2 <= 1.1 * budget,
                    f"{store_2 / 1e6:.1f} MB = {store_2 / budget:.3f}x "
                    f"({repo_bytes / 1e6:.1f} MB + {changed / 1e6:.1f} MB changed)"))

    with_dirs, without = [], []
    for k in range(PAUSE_ROUNDS):  # alternately first: neither always follows the other
        if k % 2:
            without.append(await pause_s(b, root / f"b-p{k}"))
        with_dirs.append(await pause_s(a, root / f"a-p{k}"))
        if not k % 2:
            without.append(await pause_s(b, root / f"b-p{k}"))
    pa, pb = statistics.median(with_dirs), statistics.median(without)
    results.append(("pause with sandboxes <= 1.2x without", pa <= 1.2 * pb,
                    f"{pa * 1000:.1f} ms vs {pb * 1000:.1f} ms = {pa / pb:.2f}x (medians of "
                    f"{PAUSE_ROUNDS}, {n} sessions each)"))
    a.shutdown()
    b.shutdown()
    await asyncio.sleep(1)

    # Restore A's second snapshot on an empty node: no cache, no directories.
    contents = {p.relative_to(dirs[0]).as_posix(): p.read_bytes()
                for p in dirs[0].rglob("*") if p.is_file()}
    shutil.rmtree(sandbox_root)
    sandbox_root.mkdir()
    base_dir = work / "baseline"

    def baseline_s() -> float:
        os.sync()  # what earlier steps wrote is not this measurement's to flush
        t = time.perf_counter()
        for i in range(n):
            write_files(base_dir / f"s{i:05d}", contents)
        os.sync()
        elapsed = time.perf_counter() - t
        shutil.rmtree(base_dir)
        return elapsed

    # This machine's disk speed drifts: the baseline is measured before and after.
    before = baseline_s()
    c = RayEnvironmentCheckpoint(config("bench-c", True))
    await c.ensure_holders()
    os.sync()
    t = time.perf_counter()
    async with c.restored(second) as restored:
        pass
    os.sync()
    restore = time.perf_counter() - t
    c.shutdown()
    after = baseline_s()
    baseline = (before + after) / 2
    assert len(restored.continued_attempts) == n
    ratio = baseline / restore
    total = n * repo_bytes
    results.append(("restore materializes at >= 0.5x the disk's write speed", ratio >= 0.5,
                    f"{total / restore / 1e6:.0f} MB/s vs {total / baseline / 1e6:.0f} MB/s "
                    f"writing the same files from memory (before {before:.1f} s, after "
                    f"{after:.1f} s) = {ratio:.2f}x ({restore:.1f} s for {n} directories, "
                    f"the shards' read and verification included)"))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sandboxes", type=int, default=1000)
    p.add_argument("--files", type=int, default=1000)
    p.add_argument("--file-bytes", type=int, default=10_000)
    p.add_argument("--quick", action="store_true", help="100 sandboxes")
    args = p.parse_args(argv)
    if args.quick:
        args.sandboxes = 100
    results = on_local_ray(lambda work: run(args, work), "nemo-ckpt-sandboxes-")
    print()
    print_verdicts(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
