"""Sandbox directories against restic and tar (issue 26): the same sandboxes snapshotted,
changed, snapshotted again and restored by each, in one run, with every target printed
HOLDS or MISSED and its ratio to restic's figure of the same run.

``--sandboxes`` directories (1,000), each a copy of one generated repository of
``--files`` small source-like files (1,000 of about 1 KiB), are owned by as many sessions
of one job on an embedded single-node Ray instance. Then, for each tool:

1. the first snapshot: nemo-ckpt's sessions opened with their directories (each scanned
   once) and its first snapshot; ``restic backup`` of every directory into a fresh local
   repository; ``tar`` of every directory (the naive floor: a full copy each time);
2. one turn per sandbox that rewrites one small file: nemo-ckpt's turn commits (each
   scans its changed directory; timed whole, the Ray call included);
3. the next snapshot: its pause, its time and the bytes it added to the store, against
   ``restic backup``'s time and its repository's growth, and a second ``tar``;
4. a restore of every directory into a fresh place (nemo-ckpt: a fresh job on an empty
   sandbox root), ``sync`` included, checked against what was captured. restic restores
   before and after nemo-ckpt (the disk's speed drifts here), and counts their mean.
   Each restore goes into an ext4 filesystem made for it alone, in a file on the same
   disk (``fresh_filesystem``): ext4 gives out a new inode only after checking, one by
   one, that the free ones near it were not deleted in the last minutes
   (``recently_deleted``), so on the shared filesystem every restore paid for the files
   the run, and earlier runs and tests, had just removed (a profile of file creation
   there: half its time in that check), and by how recently, not by what it did.
   Without root, ``mkfs.ext4`` or ``mount`` the run says so and restores in place.

restic is found at ``.venv/restic/usr/bin/restic`` (``make restic``) or on PATH; without
it the run says so and prints nemo-ckpt's and tar's figures.

    .venv/bin/python -m benchmarks.sandboxes_vs_restic            # 1,000 x 1,000 files
    .venv/bin/python -m benchmarks.sandboxes_vs_restic --quick    # 100 sandboxes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ray

from benchmarks.common import print_verdicts
from benchmarks.sandboxes import pause_s
from nemo_ckpt import RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.storage.snapshot_files import read_manifest

PER_DIR = 33  # files per directory of the generated repository
STATE = b"s" * 32  # each session's own state: small, the directories are what is measured
PAUSE_ROUNDS = 5  # further snapshots after the next one, for a median pause
CHECKED = 5  # restored directories compared with what was captured, per tool
_WORDS = ("self", "value", "result", "items", "config", "path", "count", "index", "name",
          "data", "key", "node", "state", "buffer", "offset", "length", "record", "entry")


def source_file(rng: random.Random, size: int) -> bytes:
    """About ``size`` bytes of Python-like text: what a repository's small files hold."""
    lines = [f'"""Module {rng.randrange(1 << 30):x}."""\n']
    total = len(lines[0])
    while total < size:
        a, b, c = rng.choice(_WORDS), rng.choice(_WORDS), rng.choice(_WORDS)
        line = (f"def {a}_{rng.randrange(1000)}({b}, {c}):\n"
                f"    return {b}.{c} + {rng.randrange(1 << 16)}\n")
        lines.append(line)
        total += len(line)
    return "".join(lines).encode()[:size]


def make_repository(files: int, file_bytes: int) -> dict[str, bytes]:
    rng = random.Random(0)
    return {f"pkg{i // PER_DIR:03d}/mod{i:04d}.py": source_file(rng, file_bytes)
            for i in range(files)}


def write_tree(target: Path, contents: dict[str, bytes]) -> None:
    for rel, data in contents.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def tree_digest(contents: dict[str, bytes]) -> bytes:
    h = hashlib.sha256()
    for rel in sorted(contents):
        h.update(rel.encode() + b"\0" + hashlib.sha256(contents[rel]).digest())
    return h.digest()


def read_tree(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in directory.rglob("*") if p.is_file()}


