"""A container recorded and created again by nemo-ckpt against podman's own checkpoint,
restore, export and import of the same container, in one run on this machine's podman
(``tests/container_runtime.py`` installs it: podman, runc, CRIU, a busybox image).

The container runs a shell holding ``--memory-mb`` (20) MB of random bytes as base64
text in a variable (~27 MB resident), and has a working tree under ``/work``: ``--files``
(2,000) files of 4 KiB and ``--big-files`` (4) of 1 MiB, each of its own random bytes.
Each operation is timed with a ``sync`` before and after, ``--repeats`` (5) times:

1. nemo-ckpt's recordings: ``ContainerSandboxes.record`` with memory (CRIU) into a fresh
   blob cache, then, after one small file changed, again with the first as the previous
   recording (next); the same two by a ``ContainerSandboxes(memory=False)`` (files only,
   another fresh cache);
2. podman's: ``podman container checkpoint --export --compress=none --leave-running``
   (the rootfs included, podman's default) and ``podman export`` (the filesystem as one
   tar);
3. the restores, each into a new container removed after, podman's first in every
   other repetition: nemo-ckpt's ``ContainerSandboxes.restore`` of the first recording
   with memory (created from its record, files copied in, its checked CRIU images
   restored by ``podman container restore``) and with ``memory = False`` (created
   from the image, files copied in, started afresh); ``podman container restore
   --import`` of podman's archive; ``podman import`` of its tar, then ``podman
   create`` and ``start`` (started afresh); and the floor: as many files of the
   tree's sizes written into a new folder on the host.

The recordings run before podman's checkpoints, so that neither sees the other's
leftovers; the benchmark checks that the changed file survives a recording. (Run
interleaved, it found that podman's checkpoint leaves its ``rootfs-diff.tar`` in the
container's folder, which the ``restore --keep`` ending a recording with memory applied
again; a recording now removes it first:
``test_a_recording_keeps_files_written_after_someone_elses_podman_checkpoint``.)

Printed: the median seconds of each (min-max), each of nemo-ckpt's figures over podman's
checkpoint or restore and over its export or import, where the time of nemo-ckpt's
capture and restore goes (the podman commands they run, the rest in-process), and the
bytes stored: the blobs a recording references (``RecordedContainer.blobs``, sizes from
the cache) against podman's archive and tar. Every container is named
``nemo-ckpt-bench-...`` and removed, as is the imported image. No targets.

    .venv/bin/python -m benchmarks.containers            # 5 repetitions, 2,000 files
    .venv/bin/python -m benchmarks.containers --quick    # 2 repetitions, 500 files
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import median
from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.containers.sandbox import ContainerSandboxes, RecordedContainer
from nemo_ckpt.trees.node_cache import BlobCache
from tests.container_runtime import Setup, ensure

PREFIX = "nemo-ckpt-bench-"
PER_DIR = 100  # files per folder of the working tree
SMALL = 4096
BIG = 1 << 20
READY_S = 120.0  # for the shell to fill its memory
CHANGED = "/work/pkg000/mod00000.py"  # the file a turn rewrites between two recordings
CAPTURES = ["record, memory + files, first", "record, memory + files, next",
            "record, files only, first", "record, files only, next"]
RESTORES = ["restore, memory + files", "restore, files only"]
CHECKPOINT, EXPORT = "podman checkpoint --export", "podman export"
RESTORE, IMPORT = "podman restore --import", "podman import + create + start"
FLOOR = "floor: the tree's files written to a new host folder"


class TimedPodman(Podman):
    """``Podman`` that adds up the seconds each kind of command took (``spent``)."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(env=env, timeout_s=600.0)
        self.spent: dict[str, float] = defaultdict(float)

    def run(self, *args: str, input: bytes | None = None, timeout_s: float | None = None,
            check: bool = True) -> subprocess.CompletedProcess[bytes]:
        t = time.perf_counter()
        try:
            return super().run(*args, input=input, timeout_s=timeout_s, check=check)
        finally:
            self.spent[_kind(args)] += time.perf_counter() - t


