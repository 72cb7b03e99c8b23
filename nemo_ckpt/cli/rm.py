"""``nemo-ckpt rm PATH...`` and ``nemo-ckpt rm --keep-last N ROOT``: remove snapshots
beside a running job, then their unreferenced blobs (``nemo_ckpt.catalog.listing``), rendered."""

from __future__ import annotations

import argparse
from typing import TextIO

from nemo_ckpt.catalog.listing import RemovalReport, keep_last, remove_snapshot
from nemo_ckpt.cli.render import (
    PROG,
    add_progress_option,
    human_bytes,
    nothing_at_root,
    one_line,
    progress_line,
    read_error,
)
from nemo_ckpt.errors import NemoCkptError, SnapshotNotFoundError
from nemo_ckpt.options import at_least, checkpoint_path, non_negative_float
from nemo_ckpt.trees.collection import CollectionReport

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``rm`` to the parser's subcommands."""
    p = sub.add_parser("rm", help="remove snapshots (or keep the last N), then their blobs",
                       description="Remove the snapshot at each PATH (its environment/ "
                                   "half; RL's files there stay), then the sandbox blobs no "
                                   "other committed snapshot references. With --keep-last "
                                   "N, PATH is a root: keep its N newest snapshots and "
                                   "remove the older ones (a damaged one among the newest "
                                   "is kept and does not count; a line on stderr says "
                                   "why). Safe beside a running job: a "
                                   "snapshot that a snapshot or restore holds is refused "
                                   "(exit 1), and nothing of it is removed.")
    p.add_argument("paths", metavar="PATH", nargs="+", type=checkpoint_path,
                   help="a checkpoint path handed to snapshot(); with --keep-last, the root")
    p.add_argument("--keep-last", type=at_least(1), metavar="N",
                   help="keep the N newest snapshots under the root, remove the rest "
                        "(a snapshot counts only if it reads, and with --verify verifies)")
    p.add_argument("--verify", action="store_true",
                   help="with --keep-last: count only snapshots that pass every check a "
                        "restore makes")
    p.add_argument("--wait", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="while a snapshot or restore holds a path (or the blob store), "
                        "watch its claim for up to this long, and go on once it has ended "
                        "or is seen unchanged for its ttl (its job died); default 0: "
                        "refuse at once")
    p.add_argument("--no-gc", dest="gc", action="store_false",
                   help="leave the blob store as it is (the next commit, or gc, collects it)")
    p.add_argument("--dry-run", action="store_true",
                   help="with --keep-last: list what would be removed; remove nothing")
    add_progress_option(p)
    p.set_defaults(run=run)


def _removed(report: RemovalReport) -> str:
    return (f"removed snapshot {report.snapshot_id or '(unreadable manifest)'} at "
            f"{report.path} ({len(report.files)} files)")


def _collected(collection: CollectionReport | None, skipped: str | None, err: TextIO,
               out: TextIO) -> None:
    if collection is not None:
        print(f"{collection.store}: removed {collection.removed} unreferenced blob(s) "
              f"({human_bytes(collection.removed_bytes)}), kept {collection.kept}", file=out)
    elif skipped is not None:
        print(f"{PROG} rm: blobs not collected: {skipped}", file=err)


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.keep_last is not None:
        if len(args.paths) != 1:
            print(f"{PROG} rm: error: --keep-last takes one ROOT, got {len(args.paths)} "
                  f"paths", file=err)
            return 2
        return _keep_last(args, args.paths[0], out, err)
    if args.dry_run:
        print(f"{PROG} rm: error: --dry-run goes with --keep-last N ROOT; nothing was "
              f"removed", file=err)
        return 2
    code = 0
    for path in args.paths:
        try:
            report = remove_snapshot(path, collect=args.gc, wait_s=args.wait)
        except SnapshotNotFoundError as exc:  # nothing of it was touched
            print(read_error("rm", path, exc, then="Nothing was removed."), file=err)
            code = 1
            continue
        except (NemoCkptError, OSError) as exc:
            print(f"{PROG} rm: error: {one_line(exc)}", file=err)
            code = 1
            continue
        print(_removed(report), file=out)
        _collected(report.collection, report.collection_skipped, err, out)
    return code


def _keep_last(args: argparse.Namespace, root: str, out: TextIO, err: TextIO) -> int:
    meter = progress_line("rm", args.progress, err)
    try:
        nothing = nothing_at_root(root)
        if nothing is not None:  # as a folder that does not exist: exit 1
            print(f"{PROG} rm: error: {nothing}; nothing was removed", file=err)
            return 1
        try:
            kept = keep_last(root, args.keep_last, verify=args.verify, wait_s=args.wait,
                             progress=meter, dry_run=args.dry_run)
        finally:
            if meter is not None:
                meter.end()
    except (NemoCkptError, OSError) as exc:
        print(f"{PROG} rm: error: {one_line(exc)}", file=err)
        return 1
    verb = "would keep" if kept.dry_run else "kept"
    print(f"{verb} {len(kept.kept)} snapshot(s) under {root}", file=out)
    for info in kept.would_remove:
        print(f"would remove snapshot {info.snapshot_id or '(unreadable manifest)'} at "
              f"{info.path}", file=out)
    for removal in kept.removed:
        print(_removed(removal), file=out)
    if kept.dry_run:
        print(f"nothing was removed (--dry-run): {len(kept.would_remove)} snapshot(s) "
              f"would be", file=out)
    _collected(kept.collection, kept.collection_skipped, err, out)
    out.flush()
    for path, why in kept.damaged.items():
        # Kept, not counted: a person should look before it goes.
        print(f"{PROG} rm: kept damaged snapshot {path}, not counted towards --keep-last: "
              f"{why}; it is kept for you to look at (`{PROG} verify {path}`); to remove "
              f"it: `{PROG} rm {path}`", file=err)
    for path, why in kept.refused.items():
        print(f"{PROG} rm: not removed {path}: {why}", file=err)
    return 1 if kept.refused else 0
