"""``nemo-ckpt verify PATH``: every check a restore makes, without Ray
(``nemo_ckpt.catalog.verification``), rendered."""

from __future__ import annotations

import argparse
from typing import TextIO

from nemo_ckpt.catalog.verification import verify_snapshot
from nemo_ckpt.cli.render import add_progress_option, progress_line, read_error, table
from nemo_ckpt.options import checkpoint_path
from nemo_ckpt.phases import instance_sort_key
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.manifest import MANIFEST_NAME

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               path_help: str) -> None:
    """Add ``verify`` to the parser's subcommands."""
    p = sub.add_parser("verify", help="make every check a restore makes, without Ray",
                       description="Check the manifest (version, schema, shard names) and "
                                   "every shard (length, content hash, decoding, contents). Exits "
                                   "0 when intact, 1 listing every problem found.")
    p.add_argument("path", metavar="PATH", type=checkpoint_path, help=path_help)
    add_progress_option(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    path = args.path
    meter = progress_line("verify", args.progress, err)
    try:
        report = verify_snapshot(path, progress=meter)
    finally:
        if meter is not None:
            meter.end()
    m = report.manifest
    if m is None:
        # The manifest itself is refused: there is nothing else to check.
        assert report.manifest_error is not None
        print(read_error("verify", path, report.manifest_error), file=err)
        return 1
    print(f"verifying snapshot {m.snapshot_id} at {environment_folder(path).describe()}",
          file=out)
    rows: list[tuple[object, ...]] = [
        (MANIFEST_NAME, "ok", f"format {m.format_version}, {len(m.instances)} instances, "
                              f"{m.sessions} rollouts, {len(m.shards)} shards")]
    for s in sorted(m.shards, key=lambda s: (instance_sort_key(s.instance_id), s.file)):
        verdict = "ok" if report.shards.get(s.file) is None else "FAILED"
        rows.append((s.file, verdict, f"{s.instance_id}, {s.bytes} bytes, "
                                      f"{s.sessions} sessions"))
    if m.blob_store is not None:
        trees = [s.trees for s in m.shards if s.trees]
        verdict = "FAILED" if report.directory_problems else "ok"
        rows.append((f"{m.blob_store}/", verdict,
                     f"{sum(t.sandboxes for t in trees)} directories, every tree and file "
                     f"blob read and hashed"))
    for line in table(("FILE", "RESULT", "DETAIL"), rows):
        print("  " + line, file=out)
    if report.ok:
        total = sum(s.bytes for s in m.shards)
        print(f"OK: snapshot {m.snapshot_id} is intact: {len(m.shards)} shards, {total} "
              f"bytes, {m.sessions} rollouts verified", file=out)
        return 0
    out.flush()
    print(f"FAILED: snapshot {m.snapshot_id} has {len(report.problems)} problem(s); a "
          f"restore from it would be refused:", file=err)
    for problem in report.problems:
        print(f"  - {problem}", file=err)
    return 1