def _kind(args: tuple[str, ...]) -> str:
    """``container restore --import``, ``container checkpoint``, ``exec``, ..."""
    words = list(args[:2]) if args and args[0] in ("container", "image") else list(args[:1])
    if any(a.startswith("--import") for a in args):
        words.append("--import")
    return " ".join(words)


@dataclass
class Runs:
    """Each operation's seconds per repetition, and its podman commands' seconds."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    podman: dict[str, list[dict[str, float]]] = field(
        default_factory=lambda: defaultdict(list))
    stored: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    files_read: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))

    def time(self, what: str, podman: TimedPodman, fn: Callable[[], Any]) -> Any:
        os.sync()  # what earlier steps wrote is not this measurement's to flush
        podman.spent.clear()
        t = time.perf_counter()
        out = fn()
        os.sync()
        self.seconds[what].append(time.perf_counter() - t)
        self.podman[what].append(dict(podman.spent))
        return out


def hold_script(memory_mb: int) -> str:
    """The container's command: a shell holding ``memory_mb`` MB of random bytes as base64
    in a variable. The loop keeps the shell itself alive (ash would exec a last
    ``sleep``, dropping its memory)."""
    return (f"x=$(head -c {memory_mb * 1000 * 1000} /dev/urandom | base64); "
            f"touch /tmp/ready; while :; do sleep 3600; done")


def make_tree(target: Path, files: int, big_files: int) -> int:
    """The working tree on the host: its bytes."""
    rng = random.Random(0)
    total = 0
    for i in range(files):
        path = target / f"pkg{i // PER_DIR:03d}" / f"mod{i:05d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(SMALL))
        total += SMALL
    (target / "data").mkdir(parents=True, exist_ok=True)
    for i in range(big_files):
        (target / "data" / f"blob{i}.bin").write_bytes(rng.randbytes(BIG))
        total += BIG
    return total


def write_files(target: Path, files: int, big_files: int) -> None:
    """As many files as the working tree, of its sizes, into ``target`` (the floor of
    any restore of the tree: the kernel's cost of creating its files here)."""
    small, big = os.urandom(SMALL), os.urandom(BIG)
    for i in range(files):
        folder = target / f"pkg{i // PER_DIR:03d}"
        if i % PER_DIR == 0:
            folder.mkdir(parents=True)
        (folder / f"mod{i:05d}.py").write_bytes(small)
    (target / "data").mkdir(parents=True)
    for i in range(big_files):
        (target / "data" / f"blob{i}.bin").write_bytes(big)


def wait_ready(podman: Podman, name: str) -> None:
    deadline = time.monotonic() + READY_S
    while podman.run("exec", name, "test", "-e", "/tmp/ready", check=False).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not fill its memory within {READY_S:.0f} s")
        time.sleep(0.2)


def count_files(podman: Podman, name: str) -> int:
    return int(podman.text("exec", name, "sh", "-c", "find /work -type f | wc -l"))


def blob_bytes(cache: BlobCache, digests: Iterable[bytes]) -> int:
    total = 0
    for digest in digests:
        held = cache.held(digest)
        total += len(held) if held is not None else cache.path(digest).stat().st_size
    return total


def fetcher(sandboxes: ContainerSandboxes) -> Callable[[bytes, int], bytes]:
    def fetch(digest: bytes, size: int) -> bytes:
        data = sandboxes.cache.read(digest, size)
        if data is None:
            raise RuntimeError("a blob the record references is not in the cache")
        return data
    return fetch


class Bench:
    """One run: its containers and image, each removed by ``cleanup``."""

    def __init__(self, setup: Setup, work: Path, files: int, big_files: int) -> None:
        self.setup = setup
        self.podman = TimedPodman(setup.env)
        self.work = work
        self.files, self.big_files = files, big_files
        self.expected_files = files + big_files
        self.run_id = uuid.uuid4().hex[:8]
        self.names: list[str] = []
        self.images: list[str] = []
        self.runs = Runs()

    def name(self, what: str) -> str:
        name = f"{PREFIX}{self.run_id}-{what}"
        self.names.append(name)
        return name

    def cleanup(self) -> None:
        for name in self.names:
            self.podman.remove(name)
        for image in self.images:
            self.podman.run("image", "rm", "--force", image, check=False)

    def change(self, source: str, k: int) -> None:
        """One small file rewritten, as a turn would (not timed)."""
        self.podman.run("exec", source, "sh", "-c", f"echo turn-{k} > {CHANGED}")

    def changed(self, source: str, k: int) -> None:
        """The running container still holds the change after a recording."""
        if (got := self.podman.text("exec", source, "cat", CHANGED)) != f"turn-{k}":
            raise RuntimeError(f"{source}'s {CHANGED} holds {got!r} after the recording, "
                               f"not 'turn-{k}'")

    def check(self, name: str, rep: int) -> None:
        """The first repetition's restored containers hold the working tree."""
        if rep == 0 and (n := count_files(self.podman, name)) != self.expected_files:
            raise RuntimeError(f"{name} holds {n} files under /work, not "
                               f"{self.expected_files}")

    def discard(self, name: str) -> None:
        self.podman.remove(name)
        self.names.remove(name)

    def nemo_captures(self, source: str, rep: int) -> tuple[ContainerSandboxes,
                                                            RecordedContainer]:
        """One repetition of nemo-ckpt's recordings: the sandboxes with memory and their
        first recording, for the restores."""
        r, p = self.runs, self.podman
        folder = self.work / f"nemo-{rep}"
        staging = folder / "staging"
        mem = ContainerSandboxes(p, BlobCache(folder / "cache-memory"), staging)
        files = ContainerSandboxes(p, BlobCache(folder / "cache-files"), staging,
                                   memory=False)
        first: RecordedContainer = r.time("record, memory + files, first", p,
                                          lambda: mem.record(source, None))
        if first.record.memory is None:
            raise RuntimeError("the recording captured no memory: is CRIU working?")
        self.change(source, 2 * rep)
        nxt: RecordedContainer = r.time("record, memory + files, next", p,
                                        lambda: mem.record(source, first.listings))
        self.changed(source, 2 * rep)
        fs_first: RecordedContainer = r.time("record, files only, first", p,
                                             lambda: files.record(source, None))
        self.change(source, 2 * rep + 1)
        fs_next: RecordedContainer = r.time("record, files only, next", p,
                                            lambda: files.record(source, fs_first.listings))
        r.files_read["record, memory + files, next"].append(nxt.files_read)
        r.files_read["record, files only, next"].append(fs_next.files_read)
        r.stored["record, memory + files, first"].append(blob_bytes(mem.cache, first.blobs))
        r.stored["record, memory + files, next"].append(
            blob_bytes(mem.cache, nxt.blobs - first.blobs))
        r.stored["record, files only, first"].append(blob_bytes(files.cache, fs_first.blobs))
        r.stored["record, files only, next"].append(
            blob_bytes(files.cache, fs_next.blobs - fs_first.blobs))
        r.stored["memory archive (in the first)"].append(first.record.memory_size)
        shutil.rmtree(files.cache.directory)
        return mem, first

    def podman_captures(self, source: str, rep: int) -> tuple[Path, Path]:
        """One repetition of podman's checkpoint and export: the archive and the tar."""
        r, p = self.runs, self.podman
        folder = self.work / f"podman-{rep}"
        folder.mkdir()
        archive = folder / "checkpoint.tar"
        r.time(CHECKPOINT, p, lambda: p.run(
            "container", "checkpoint", f"--export={archive}", "--compress=none",
            "--leave-running", source))
        tar = folder / "export.tar"
        r.time(EXPORT, p, lambda: p.run("export", source, "-o", str(tar)))
        r.stored[CHECKPOINT].append(archive.stat().st_size)
        r.stored[EXPORT].append(tar.stat().st_size)
        return archive, tar

    def restores(self, rep: int, mem: ContainerSandboxes, first: RecordedContainer,
                 archive: Path, tar: Path, script: str) -> None:
        """One repetition of the four restores, each into a new container removed after;
        podman's first in odd repetitions, nemo-ckpt's in even ones."""
        r, p = self.runs, self.podman

        def nemo_memory(name: str) -> None:
            mem.memory = True
            if not mem.restore(first.record, fetcher(mem), name, "key", "where").running:
                raise RuntimeError("nemo-ckpt's restore did not restore the memory")

        def nemo_files(name: str) -> None:
            mem.memory = False  # as on a node where `criu check` fails
            mem.restore(first.record, fetcher(mem), name, "key", "where")

        def podman_restore(name: str) -> None:
            p.run("container", "restore", f"--import={archive}", "--name", name)

        image = f"localhost/{PREFIX}{self.run_id}:{rep}"
        self.images.append(image)

        def podman_import(name: str) -> None:
            p.run("import", str(tar), image)
            p.run("create", "--name", name, image, "/bin/sh", "-c", script)
            p.start(name)

        steps: list[tuple[str, str, Callable[[str], None]]] = [
            (RESTORES[0], "memory", nemo_memory), (RESTORES[1], "files", nemo_files),
            (RESTORE, "podman-restore", podman_restore),
            (IMPORT, "podman-import", podman_import)]
        for what, tag, step in steps if rep % 2 == 0 else steps[2:] + steps[:2]:
            name = self.name(f"r{rep}-{tag}")
            r.time(what, p, functools.partial(step, name))
            self.check(name, rep)
            self.discard(name)
        floor = self.work / f"floor-{rep}"
        r.time(FLOOR, p, functools.partial(write_files, floor, self.files, self.big_files))
        shutil.rmtree(floor)
        p.run("image", "rm", "--force", image, check=False)
        self.images.remove(image)
        shutil.rmtree(mem.cache.directory.parent)
        shutil.rmtree(archive.parent)


# --- reporting -----------------------------------------------------------------------


def seconds_table(runs: Runs) -> list[str]:
    rows = ["| operation | median s | (min-max) |", "|---|---|---|"]
    for what in [*CAPTURES, CHECKPOINT, EXPORT, *RESTORES, RESTORE, IMPORT, FLOOR]:
        s = runs.seconds[what]
        who = "nemo-ckpt " if what in CAPTURES or what in RESTORES else ""
        rows.append(f"| {who}{what} | {median(s):.3f} | ({min(s):.3f}-{max(s):.3f}) |")
    return rows


def ratio_table(runs: Runs) -> list[str]:
    def m(what: str) -> float:
        return median(runs.seconds[what])

    rows = ["| nemo-ckpt | s | / podman checkpoint or restore | / podman export or "
            "import + start |", "|---|---|---|---|"]
    for what in CAPTURES:
        rows.append(f"| {what} | {m(what):.3f} | {m(what) / m(CHECKPOINT):.2f}x | "
                    f"{m(what) / m(EXPORT):.2f}x |")
    for what in RESTORES:
        rows.append(f"| {what} | {m(what):.3f} | {m(what) / m(RESTORE):.2f}x | "
                    f"{m(what) / m(IMPORT):.2f}x |")
    return rows


def parts(runs: Runs, what: str) -> str:
    """Where ``what``'s median time goes: each podman command, the rest in-process."""
    total = median(runs.seconds[what])
    kinds = sorted({k for spent in runs.podman[what] for k in spent})
    medians = {k: median(spent.get(k, 0.0) for spent in runs.podman[what]) for k in kinds}
    shown = [f"`podman {k}` {s:.3f}" for k, s in
             sorted(medians.items(), key=lambda kv: -kv[1]) if s >= 0.0005]
    rest = total - sum(medians.values())
    return f"{what} {total:.3f} s: " + ", ".join([*shown, f"the rest {rest:.3f}"])


def bytes_table(runs: Runs) -> list[str]:
    base = median(runs.stored[CHECKPOINT])
    rows = ["| stored | MB | / podman checkpoint archive |", "|---|---|---|"]
    for what in [*CAPTURES, "memory archive (in the first)", CHECKPOINT, EXPORT]:
        b = median(runs.stored[what])
        label = what if what.startswith("podman") else f"nemo-ckpt {what}"
        if what.endswith("next"):
            label += " (blobs it adds)"
        rows.append(f"| {label} | {b / 1e6:.3f} | {b / base:.3f}x |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--big-files", type=int, default=4)
    p.add_argument("--memory-mb", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="2 repetitions, 500 files")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.files = 2, 500
    start = time.perf_counter()
    setup = ensure()
    if setup.criu is None:
        print(f"no CRIU passes `criu check` here ({setup.criu_problem}): the memory "
              f"figures cannot be measured")
        return 1
    script = hold_script(args.memory_mb)
    with tempfile.TemporaryDirectory(prefix="nemo-ckpt-containers-") as tmp:
        work = Path(tmp)
        tree_bytes = make_tree(work / "tree", args.files, args.big_files)
        bench = Bench(setup, work, args.files, args.big_files)
        try:
            source = bench.name("source")
            bench.podman.run("run", "-d", "--name", source, setup.image, "/bin/sh", "-c",
                             script)
            wait_ready(bench.podman, source)
            bench.podman.run("exec", source, "mkdir", "-p", "/work")
            bench.podman.copy_in(str(work / "tree"), source, "/work")
            if count_files(bench.podman, source) != args.files + args.big_files:
                raise RuntimeError("the working tree was not copied into the container")
            rss = bench.podman.text("exec", source, "sh", "-c",
                                    "grep VmRSS /proc/1/status").split()[1]
            shutil.rmtree(work / "tree")
            version = bench.podman.text("version", "--format", "{{.Client.Version}}")
            print(f"podman {version}, CRIU {setup.criu}; container {source}: {args.files} files of "
                  f"{SMALL // 1024} KiB + {args.big_files} of 1 MiB under /work "
                  f"({tree_bytes / 1e6:.1f} MB), its shell resident {int(rss) / 1000:.1f} MB",
                  flush=True)
            # nemo-ckpt's recordings first (see the module docstring).
            t = time.perf_counter()
            recorded = [bench.nemo_captures(source, rep) for rep in range(args.repeats)]
            print(f"nemo-ckpt's recordings: {time.perf_counter() - t:.1f} s", flush=True)
            t = time.perf_counter()
            archives = [bench.podman_captures(source, rep) for rep in range(args.repeats)]
            print(f"podman's checkpoints and exports: {time.perf_counter() - t:.1f} s",
                  flush=True)
            t = time.perf_counter()
            for rep, ((mem, first), (archive, tar)) in enumerate(
                    zip(recorded, archives, strict=True)):
                bench.restores(rep, mem, first, archive, tar, script)
            print(f"the restores: {time.perf_counter() - t:.1f} s", flush=True)
        finally:
            bench.cleanup()
    left = bench.podman.text("ps", "-a", "--filter", f"name=^{PREFIX}{bench.run_id}",
                             "--format", "{{.Names}}")
    if left:
        print(f"containers left behind: {left}")
    runs = bench.runs
    print(f"\nmedians of {args.repeats}, sync included; next = after one 4 KiB file "
          f"changed ({time.perf_counter() - start:.0f} s in all)\n")
    print("\n".join(seconds_table(runs)))
    print()
    print("\n".join(ratio_table(runs)))
    print("\nwhere nemo-ckpt's time goes (medians of each part):")
    for what in [*CAPTURES, *RESTORES]:
        print(f"  {parts(runs, what)}")
    read = {what: sorted(set(n)) for what, n in runs.files_read.items()}
    print(f"  files a next recording read: {read}")
    print()
    print("\n".join(bytes_table(runs)))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
