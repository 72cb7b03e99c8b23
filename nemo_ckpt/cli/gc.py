"""``nemo-ckpt gc ROOT [--dry-run] [--wait SECONDS]``: remove sandbox blobs no
committed snapshot references (``nemo_ckpt.trees.collection``)."""

from __future__ import annotations

import argparse
from typing import TextIO

from nemo_ckpt.cli.render import PROG, human_bytes, one_line
from nemo_ckpt.errors import CheckpointPathBusyError, NemoCkptError
from nemo_ckpt.options import checkpoint_path, non_negative_float
from nemo_ckpt.trees.collection import check_collection_root, collect_blobs

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``gc`` to the parser's subcommands."""
    p = sub.add_parser("gc", help="remove sandbox blobs no committed snapshot references",
                       description="Collect ROOT/blobs: remove every blob that no committed "
                                   "snapshot under ROOT references. Refused (exit 1) while a "
                                   "snapshot is in progress there (or another collection "
                                   "runs), or when a snapshot's trees cannot be read "
                                   "(nothing is removed then). Safe beside a running job: "
                                   "live sessions keep their files in their node's cache.")
    p.add_argument("root", metavar="ROOT", type=checkpoint_path,
                   help="the checkpoint root (CheckpointConfig.checkpoint_root)")
    p.add_argument("--dry-run", action="store_true",
                   help="count what would be removed; remove nothing")
    p.add_argument("--wait", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="while snapshots hold the store, watch their claims for up to this "
                        "long and collect once they have committed, or once a claim is "
                        "seen unchanged for its ttl (its job died); default 0: refuse at "
                        "once")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        check_collection_root(args.root)
        report = collect_blobs(args.root, dry_run=args.dry_run, wait_s=args.wait)
    except CheckpointPathBusyError as exc:
        # Claims are judged on this host's clock only: one seen for the first time is
        # live, so only watching tells a snapshot that died from one that runs.
        hint = ("; run gc again later, or with --wait SECONDS to watch the claims that "
                "long" if not args.wait else "")
        print(f"{PROG} gc: {one_line(exc)}{hint}", file=err)
        return 1
    except NemoCkptError as exc:
        print(f"{PROG} gc: {one_line(exc)}", file=err)
        return 1
    verb = "would remove" if report.dry_run else "removed"
    size = "" if report.dry_run else f" ({human_bytes(report.removed_bytes)})"
    print(f"{report.store}: {len(report.snapshots)} committed snapshot(s) reference "
          f"{report.referenced} blobs; {verb} {report.removed} unreferenced blob(s){size}, "
          f"kept {report.kept}", file=out)
    return 0