def folder_bytes(root: Path) -> int:
    """The bytes of every file below ``root`` (what a store holds, as written)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def remove(path: Path) -> None:
    subprocess.run(["rm", "-rf", "--", os.fspath(path)], check=True)


def timed(fn: object, *args: object) -> float:
    os.sync()  # what earlier steps wrote is not this measurement's to flush
    t = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    os.sync()
    return time.perf_counter() - t


def can_make_filesystems() -> str | None:
    """Why ``fresh_filesystem`` cannot make a filesystem here, or None when it can."""
    if os.geteuid() != 0:
        return "not root"
    missing = [t for t in ("mkfs.ext4", "mount", "umount") if shutil.which(t) is None]
    return f"{', '.join(missing)} not found" if missing else None


@contextlib.contextmanager
def fresh_filesystem(work: Path, name: str, files: int) -> Iterator[Path]:
    """An empty directory on an ext4 filesystem made for this one use, from a sparse
    file in ``work`` (a loop device on the same disk), with inodes and blocks for
    ``files`` small files; unmounted and removed after. Where ``can_make_filesystems``
    says no, or making or mounting it fails (a container without loop devices), a plain
    directory in ``work``, and the run says so."""
    image, mount = work / f"{name}.ext4", work / f"{name}.mnt"
    why = can_make_filesystems()
    if why is None:
        try:
            _make_filesystem(image, mount, files)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", None) or exc
            why = f"could not make one: {str(detail).strip()}"
            image.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                mount.rmdir()
    if why is not None:
        print(f"{name}: restores in place, not into a fresh filesystem ({why})")
        place = work / name
        place.mkdir()
        try:
            yield place
        finally:
            remove(place)
        return
    try:
        (mount / name).mkdir()
        yield mount / name
    finally:
        # A process still in it (a holder not yet gone): detach now, freed when it is.
        if subprocess.run(["umount", os.fspath(mount)]).returncode != 0:
            subprocess.run(["umount", "-l", os.fspath(mount)], check=True)
        image.unlink(missing_ok=True)
        mount.rmdir()


def _make_filesystem(image: Path, mount: Path, files: int) -> None:
    """ext4 in the sparse file ``image``, mounted at ``mount`` (made here)."""
    with open(image, "wb") as f:
        f.truncate(max(2 << 30, 3 * 4096 * files))  # each small file takes a 4 KiB block
    mount.mkdir()
    for command in (["mkfs.ext4", "-q", "-F", "-i", "4096", os.fspath(image)],
                    ["mount", "-o", "loop", os.fspath(image), os.fspath(mount)]):
        subprocess.run(command, check=True, capture_output=True, text=True)


def find_restic() -> str | None:
    local = Path(__file__).resolve().parents[1] / ".venv" / "restic" / "usr" / "bin" / "restic"
    if local.is_file() and os.access(local, os.X_OK):
        return os.fspath(local.resolve())
    return shutil.which("restic")


class Restic:
    """restic on a local repository; its password from ``RESTIC_PASSWORD`` (a fixed one
    for the benchmark when unset), its cache in the run's folder."""

    def __init__(self, binary: str, work: Path) -> None:
        self.binary = binary
        self.repo = work / "restic-repo"
        self.env = dict(os.environ, RESTIC_REPOSITORY=os.fspath(self.repo),
                        RESTIC_CACHE_DIR=os.fspath(work / "restic-cache"),
                        RESTIC_PASSWORD=os.environ.get("RESTIC_PASSWORD", "nemo-ckpt-bench"))

    def __call__(self, *args: str) -> str:
        done = subprocess.run([self.binary, "--quiet", *args], env=self.env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"restic {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def version(self) -> str:
        return self("version").strip()


@dataclass
class Figures:
    """One tool's figures (seconds, bytes); None where it was not measured."""

    first_s: float | None = None
    first_bytes: int | None = None
    next_s: float | None = None
    next_bytes: int | None = None
    restore_s: list[float] = field(default_factory=list)


async def run(args: argparse.Namespace, work: Path
              ) -> tuple[dict[str, Figures], dict[str, float], list[tuple[str, bool, str]]]:
    n, files = args.sandboxes, args.files
    repo = make_repository(files, args.file_bytes)
    repo_bytes = sum(len(v) for v in repo.values())
    sandbox_root = work / "sandboxes"
    dirs = [sandbox_root / "work" / f"s{i:05d}" for i in range(n)]
    t = time.perf_counter()
    for d in dirs:
        write_tree(d, repo)
    os.sync()
    print(f"made {n} sandboxes of {files} files ({n * repo_bytes / 1e6:.0f} MB) in "
          f"{time.perf_counter() - t:.1f} s")

    binary = find_restic()
    restic = None
    if binary is None:
        print("restic not found (.venv/restic/usr/bin/restic or PATH; `make restic`): "
              "its figures and the targets against it are left out")
    else:
        restic = Restic(binary, work)
        print(f"{restic.version()}, repository {restic.repo}")
    figs = {"restic": Figures(), "nemo-ckpt": Figures(), "tar": Figures()}
    extra: dict[str, float] = {}
    backup = ["backup", "--host", "bench", os.fspath(sandbox_root / "work")]

    # 1. The first snapshot.
    if restic is not None:
        restic("init")
        config_json = json.loads(restic("cat", "config"))
        print(f"restic repository version {config_json.get('version')} (version 2 "
              f"compresses)")
        before = folder_bytes(restic.repo)
        figs["restic"].first_s = timed(restic, *backup)
        figs["restic"].first_bytes = folder_bytes(restic.repo) - before
    tars = work / "tar"
    tars.mkdir()

    def tar(archive: Path) -> None:
        subprocess.run(["tar", "-cf", os.fspath(archive), "-C", os.fspath(sandbox_root),
                        "work"], check=True)

    figs["tar"].first_s = timed(tar, tars / "1.tar")
    figs["tar"].first_bytes = (tars / "1.tar").stat().st_size
    remove(tars / "1.tar")

    root = work / "ckpt"
    config = CheckpointConfig(allow_unchecked_snapshots=True, namespace="restic-a",
                              checkpoint_root=root, sandbox_root=sandbox_root,
                              persist_timeout_s=3600, phase_timeout_s=600)
    ckpt = RayEnvironmentCheckpoint(config)
    await ckpt.ensure_holders()
    client = await SessionClient.connect(namespace="restic-a")
    eps = [EnvironmentEpisode(f"r{i:05d}", 0) for i in range(n)]
    os.sync()
    t = time.perf_counter()
    for k in range(0, n, 100):
        await client.open_many([(ep, STATE, str(d))  # type: ignore[misc]
                                for ep, d in zip(eps[k:k + 100], dirs[k:k + 100],
                                                 strict=True)])
    extra["open_s"] = time.perf_counter() - t
    t = time.perf_counter()
    async with ckpt.snapshot(root / "s-0001"):
        pass
    os.sync()
    extra["first_snapshot_s"] = time.perf_counter() - t
    figs["nemo-ckpt"].first_s = extra["open_s"] + extra["first_snapshot_s"]
    figs["nemo-ckpt"].first_bytes = folder_bytes(root)

    # 2. One turn per sandbox: one small file rewritten, then the turn commits.
    rng = random.Random(2)
    expected: dict[str, bytes] = {}  # each sandbox's tree digest, as its turn left it
    turns = 0.0
    packages = files // PER_DIR or 1
    for i, (ep, d) in enumerate(zip(eps, dirs, strict=True)):
        package = i % packages  # the first file of one of its packages
        rel = f"pkg{package:03d}/mod{package * PER_DIR:04d}.py"
        data = source_file(rng, len(repo[rel]))
        (d / rel).write_bytes(data)
        expected[d.name] = tree_digest({**repo, rel: data})
        t = time.perf_counter()
        async with client.turn(ep) as turn:
            turn.complete(b"turn", STATE)
        turns += time.perf_counter() - t
    extra["turns_s"] = turns

    # 3. The next snapshot.
    before_bytes = folder_bytes(root)
    t = time.perf_counter()
    async with ckpt.snapshot(root / "s-0002"):
        extra["pause_s"] = time.perf_counter() - t
    os.sync()
    figs["nemo-ckpt"].next_s = time.perf_counter() - t
    figs["nemo-ckpt"].next_bytes = folder_bytes(root) - before_bytes
    extra["bytes_written"] = read_manifest(root / "s-0002").metrics["bytes_written"]
    pauses = [await pause_s(ckpt, root / f"p-{k}") for k in range(PAUSE_ROUNDS)]
    extra["pause_median_s"] = statistics.median(pauses)
    ckpt.shutdown()
    if restic is not None:
        before = folder_bytes(restic.repo)
        figs["restic"].next_s = timed(restic, *backup)
        figs["restic"].next_bytes = folder_bytes(restic.repo) - before
    figs["tar"].next_s = timed(tar, tars / "2.tar")
    figs["tar"].next_bytes = (tars / "2.tar").stat().st_size
    await asyncio.sleep(1)

    # 4. A restore of every directory, each into a filesystem of its own.
    remove(sandbox_root)
    why_not = can_make_filesystems()
    print("restores into fresh ext4 filesystems on this disk" if why_not is None else
          f"restores in place, not into fresh filesystems ({why_not}): the figures "
          f"count ext4's skipping of recently deleted inodes")
    sample = random.Random(3).sample(range(n), min(CHECKED, n))

    def check(tool: str, restored: list[Path]) -> None:
        got = {p.name: p for p in restored}
        if len(restored) != n:
            raise AssertionError(f"{tool} restored {len(restored)} directories, not {n}")
        for i in sample:
            digest = tree_digest(read_tree(got[dirs[i].name]))
            if digest != expected[dirs[i].name]:
                raise AssertionError(f"{tool} restored {dirs[i].name} with other files")

    def restic_restore(name: str) -> None:
        assert restic is not None
        with fresh_filesystem(work, name, n * files) as target:
            figs["restic"].restore_s.append(timed(
                restic, "restore", "latest", "--host", "bench", "--target",
                os.fspath(target)))
            check("restic", sorted(Path(os.fspath(target) + os.fspath(sandbox_root / "work"))
                                   .iterdir()))

    if restic is not None:
        restic_restore("restic-restore-1")
    with fresh_filesystem(work, "nemo-ckpt-restore", n * files) as restore_root:
        fresh = RayEnvironmentCheckpoint(CheckpointConfig(
            allow_unchecked_snapshots=True, namespace="restic-b", checkpoint_root=root,
            sandbox_root=restore_root, persist_timeout_s=3600, phase_timeout_s=600))
        await fresh.ensure_holders()
        os.sync()
        t = time.perf_counter()
        async with fresh.restored(root / "s-0002") as restored:
            pass
        extra["restore_call_s"] = time.perf_counter() - t
        os.sync()
        figs["nemo-ckpt"].restore_s.append(time.perf_counter() - t)
        fresh.shutdown()
        assert len(restored.continued_attempts) == n
        made = [p for p in restore_root.iterdir() if not p.name.startswith(".")]
        # A restored directory is named for its new attempt: match it by its files.
        digests = {tree_digest(read_tree(p)) for p in made[:CHECKED]}
        if len(made) != n or not digests <= set(expected.values()):
            raise AssertionError("nemo-ckpt restored other directories than it captured")

    with fresh_filesystem(work, "tar-restore", n * files) as target:
        def untar() -> None:
            subprocess.run(["tar", "-xf", os.fspath(tars / "2.tar"), "-C",
                            os.fspath(target)], check=True)

        figs["tar"].restore_s.append(timed(untar))
        check("tar", sorted((target / "work").iterdir()))
    if restic is not None:
        restic_restore("restic-restore-2")
    return figs, extra, targets(figs, extra, n)


def targets(figs: dict[str, Figures], extra: dict[str, float], n: int
            ) -> list[tuple[str, bool, str]]:
    r, nc = figs["restic"], figs["nemo-ckpt"]
    if r.next_s is None or r.next_bytes is None or not r.restore_s:
        return []
    assert nc.next_s is not None and nc.next_bytes is not None
    out = []
    ratio = extra["pause_s"] / r.next_s
    out.append(("the pause a snapshot adds <= 0.05x restic's next backup", ratio <= 0.05,
                f"{extra['pause_s'] * 1000:.1f} ms (median of {PAUSE_ROUNDS} more: "
                f"{extra['pause_median_s'] * 1000:.1f} ms) vs {r.next_s:.2f} s = {ratio:.4f}x"))
    interval = extra["turns_s"] + nc.next_s
    ratio = interval / r.next_s
    out.append(("one snapshot interval's work (turn commits + snapshot) <= 1x restic's "
                "next backup", ratio <= 1.0,
                f"{interval:.2f} s ({n} turn commits through Ray, each scanning its "
                f"directory, {extra['turns_s']:.2f} s; the snapshot {nc.next_s:.2f} s) vs "
                f"{r.next_s:.2f} s = {ratio:.2f}x"))
    ratio = nc.next_bytes / r.next_bytes
    out.append(("the next snapshot's bytes <= restic's repository growth",
                ratio <= 1.0,
                f"{nc.next_bytes / 1e6:.2f} MB (the store's growth, manifest included; "
                f"bytes_written {extra['bytes_written'] / 1e6:.2f} MB) vs "
                f"{r.next_bytes / 1e6:.2f} MB = {ratio:.2f}x"))
    restic_restore = statistics.mean(r.restore_s)
    ratio = nc.restore_s[0] / restic_restore
    out.append(("the restore of every directory <= 0.5x restic's restore", ratio <= 0.5,
                f"{nc.restore_s[0]:.2f} s vs {restic_restore:.2f} s (mean of "
                f"{', '.join(f'{s:.2f}' for s in r.restore_s)}) = {ratio:.2f}x"))
    return out


def table(figs: dict[str, Figures]) -> list[str]:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def mb(x: int | None) -> str:
        return "-" if x is None else f"{x / 1e6:.2f}"

    rows = ["| tool | first s | first MB | next s | next MB | restore s |",
            "|---|---|---|---|---|---|"]
    for name, f in figs.items():
        restore = statistics.mean(f.restore_s) if f.restore_s else None
        rows.append(f"| {name} | {s(f.first_s)} | {mb(f.first_bytes)} | {s(f.next_s)} | "
                    f"{mb(f.next_bytes)} | {s(restore)} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sandboxes", type=int, default=1000)
    p.add_argument("--files", type=int, default=1000)
    p.add_argument("--file-bytes", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="100 sandboxes")
    args = p.parse_args(argv)
    if args.quick:
        args.sandboxes = 100
    work = Path(tempfile.mkdtemp(prefix="nemo-ckpt-restic-"))
    # A new instance of its own, even where another cluster on this machine would be
    # joined by default.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    start = time.perf_counter()
    try:
        figs, extra, results = asyncio.run(run(args, work))
    finally:
        ray.shutdown()
        remove(work)
    print(f"\n{args.sandboxes} sandboxes x {args.files} files of {args.file_bytes} bytes, "
          f"one file changed in each between the snapshots; sync included "
          f"({time.perf_counter() - start:.0f} s in all)\n")
    print("\n".join(table(figs)))
    print(f"\nnemo-ckpt: first = sessions opened (each directory scanned) "
          f"{extra['open_s']:.2f} s + snapshot {extra['first_snapshot_s']:.2f} s; "
          f"turn commits {extra['turns_s']:.2f} s; next snapshot's pause "
          f"{extra['pause_s'] * 1000:.1f} ms; restore = the call "
          f"{extra['restore_call_s']:.2f} s + sync "
          f"{figs['nemo-ckpt'].restore_s[0] - extra['restore_call_s']:.2f} s\n")
    if not results:
        print("  (no targets: restic was not run)")
    print_verdicts(results)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
