"""The blob store under frequent snapshots (issue 56, case 3): its files and bytes over
``--snapshots`` snapshots taken every ``--interval`` seconds with ``keep_last(root, 3)``
after each, as a job that snapshots every second does.

One embedded single-node Ray instance; ``--sessions`` sessions own sandbox directories,
and between two snapshots each runs one turn that writes ``--files`` new files of
``--file-bytes`` random bytes and deletes the ones of two turns before. Every
``--every`` snapshots it prints the store's files and bytes (claims and temp files not
counted) and what the three kept snapshots reference; at the end, whether the store is
flat over the second half: its mean over the last quarter of the run at most one
snapshot's blobs above its mean over the third quarter (HOLDS or MISSED).

Before issue 56 each next snapshot interrupted the coordinator's collection, and the
store grew by about a snapshot's blobs with every snapshot.

    .venv/bin/python -m benchmarks.blob_store_growth                  # 200 x 1 s
    .venv/bin/python -m benchmarks.blob_store_growth --interval 0.25  # the same, faster
"""

from __future__ import annotations

import argparse
import asyncio
import random
import stat
import statistics
import time
from pathlib import Path

from benchmarks.common import bench_config, format_table, on_local_ray, print_verdicts
from nemo_ckpt import RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.catalog.listing import keep_last
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.snapshot_files import committed_snapshots
from nemo_ckpt.trees.blob_store import BlobStore
from nemo_ckpt.trees.collection import snapshot_refs

KEEP = 3


def store_figures(root: Path) -> tuple[int, int]:
    """The store's blob files and their bytes (claims and temp files are hidden); a
    blob a collection removes while they are counted is not counted."""
    files = sizes = 0
    for p in (root / "blobs").rglob("*"):
        if p.name.startswith("."):
            continue
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            files, sizes = files + 1, sizes + st.st_size
    return files, sizes


def referenced(root: Path) -> int:
    """How many blobs the committed snapshots under ``root`` reference."""
    store = BlobStore(str(root / "blobs"), folder_at)
    refs: set[bytes] = set()
    for path in committed_snapshots(root):
        try:
            refs |= snapshot_refs(path, store)
        except Exception:  # removed by the retention meanwhile
            continue
    return len(refs)


async def run(work: Path, args: argparse.Namespace) -> bool:
    root, sandboxes = work / "ckpt", work / "sandboxes"
    config = bench_config("blob-growth", timeout_s=60.0).model_copy(
        update={"checkpoint_root": root, "sandbox_root": sandboxes})
    ckpt = RayEnvironmentCheckpoint(config)
    infos = await ckpt.ensure_holders()
    client = await SessionClient.connect(infos[0].instance_id, namespace=config.namespace)
    rng = random.Random(56)
    episodes: dict[EnvironmentEpisode, Path] = {}
    for k in range(args.sessions):
        ep = EnvironmentEpisode(f"r{k}", 0)
        d = sandboxes / "work" / ep.capture_key
        d.mkdir(parents=True)
        await client.open(ep, b"", directory=d)
        episodes[ep] = d
    rows: list[list[object]] = []
    series: list[int] = []
    started = time.monotonic()
    for i in range(args.snapshots):
        for ep, d in episodes.items():
            async with client.turn(ep) as turn:
                for j in range(args.files):
                    (d / f"t{i}-{j}.bin").write_bytes(rng.randbytes(args.file_bytes))
                    (d / f"t{i - 2}-{j}.bin").unlink(missing_ok=True)
                turn.complete(b"t", b"")
        async with ckpt.snapshot(root / f"step-{i:04d}"):
            if args.retention == "inside":  # beside RL's save: its collection is refused
                await asyncio.to_thread(keep_last, root, KEEP)
        if args.retention == "after":
            await asyncio.to_thread(keep_last, root, KEEP)
        files, size = store_figures(root)
        series.append(files)
        if (i + 1) % args.every == 0 or i == 0:
            rows.append([i + 1, f"{time.monotonic() - started:.0f}", files,
                         f"{size / 2**20:.1f}", referenced(root)])
            print(f"{i + 1} snapshots, {rows[-1][1]} s: {files} blob files, "
                  f"{rows[-1][3]} MiB; the kept ones reference {rows[-1][4]}", flush=True)
        await asyncio.sleep(max(0.0, started + (i + 1) * args.interval - time.monotonic()))
    ckpt.shutdown()
    print()
    print("\n".join(format_table(["snapshots", "seconds", "blob files", "MiB",
                                   "kept reference"], rows)))
    n = len(series)
    third = statistics.mean(series[n // 2:3 * n // 4])
    last = statistics.mean(series[3 * n // 4:])
    per_snapshot = args.sessions * args.files
    print(f"\nsecond half: {min(series[n // 2:])}..{max(series[n // 2:])} blob files; mean "
          f"{third:.0f} over the third quarter, {last:.0f} over the last; one snapshot "
          f"writes about {per_snapshot} blobs")
    holds = last <= third + per_snapshot
    print_verdicts([("the store is flat over the second half", holds,
                     f"last quarter's mean {last:.0f} <= third quarter's {third:.0f} + "
                     f"{per_snapshot}")])
    return holds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--snapshots", type=int, default=200)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between snapshots")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--files", type=int, default=100, help="new files per turn")
    parser.add_argument("--file-bytes", type=int, default=4096)
    parser.add_argument("--every", type=int, default=10, help="print every this many")
    parser.add_argument("--retention", choices=["inside", "after"], default="inside",
                        help="run keep_last inside each snapshot's block (beside RL's save: "
                             "its own collection is refused, the coordinator's alone "
                             "collects) or after it (it may collect too)")
    args = parser.parse_args()
    on_local_ray(lambda work: run(work, args), "nemo-ckpt-blob-growth-")


if __name__ == "__main__":
    main()
