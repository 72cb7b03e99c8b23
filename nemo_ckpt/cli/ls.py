"""``nemo-ckpt ls ROOT [--verify] [--latest] [--json]``: the committed snapshots under a
checkpoint root, newest first (``nemo_ckpt.catalog.listing``), rendered."""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from nemo_ckpt.catalog.listing import SnapshotInfo, latest_snapshot, list_snapshots
from nemo_ckpt.catalog.verification import verify_snapshot
from nemo_ckpt.cli.render import PROG, human_bytes, nothing_at_root, one_line, table
from nemo_ckpt.errors import NemoCkptError
from nemo_ckpt.options import checkpoint_path

__all__ = ["add_parser", "render_snapshots", "run", "unreadable_lines"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``ls`` to the parser's subcommands."""
    p = sub.add_parser("ls", help="list the committed snapshots under a root, newest first",
                       description="List every committed snapshot below ROOT, newest first "
                                   "(by the time its manifest states), with its id, "
                                   "rollouts and bytes. Reads manifests only, unless "
                                   "--verify. With --latest, print only the path of the "
                                   "newest snapshot that verifies (exit 1 when none does), "
                                   "and on stderr why each newer one was skipped.")
    p.add_argument("root", metavar="ROOT", type=checkpoint_path,
                   help="the checkpoint root (CheckpointConfig.checkpoint_root), or any "
                        "folder above checkpoint paths")
    p.add_argument("--verify", action="store_true",
                   help="also make every check a restore makes on each snapshot (reads "
                        "every shard and blob)")
    p.add_argument("--latest", action="store_true",
                   help="print only the path of the newest snapshot that verifies")
    p.add_argument("--no-verify", dest="latest_verify", action="store_false",
                   help="with --latest: take the newest whose manifest reads, unverified")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(run=run)


def _as_json(info: SnapshotInfo, verdict: str | None) -> dict[str, Any]:
    return {"path": info.path, "snapshot_id": info.snapshot_id,
            "created_at": None if info.created_at is None else info.created_at.isoformat(),
            "sequence": info.sequence, "format_version": info.format_version,
            "instances": info.instances,
            "rollouts": info.rollouts, "restarted_rollouts": info.restarted_rollouts,
            "bytes": info.bytes, "blob_store": info.blob_store, "error": info.error,
            **({} if verdict is None else {"verified": verdict == "ok"})}


def render_snapshots(found: list[SnapshotInfo], verdicts: dict[str, str] | None = None
                     ) -> list[str]:
    """The table ``ls`` prints; ``verdicts``, by path, adds a column."""
    rows: list[tuple[object, ...]] = []
    for s in found:
        if s.created_at is None:
            # The reason goes below the table (``unreadable_lines``): a whole error
            # would stretch every row.
            row: tuple[object, ...] = ("?", "UNREADABLE", "-", "-", s.path)
        else:
            row = (s.created_at.isoformat(timespec="seconds"), s.snapshot_id, s.rollouts,
                   human_bytes(s.bytes), s.path)
        if verdicts is not None:
            row = (*row[:4], verdicts.get(s.path, "-"), row[4])
        rows.append(row)
    headers: tuple[str, ...] = ("CREATED", "SNAPSHOT", "ROLLOUTS", "BYTES", "PATH")
    if verdicts is not None:
        headers = (*headers[:4], "VERIFY", headers[4])
    return table(headers, rows)


def unreadable_lines(found: list[SnapshotInfo]) -> list[str]:
    """One stderr line per snapshot in the table whose manifest does not read, saying why."""
    return [f"{PROG} ls: {s.path}: its manifest does not read: {s.error}"
            for s in found if s.created_at is None]


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        return _run(args, out, err)
    except (NemoCkptError, OSError) as exc:
        out.flush()
        print(f"{PROG} ls: error: {one_line(exc)}", file=err)
        return 1


def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    nothing = nothing_at_root(args.root)
    if nothing is not None:  # as a folder that does not exist: exit 1
        print(f"{PROG} ls: error: {nothing}", file=err)
        return 1
    if args.latest:
        latest = latest_snapshot(args.root, verify=args.latest_verify, warn=False)
        for skipped in latest.skipped:
            print(f"{PROG} ls: skipped {skipped.path}: {skipped.reason}", file=err)
        if latest.path is None:
            print(f"{PROG} ls: no snapshot under {args.root} "
                  f"{'verifies' if args.latest_verify else 'has a manifest that reads'}",
                  file=err)
            return 1
        print(latest.path, file=out)
        return 0
    found = list_snapshots(args.root)
    verdicts: dict[str, str] | None = None
    if args.verify:
        verdicts = {}
        for s in found:
            if s.error is None:
                report = verify_snapshot(s.path)
                verdicts[s.path] = "ok" if report.ok else f"FAILED ({len(report.problems)})"
            else:
                verdicts[s.path] = "FAILED"
    if args.json:
        json.dump([_as_json(s, None if verdicts is None else verdicts[s.path])
                   for s in found], out, indent=2)
        out.write("\n")
        return 0
    if not found:
        print(f"no committed snapshots under {args.root}", file=out)
        return 0
    print(f"{len(found)} committed snapshot(s) under {args.root}, newest first", file=out)
    for line in render_snapshots(found, verdicts):
        print(line, file=out)
    out.flush()
    for line in unreadable_lines(found):
        print(line, file=err)
    failed = [p for p, v in (verdicts or {}).items() if v != "ok"]
    if failed:
        out.flush()
        print(f"{PROG} ls: {len(failed)} snapshot(s) would be refused by a restore; "
              f"`{PROG} verify PATH` lists why", file=err)
        return 1
    return 0
