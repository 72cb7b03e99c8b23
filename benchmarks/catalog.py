"""What listing, retention, commit numbers and completion receipts cost, without Ray,
each with its floor measured in the same run.

- ``list_snapshots`` over ``--snapshots`` committed snapshots, against reading and
  parsing the same manifests' JSON (the floor: the files it must read);
- ``keep_last(10)`` over them (no blob store), against ``shutil.rmtree`` of the same
  environment folders (the floor: the files it must remove);
- ``take_sequence``, the number a commit takes under its root, against writing one small
  file durably (``Folder.write_bytes``, as a claim is written);
- the cut check of ``--rollouts`` captured rollouts over 4 instances
  (``check_rows_against_cut``), with one finished rollout per instance and with 10%
  finished, against the same check with none finished (rows as before the receipts).

    .venv/bin/python -m benchmarks.catalog [--snapshots 99] [--rollouts 100000]

Prints a table of medians over ``--repeat`` runs and each ratio to its floor.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from benchmarks.common import format_table, median
from nemo_ckpt.catalog.listing import keep_last, list_snapshots
from nemo_ckpt.cut import check_rows_against_cut
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.storage.checkpoint_folder import environment_dir, folder_at, prepare_environment_dir
from nemo_ckpt.storage.commit_sequence import take_sequence
from nemo_ckpt.storage.manifest import MANIFEST_NAME, encode_manifest
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.shards import write_shard
from nemo_ckpt.storage.snapshot_files import write_manifest
from nemo_ckpt.testing.data_plane import StaticCut

INSTANCES = 4
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def make_snapshots(root: Path, n: int) -> None:
    """``n`` small committed snapshots under ``root``, one holder's shard each."""
    for k in range(n):
        directory = prepare_environment_dir(root / f"step-{k:04d}")
        record = SessionRecord(instance_id="holder-0", episode=EnvironmentEpisode(f"r{k}", 0),
                               turns=(b"t",), state=b"s" * 64,
                               staging_keys=frozenset({f"r{k}/t0"}), earlier_capture_keys=())
        shard = write_shard(directory, shard_file_name(f"s{k}", "holder-0"), "holder-0",
                            [record])
        write_manifest(directory, encode_manifest(
            snapshot_id=f"s{k}", created_at=T0 + timedelta(minutes=k),
            instances=["holder-0"], shards=[shard], restarted_rollouts=0, metrics={},
            sequence=k + 1))


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def listing(root: Path, n: int, repeat: int) -> tuple[float, float]:
    make_snapshots(root, n)
    manifests = sorted(root.glob(f"*/environment/{MANIFEST_NAME}"))
    ours = [timed(lambda: list_snapshots(root)) for _ in range(repeat)]
    floor = [timed(lambda: [json.loads(p.read_bytes()) for p in manifests])
             for _ in range(repeat)]
    return median(ours), median(floor)


def _remove_all(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder)


def retention(base: Path, n: int, repeat: int) -> tuple[float, float]:
    ours: list[float] = []
    floor: list[float] = []
    for r in range(repeat):
        mine, theirs = base / f"keep-{r}", base / f"rmtree-{r}"
        make_snapshots(mine, n)
        make_snapshots(theirs, n)
        ours.append(timed(functools.partial(keep_last, mine, 10)))
        doomed = [environment_dir(theirs / f"step-{k:04d}") for k in range(n - 10)]
        floor.append(timed(functools.partial(_remove_all, doomed)))
        if len(list_snapshots(mine)) != 10:
            raise SystemExit(f"keep_last(10) left {len(list_snapshots(mine))} snapshots")
    return median(ours), median(floor)


def numbering(root: Path, repeat: int) -> tuple[float, float]:
    root.mkdir()
    folder = folder_at(root / "floor")
    folder.prepare()
    ours = [timed(lambda: take_sequence(str(root))) for _ in range(repeat)]
    floor = [timed(functools.partial(folder.write_bytes, f"claim-{i}", b"{}", sync=False))
             for i in range(repeat)]
    return median(ours), median(floor)


def cut_rows(rollouts: int, finished_every: int | None
             ) -> tuple[StaticCut, dict[str, list[tuple[Any, ...]]]]:
    """A cut of ``rollouts`` over 4 instances and the rows holders report: every
    ``finished_every``-th rollout finished (None: none)."""
    per = rollouts // INSTANCES
    expected: dict[str, list[EnvironmentEpisode]] = {}
    rows: dict[str, list[tuple[Any, ...]]] = {}
    keys: list[str] = []
    for h in range(INSTANCES):
        inst = f"holder-{h}"
        expected[inst] = [EnvironmentEpisode(f"r{h}-{i}", 0) for i in range(per)]
        rows[inst] = []
        for i in range(per):
            key = f"r{h}-{i}/t0"
            keys.append(key)
            done = finished_every is not None and i % finished_every == 0
            rows[inst].append((f"r{h}-{i}", 0, [key], 1, [], *((True,) if done else ())))
    return StaticCut(expected, keys), rows


def cut_check(rollouts: int, repeat: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, every in (("none finished", None), ("1 finished per instance", rollouts),
                        ("10% finished", 10)):
        cut, rows = cut_rows(rollouts, every)
        out[name] = median(timed(functools.partial(check_rows_against_cut, cut, rows))
                           for _ in range(repeat))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--snapshots", type=int, default=99)
    p.add_argument("--rollouts", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="nemo-ckpt-catalog-"))
    try:
        rows: list[tuple[object, ...]] = []
        ours, floor = listing(base / "list", args.snapshots, args.repeat)
        rows.append((f"list_snapshots, {args.snapshots} snapshots",
                     f"{ours * 1e3:.1f}", f"{floor * 1e3:.1f}", f"{ours / floor:.2f}",
                     "read + parse every manifest"))
        ours, floor = retention(base, args.snapshots, args.repeat)
        rows.append((f"keep_last(10) of {args.snapshots}", f"{ours * 1e3:.1f}",
                     f"{floor * 1e3:.1f}", f"{ours / floor:.2f}",
                     f"rmtree of the {args.snapshots - 10} folders"))
        ours, floor = numbering(base / "numbers", args.repeat * 20)
        rows.append(("take_sequence (a commit's number)", f"{ours * 1e3:.2f}",
                     f"{floor * 1e3:.2f}", f"{ours / floor:.2f}", "write one small file"))
        checks = cut_check(args.rollouts, args.repeat)
        base_s = checks["none finished"]
        for name, seconds in checks.items():
            rows.append((f"cut check, {args.rollouts} rollouts, {name}",
                         f"{seconds * 1e3:.1f}", f"{base_s * 1e3:.1f}",
                         f"{seconds / base_s:.2f}", "none finished"))
        print("\n".join(format_table(("what", "ms", "floor ms", "ratio", "floor"), rows)))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
