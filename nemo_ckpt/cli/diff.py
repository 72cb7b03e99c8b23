"""``nemo-ckpt diff A B``: rollouts added, finished and advanced from A to B
(``nemo_ckpt.catalog.snapshot_diff``), rendered."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from nemo_ckpt.catalog.snapshot_diff import (
    SnapshotDiff,
    compare_directories,
    diff_manifests,
    snapshot_index,
)
from nemo_ckpt.cli.render import read_error, table
from nemo_ckpt.errors import SnapshotReadError
from nemo_ckpt.options import checkpoint_path

__all__ = ["add_parser", "render_diff", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``diff`` to the parser's subcommands."""
    p = sub.add_parser("diff", help="compare two snapshots rollout by rollout",
                       description="Show the rollouts added in B, those finished (in A, not "
                                   "in B), and how many turns each rollout in both advanced.")
    p.add_argument("a", metavar="A", type=checkpoint_path, help="the earlier checkpoint path")
    p.add_argument("b", metavar="B", type=checkpoint_path, help="the later checkpoint path")
    p.set_defaults(run=run)


def render_diff(diff: SnapshotDiff, path_a: Path | str, path_b: Path | str) -> list[str]:
    a, b = diff.a, diff.b
    lines = [
        f"A  {a.snapshot_id} at {path_a} (created {a.created_at.isoformat()})",
        f"B  {b.snapshot_id} at {path_b} (created {b.created_at.isoformat()})",
    ]
    if b.created_at < a.created_at:
        lines.append("note: B was created before A; the changes below read backwards")
    lines.append(
        f"{len(diff.added)} added, {len(diff.finished)} finished, {len(diff.continued)} "
        f"continued ({diff.turns_advanced:+d} turns), restarted "
        f"{a.restarted_rollouts} -> {b.restarted_rollouts}")
    lines.append("")
    for title, rollouts in (("added", diff.added), ("finished", diff.finished)):
        if rollouts:
            lines += table((title.upper(), "INSTANCE", "ATTEMPT", "TURNS"),
                            [(r.rollout_id, r.instance_id, r.attempt, r.turns)
                             for r in rollouts])
        else:
            lines.append(f"no rollouts {title}")
        lines.append("")
    if diff.continued:
        rows = []
        for ra, rb in diff.continued:
            inst = rb.instance_id if ra.instance_id == rb.instance_id \
                else f"{ra.instance_id} -> {rb.instance_id}"
            attempt = str(rb.attempt) if ra.attempt == rb.attempt \
                else f"{ra.attempt} -> {rb.attempt}"
            rows.append((rb.rollout_id, inst, attempt, f"{ra.turns} -> {rb.turns}",
                         f"{rb.turns - ra.turns:+d}"))
        lines += table(("CONTINUED", "INSTANCE", "ATTEMPT", "TURNS", "ADVANCED"), rows)
    else:
        lines.append("no rollouts in both")
    if diff.directories:
        lines.append("")
        for rollout_id, change in sorted(diff.directories.items()):
            if "error" in change:
                lines.append(f"directory of {rollout_id}: not compared ({change['error'][0]})")
                continue
            lines.append(f"directory of {rollout_id}: {len(change['added'])} added, "
                         f"{len(change['removed'])} removed, {len(change['changed'])} changed")
            for mark, key in (("+", "added"), ("-", "removed"), ("~", "changed")):
                lines += [f"  {mark} {p}" for p in change[key]]
    return lines


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    sides = []
    for path in (args.a, args.b):
        try:
            sides.append(snapshot_index(path))
        except SnapshotReadError as exc:
            print(read_error("diff", path, exc), file=err)
            return 1
    (a, rollouts_a), (b, rollouts_b) = sides
    diff = diff_manifests(a, b, rollouts_a, rollouts_b)
    compare_directories(diff, args.a, args.b)
    out.write("\n".join(render_diff(diff, args.a, args.b)) + "\n")
    return 0
