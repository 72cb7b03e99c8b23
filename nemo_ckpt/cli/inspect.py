"""``nemo-ckpt inspect PATH [--json]``: what a snapshot holds, from its manifest."""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from nemo_ckpt.catalog.summary import SnapshotSummary, snapshot_summary
from nemo_ckpt.cli.render import human_bytes, number, read_error, table
from nemo_ckpt.errors import SnapshotReadError
from nemo_ckpt.options import checkpoint_path
from nemo_ckpt.storage.snapshot_files import read_manifest

__all__ = ["add_parser", "render_summary", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               path_help: str) -> None:
    """Add ``inspect`` to the parser's subcommands."""
    # A URL is refused here, before anything reads (nemo_ckpt.storage.location).
    p = sub.add_parser("inspect", help="show what a snapshot holds (reads its manifest)",
                       description="Show a snapshot's rollouts by instance, their attempts "
                                   "and turns, bytes per shard, the restarted count and the "
                                   "metrics. Reads only the manifest; run `verify` to check "
                                   "the shards.")
    p.add_argument("path", metavar="PATH", type=checkpoint_path, help=path_help)
    p.add_argument("--json", action="store_true", help="print the same as JSON")
    p.set_defaults(run=run)


def render_summary(summary: SnapshotSummary) -> list[str]:
    """A ``SnapshotSummary`` as the text ``inspect`` prints."""
    instances = summary.instances
    shards = [(i.instance_id, s) for i in instances for s in i.shards]
    sandboxes = summary.sandboxes
    lines = [
        f"snapshot {summary.snapshot_id} at {summary.path}",
        *("  " + line for line in table(("", ""), [
            ("created", summary.created_at.isoformat()),
            ("format", summary.format_version),
            ("instances", len(instances)),
            ("rollouts", f"{summary.captured_rollouts} captured, "
                         f"{summary.restarted_rollouts} restarted (not captured: "
                         f"they start over)"),
            ("shards", f"{len(shards)}, {summary.bytes} bytes"
                       + (f" ({human_bytes(summary.bytes)})" if summary.bytes >= 1024 else "")),
            *([("directories", f"{sandboxes.directories}; this snapshot wrote "
                               f"{sandboxes.new_blobs} new blobs, "
                               f"{human_bytes(sandboxes.new_bytes)} "
                               f"(store: {sandboxes.blob_store})")]
              if sandboxes.directories else []),
        ])[1:]),
        "",
    ]
    with_dirs = bool(sandboxes.directories)
    rows: list[tuple[object, ...]] = []
    for inst in instances:
        if not inst.rollouts:
            rows.append((inst.instance_id, "-", "-", "-", "-")
                        + (("-", "-", "-") if with_dirs else ()))
        for r in inst.rollouts:
            row: tuple[object, ...] = (inst.instance_id, r.rollout_id, r.attempt, r.turns,
                                       len(r.staging_keys))
            if with_dirs:
                d = r.directory
                if d is None:
                    row += ("-", "-", "-")
                elif d.error is not None or d.files is None or d.bytes is None:
                    row += ("unreadable", "-", human_bytes(d.new_bytes))
                else:
                    row += (d.files, human_bytes(d.bytes), human_bytes(d.new_bytes))
            rows.append(row)
    lines += table(("INSTANCE", "ROLLOUT", "ATTEMPT", "TURNS", "STAGING KEYS")
                    + (("FILES", "DIR BYTES", "NEW BYTES") if with_dirs else ()), rows)
    lines.append("")
    if shards:
        lines += table(("INSTANCE", "SHARD", "BYTES", "SESSIONS", "CONTENT HASH"),
                        [(inst, s.file, s.bytes, s.sessions, s.content_hash[:25])
                         for inst, s in shards])
    else:
        lines.append("no shards (the backend held no rollouts)")
    for inst in instances:  # why a directory is unreadable, in one line each
        for r in inst.rollouts:
            if r.directory is not None and r.directory.error is not None:
                lines.append(f"directory of {r.rollout_id}: unreadable "
                             f"({r.directory.error}); run verify")
    for file, why in summary.unreadable_shards.items():
        lines.append(f"shard {file}: its index does not read ({why}); run verify")
    lines.append("")
    if summary.metrics:
        lines += table(("METRIC", "VALUE"),
                        [(k, number(v)) for k, v in summary.metrics.items()])
    else:
        lines.append("no metrics")
    return lines


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    path = args.path
    try:
        manifest = read_manifest(path)
    except SnapshotReadError as exc:
        print(read_error("inspect", path, exc), file=err)
        return 1
    summary = snapshot_summary(path, manifest)
    if args.json:
        json.dump(summary.to_json(), out, indent=2)
        out.write("\n")
    else:
        out.write("\n".join(render_summary(summary)) + "\n")
    return 0
