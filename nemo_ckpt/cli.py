"""The ``nemo-ckpt`` command line: look at snapshots on disk and at live holders.

    nemo-ckpt inspect PATH [--json]   what a snapshot holds, from its manifest
    nemo-ckpt verify PATH             every check a restore makes, without Ray
    nemo-ckpt diff A B                rollouts added, finished and advanced from A to B
    nemo-ckpt status                  the holders of a running job
    nemo-ckpt gc ROOT [--dry-run] [--wait SECONDS]
                                      remove sandbox blobs no committed snapshot references

``PATH`` is the checkpoint path handed to ``snapshot()``: the folder that holds
``environment/``. Expected failures (no snapshot, a damaged one, no cluster) print one
line on stderr and exit 1; a bad option is a usage error (exit 2) before Ray starts; a
traceback means a bug in nemo-ckpt.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from nemo_ckpt.checkpoint_folder import environment_folder
from nemo_ckpt.connect import ray_address
from nemo_ckpt.errors import SnapshotNotFoundError, SnapshotReadError
from nemo_ckpt.manifest import (
    ENVIRONMENT_DIR,
    MANIFEST_NAME,
    Manifest,
    rollouts_by_shard,
    shard_problems,
)
from nemo_ckpt.options import checkpoint_path, non_empty, non_negative_float, positive_float
from nemo_ckpt.phases import HolderInfo
from nemo_ckpt.sandbox import diff_trees, tree_stats
from nemo_ckpt.sandbox_storage import snapshot_directories, verify_directories
from nemo_ckpt.shards import RolloutIndexEntry, read_shard
from nemo_ckpt.snapshot_files import read_manifest, snapshot_rollouts

__all__ = [
    "main",
    "build_parser",
    "snapshot_summary",
    "render_summary",
    "VerifyReport",
    "verify_snapshot",
    "SnapshotDiff",
    "diff_manifests",
    "HolderStatus",
    "holder_status",
    "run_status",
]

PROG = "nemo-ckpt"


# --- small helpers --------------------------------------------------------------------


def _one_line(error: BaseException) -> str:
    """An error's message on one line (pydantic's validation errors span several)."""
    return " ".join(part.strip() for part in str(error).splitlines() if part.strip())


def _instance_key(instance_id: str) -> tuple[int, str]:
    # holder-2 before holder-10, as the runtime orders instances.
    head, _, tail = instance_id.rpartition("-")
    return (int(tail), head) if tail.isdigit() else (1 << 30, instance_id)


def _rollout_key(r: RolloutIndexEntry) -> tuple[tuple[int, str], str]:
    return _instance_key(r.instance_id), r.rollout_id


def _human_bytes(n: float) -> str:
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Left-aligned columns, two spaces apart, no trailing blanks."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()
            for row in cells]


def _read_error(command: str, path: Path | str, error: SnapshotReadError) -> str:
    """The one stderr line for a snapshot that cannot be read, with a hint where one helps."""
    message = _one_line(error)
    if isinstance(error, SnapshotNotFoundError) and isinstance(path, Path) \
            and (path / MANIFEST_NAME).is_file():
        # The commonest slip: pointing at <checkpoint>/environment instead of <checkpoint>.
        message += (f" ({path} itself holds {MANIFEST_NAME}: it looks like the "
                    f"{ENVIRONMENT_DIR}/ folder; pass its parent, {path.parent})")
    return f"{PROG} {command}: error: {message}"


# --- inspect --------------------------------------------------------------------------


def snapshot_summary(checkpoint_path: Path | str, manifest: Manifest) -> dict[str, Any]:
    """What ``inspect`` shows, as plain JSON types: rollouts and shards by instance.

    Built from the manifest and the shards' indexes (format 3; a format-2 manifest lists
    the rollouts itself), read without the sessions' bytes and without verifying
    hashes, so a snapshot with damaged shards can still be inspected (a shard whose
    index does not read is listed in ``unreadable_shards``); ``verify`` checks it all.
    """
    by_instance: dict[str, dict[str, Any]] = {
        i: {"instance_id": i, "rollouts": [], "shards": [], "turns": 0, "bytes": 0}
        for i in manifest.instances
    }
    rollouts, unreadable = snapshot_rollouts(checkpoint_path, manifest)
    directories, unreadable_trees = snapshot_directories(checkpoint_path, manifest)
    unreadable.update(unreadable_trees)
    for r in sorted(rollouts, key=_rollout_key):
        inst = by_instance[r.instance_id]
        entry: dict[str, Any] = {
            "rollout_id": r.rollout_id, "attempt": r.attempt, "turns": r.turns,
            "staging_keys": list(r.staging_keys), "shard": r.shard,
        }
        d = directories.get(r.rollout_id)
        if d is not None:
            stats = None if d.tree is None else tree_stats(d.tree)
            entry["directory"] = {
                "tree": d.tree_digest.hex(), "new_bytes": d.new_bytes,
                "files": None if stats is None else stats.files,
                "bytes": None if stats is None else stats.bytes,
                "error": d.error}
        inst["rollouts"].append(entry)
        inst["turns"] += r.turns
    for s in sorted(manifest.shards, key=lambda s: s.file):
        inst = by_instance[s.instance_id]
        inst["shards"].append({"file": s.file, "bytes": s.bytes, "sessions": s.sessions,
                               "content_hash": s.content_hash})
        inst["bytes"] += s.bytes
    return {
        "path": str(checkpoint_path),
        "snapshot_id": manifest.snapshot_id,
        "format_version": manifest.format_version,
        "created_at": manifest.created_at.isoformat(),
        "captured_rollouts": manifest.sessions,
        "restarted_rollouts": manifest.restarted_rollouts,
        "bytes": sum(s.bytes for s in manifest.shards),
        "instances": [by_instance[i] for i in sorted(by_instance, key=_instance_key)],
        "unreadable_shards": dict(sorted(unreadable.items())),
        "sandboxes": {
            "directories": len(directories),
            "new_blobs": sum(s.trees.new_blobs for s in manifest.shards if s.trees),
            "new_bytes": sum(s.trees.new_blob_bytes for s in manifest.shards if s.trees),
            "blob_store": manifest.blob_store,
        },
        "metrics": dict(sorted(manifest.metrics.items())),
    }


def render_summary(summary: dict[str, Any]) -> list[str]:
    """``snapshot_summary`` as the text ``inspect`` prints."""
    instances = summary["instances"]
    shards = [(i["instance_id"], s) for i in instances for s in i["shards"]]
    sandboxes = summary.get("sandboxes", {})
    lines = [
        f"snapshot {summary['snapshot_id']} at {summary['path']}",
        *("  " + line for line in _table(("", ""), [
            ("created", summary["created_at"]),
            ("format", summary["format_version"]),
            ("instances", len(instances)),
            ("rollouts", f"{summary['captured_rollouts']} captured, "
                         f"{summary['restarted_rollouts']} restarted (not captured: "
                         f"they start over)"),
            ("shards", f"{len(shards)}, {summary['bytes']} bytes"
                       + (f" ({_human_bytes(summary['bytes'])})"
                          if summary["bytes"] >= 1024 else "")),
            *([("directories", f"{sandboxes['directories']}; this snapshot wrote "
                               f"{sandboxes['new_blobs']} new blobs, "
                               f"{_human_bytes(sandboxes['new_bytes'])} "
                               f"(store: {sandboxes['blob_store']})")]
              if sandboxes.get("directories") else []),
        ])[1:]),
        "",
    ]
    with_dirs = bool(sandboxes.get("directories"))
    rows: list[tuple[object, ...]] = []
    for inst in instances:
        if not inst["rollouts"]:
            rows.append((inst["instance_id"], "-", "-", "-", "-")
                        + (("-", "-", "-") if with_dirs else ()))
        for r in inst["rollouts"]:
            row: tuple[object, ...] = (inst["instance_id"], r["rollout_id"], r["attempt"],
                                       r["turns"], len(r["staging_keys"]))
            if with_dirs:
                d = r.get("directory")
                if d is None:
                    row += ("-", "-", "-")
                elif d["error"] is not None:
                    row += ("unreadable", "-", _human_bytes(d["new_bytes"]))
                else:
                    row += (d["files"], _human_bytes(d["bytes"]), _human_bytes(d["new_bytes"]))
            rows.append(row)
    lines += _table(("INSTANCE", "ROLLOUT", "ATTEMPT", "TURNS", "STAGING KEYS")
                    + (("FILES", "DIR BYTES", "NEW BYTES") if with_dirs else ()), rows)
    lines.append("")
    if shards:
        lines += _table(("INSTANCE", "SHARD", "BYTES", "SESSIONS", "CONTENT HASH"),
                        [(inst, s["file"], s["bytes"], s["sessions"], s["content_hash"][:25])
                         for inst, s in shards])
    else:
        lines.append("no shards (the backend held no rollouts)")
    for file, why in summary.get("unreadable_shards", {}).items():
        lines.append(f"shard {file}: its index does not read ({why}); run verify")
    lines.append("")
    if summary["metrics"]:
        lines += _table(("METRIC", "VALUE"),
                        [(k, _number(v)) for k, v in summary["metrics"].items()])
    else:
        lines.append("no metrics")
    return lines


def _cmd_inspect(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    path = args.path
    try:
        manifest = read_manifest(path)
    except SnapshotReadError as exc:
        print(_read_error("inspect", path, exc), file=err)
        return 1
    summary = snapshot_summary(path, manifest)
    if args.json:
        json.dump(summary, out, indent=2)
        out.write("\n")
    else:
        out.write("\n".join(render_summary(summary)) + "\n")
    return 0


# --- verify ---------------------------------------------------------------------------


@dataclass
class VerifyReport:
    """What ``verify`` found: the manifest (if it reads) and each shard's verdict.

    ``shards`` maps each shard file to ``None`` when intact, else to its problems.
    ``problems`` lists every problem found, manifest and shards alike.
    """

    path: Path | str
    manifest: Manifest | None = None
    manifest_error: SnapshotReadError | None = None
    shards: dict[str, list[str] | None] = field(default_factory=dict)
    directory_problems: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when a restore from this snapshot would pass every storage check."""
        return self.manifest is not None and not self.problems


def verify_snapshot(checkpoint_path: Path | str) -> VerifyReport:
    """Make every check a restore makes on ``checkpoint_path``, and report all failures.

    A restore stops at its first refusal; this goes on shard by shard, so one run lists
    every missing, truncated, altered or undecodable shard. The checks are the ones
    ``read_manifest`` and ``read_shard`` make for a restore (version, schema, shard
    names, lengths, hashes, decoding), plus the cross-check of ``read_snapshot``: each
    shard holds exactly the rollouts and attempts its manifest lists there.
    """
    path = checkpoint_path
    report = VerifyReport(path=path)
    try:
        manifest = read_manifest(path)
    except SnapshotReadError as exc:
        report.manifest_error = exc
        report.problems.append(_one_line(exc))
        return report
    report.manifest = manifest
    directory = environment_folder(path)
    listed = rollouts_by_shard(manifest)
    seen: dict[str, str] = {}  # rollout id -> the shard that holds it
    for shard in manifest.shards:
        try:
            records = read_shard(directory, shard)
        except SnapshotReadError as exc:
            report.shards[shard.file] = [_one_line(exc)]
            continue
        pairs = [(r.episode.rollout_id, r.episode.attempt) for r in records]
        problems = shard_problems(
            None if listed is None else listed.get(shard.file, {}), pairs,
            directory.describe(shard.file))
        problems += [f"rollout {rid!r} is in two shards, {seen[rid]} and {shard.file}; "
                     f"restore an earlier checkpoint" for rid, _ in pairs if rid in seen]
        seen.update((rid, shard.file) for rid, _ in pairs)
        report.shards[shard.file] = problems or None
    for found in report.shards.values():
        report.problems += found or []
    report.directory_problems = verify_directories(path, manifest)
    report.problems += report.directory_problems
    return report


def _cmd_verify(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    path = args.path
    report = verify_snapshot(path)
    m = report.manifest
    if m is None:
        # The manifest itself is refused: there is nothing else to check.
        assert report.manifest_error is not None
        print(_read_error("verify", path, report.manifest_error), file=err)
        return 1
    print(f"verifying snapshot {m.snapshot_id} at {environment_folder(path).describe()}",
          file=out)
    rows: list[tuple[object, ...]] = [
        (MANIFEST_NAME, "ok", f"format {m.format_version}, {len(m.instances)} instances, "
                              f"{m.sessions} rollouts, {len(m.shards)} shards")]
    for s in sorted(m.shards, key=lambda s: (_instance_key(s.instance_id), s.file)):
        verdict = "ok" if report.shards.get(s.file) is None else "FAILED"
        rows.append((s.file, verdict, f"{s.instance_id}, {s.bytes} bytes, "
                                      f"{s.sessions} sessions"))
    if m.blob_store is not None:
        trees = [s.trees for s in m.shards if s.trees]
        verdict = "FAILED" if report.directory_problems else "ok"
        rows.append((f"{m.blob_store}/", verdict,
                     f"{sum(t.sandboxes for t in trees)} directories, every tree and file "
                     f"blob read and hashed"))
    for line in _table(("FILE", "RESULT", "DETAIL"), rows):
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


# --- diff -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotDiff:
    """How snapshot B differs from snapshot A, rollout by rollout (matched by rollout id).

    ``added`` are in B only; ``finished`` are in A only (they completed, or were
    retired or dropped, in between); ``continued`` pairs A's entry with B's.
    """

    a: Manifest
    b: Manifest
    added: tuple[RolloutIndexEntry, ...]
    finished: tuple[RolloutIndexEntry, ...]
    continued: tuple[tuple[RolloutIndexEntry, RolloutIndexEntry], ...]
    # rollout id -> {"added"|"removed"|"changed": paths}, for continued rollouts whose
    # directory changed (or could not be read: {"error": [why]})
    directories: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    @property
    def turns_advanced(self) -> int:
        """Turns run in between by the rollouts present in both."""
        return sum(b.turns - a.turns for a, b in self.continued)


def diff_manifests(a: Manifest, b: Manifest, rollouts_a: list[RolloutIndexEntry],
                   rollouts_b: list[RolloutIndexEntry]) -> SnapshotDiff:
    """Compare two snapshots, given their manifests and their rollouts
    (``snapshot_rollouts``)."""
    in_a = {r.rollout_id: r for r in rollouts_a}
    in_b = {r.rollout_id: r for r in rollouts_b}
    return SnapshotDiff(
        a=a, b=b,
        added=tuple(sorted((r for k, r in in_b.items() if k not in in_a), key=_rollout_key)),
        finished=tuple(sorted((r for k, r in in_a.items() if k not in in_b),
                              key=_rollout_key)),
        continued=tuple(sorted(((in_a[k], r) for k, r in in_b.items() if k in in_a),
                               key=lambda pair: _rollout_key(pair[1]))),
    )


def _render_diff(diff: SnapshotDiff, path_a: Path | str, path_b: Path | str) -> list[str]:
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
            lines += _table((title.upper(), "INSTANCE", "ATTEMPT", "TURNS"),
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
        lines += _table(("CONTINUED", "INSTANCE", "ATTEMPT", "TURNS", "ADVANCED"), rows)
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


def _cmd_diff(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    manifests = []
    rollouts = []
    for path in (args.a, args.b):
        try:
            manifest = read_manifest(path)
        except SnapshotReadError as exc:
            print(_read_error("diff", path, exc), file=err)
            return 1
        found, unreadable = snapshot_rollouts(path, manifest)
        if unreadable:
            file, why = next(iter(sorted(unreadable.items())))
            print(f"{PROG} diff: error: shard {file} of {path} does not read: "
                  f"{_one_line(SnapshotReadError(path, why))}; run verify", file=err)
            return 1
        manifests.append(manifest)
        rollouts.append(found)
    diff = diff_manifests(manifests[0], manifests[1], rollouts[0], rollouts[1])
    dirs_a, _ = snapshot_directories(args.a, manifests[0])
    dirs_b, _ = snapshot_directories(args.b, manifests[1])
    for ra, rb in diff.continued:
        da, db = dirs_a.get(ra.rollout_id), dirs_b.get(rb.rollout_id)
        if da is None or db is None:
            continue
        if da.tree is None or db.tree is None:
            diff.directories[rb.rollout_id] = {"error": [da.error or db.error or "?"]}
        elif da.tree_digest != db.tree_digest:
            diff.directories[rb.rollout_id] = diff_trees(da.tree, db.tree)
    out.write("\n".join(_render_diff(diff, args.a, args.b)) + "\n")
    return 0


# --- status ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HolderStatus:
    """One holder as ``status`` found it: its ``info()``, or why it did not answer."""

    instance_id: str
    info: HolderInfo | None = None
    error: str | None = None


def holder_status(namespace: str, timeout_s: float = 10.0) -> list[HolderStatus]:
    """Ask every holder in ``namespace`` for its ``info()``. Needs Ray initialized.

    Read-only: it looks holder actors up by name and creates nothing (unlike
    ``RayEnvironmentCheckpoint.holders()``, which creates the coordinator). A holder
    that does not answer within ``timeout_s`` is reported with the reason.
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from nemo_ckpt.config import HOLDER_NAME_PREFIX

    names = sorted((a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a.get("namespace") == namespace
                    and a["name"].startswith(HOLDER_NAME_PREFIX)),
                   key=lambda n: _instance_key(n[len(HOLDER_NAME_PREFIX):]))
    pending: dict[str, Any] = {}
    found: list[HolderStatus] = []
    for name in names:
        inst = name[len(HOLDER_NAME_PREFIX):]
        try:
            pending[inst] = ray.get_actor(name, namespace=namespace).info.remote()
        except ValueError:
            found.append(HolderStatus(inst, error="died while being looked up"))
    deadline = time.monotonic() + timeout_s
    for inst, ref in pending.items():
        try:
            found.append(HolderStatus(
                inst, info=ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))))
        except GetTimeoutError:
            found.append(HolderStatus(inst, error=f"no answer within {timeout_s:g}s"))
        except RayActorError as exc:
            found.append(HolderStatus(inst, error=f"unreachable ({type(exc).__name__})"))
    return sorted(found, key=lambda h: _instance_key(h.instance_id))


def run_status(namespace: str, timeout_s: float = 10.0, out: TextIO | None = None,
               err: TextIO | None = None, address: str | None = None) -> int:
    """Print the holders of ``namespace``; needs Ray initialized (it neither inits nor
    shuts down). Exit code 0 when every holder answered, 1 when none exists or any
    did not answer. ``address`` is the cluster as the user named it, for messages
    (default: the GCS address Ray connected to)."""
    import ray

    from nemo_ckpt.config import CheckpointConfig

    out = out or sys.stdout
    err = err or sys.stderr
    holders = holder_status(namespace, timeout_s)
    if not holders:
        gcs = ray.get_runtime_context().gcs_address
        where = gcs if address is None else repr(address) if address == gcs \
            else f"{address!r} ({gcs})"
        print(f"{PROG} status: no nemo-ckpt holders in namespace {namespace!r} on the "
              f"cluster at {where}; the job is not running there, or it uses another "
              f"namespace (pass --namespace, as in CheckpointConfig.namespace)", file=err)
        return 1
    nodes = {n["NodeID"]: n for n in ray.nodes()}
    coordinator = CheckpointConfig().coordinator_name
    has_coordinator = any(a["name"] == coordinator and a.get("namespace") == namespace
                          for a in ray.util.list_named_actors(all_namespaces=True))
    answered = [h.info for h in holders if h.info is not None]
    # Snapshot ids start with their UTC time, so the greatest is the latest.
    last = max((i.last_snapshot_id for i in answered if i.last_snapshot_id), default=None)
    print(f"namespace {namespace}: {len(holders)} holders, coordinator "
          f"{'running' if has_coordinator else 'not running'}, last snapshot "
          f"{last or 'none'}", file=out)
    rows: list[tuple[object, ...]] = []
    for h in holders:
        i = h.info
        if i is None:
            rows.append((h.instance_id, f"UNREACHABLE: {h.error}", "-", "-", "-", "-", "-"))
            continue
        node = nodes.get(i.node_id, {})
        where = f"{i.node_id} {node.get('NodeManagerAddress', '?')}"
        if not node.get("Alive", False):
            where += " (node dead)"
        state = i.state.value + (f" for {i.operation_id}" if i.operation_id else "")
        lease = "-" if i.lease_expires_in_s is None else f"in {i.lease_expires_in_s:.1f}s"
        rows.append((i.instance_id, state, i.sessions, i.turns_in_flight,
                     i.last_snapshot_id or "-", lease, where))
    for line in _table(("INSTANCE", "STATE", "SESSIONS", "TURNS IN FLIGHT",
                        "LAST SNAPSHOT", "LEASE EXPIRES", "NODE"), rows):
        print(line, file=out)
    unreachable = [h.instance_id for h in holders if h.info is None]
    if unreachable:
        out.flush()
        print(f"{PROG} status: {len(unreachable)} holder(s) did not answer: "
              f"{', '.join(unreachable)}; their sessions are lost if their node died",
              file=err)
        return 1
    return 0


def _cmd_status(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import ray

    if ray.is_initialized():
        # In-process use (tests, a notebook): reuse the caller's connection, leave it open.
        return run_status(args.namespace, args.timeout, out, err)
    from nemo_ckpt.connect import ClusterConnectionError, connect

    try:
        connect(args.address, namespace=args.namespace, log_to_driver=False,
                logging_level=logging.WARNING)
    except ClusterConnectionError as exc:
        print(f"{PROG} status: error: {exc}", file=err)
        return 1
    try:
        return run_status(args.namespace, args.timeout, out, err, address=args.address)
    finally:
        ray.shutdown()


# --- gc -------------------------------------------------------------------------------


def _cmd_gc(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from nemo_ckpt.collection import collect_blobs
    from nemo_ckpt.errors import CheckpointPathBusyError, NemoCkptError

    try:
        report = collect_blobs(args.root, dry_run=args.dry_run, wait_s=args.wait)
    except CheckpointPathBusyError as exc:
        # Claims are judged on this host's clock only: one seen for the first time is
        # live, so only watching tells a snapshot that died from one that runs.
        hint = ("; run gc again later, or with --wait SECONDS to watch the claims that "
                "long" if not args.wait else "")
        print(f"{PROG} gc: {_one_line(exc)}{hint}", file=err)
        return 1
    except NemoCkptError as exc:
        print(f"{PROG} gc: {_one_line(exc)}", file=err)
        return 1
    verb = "would remove" if report.dry_run else "removed"
    size = "" if report.dry_run else f" ({_human_bytes(report.removed_bytes)})"
    print(f"{report.store}: {len(report.snapshots)} committed snapshot(s) reference "
          f"{report.referenced} blobs; {verb} {report.removed} unreferenced blob(s){size}, "
          f"kept {report.kept}", file=out)
    return 0


# --- entry point ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nemo-ckpt``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect and verify nemo-ckpt environment snapshots, and see the "
                    "session holders of a running job.")
    try:
        parser.add_argument("--version", action="version",
                            version=f"%(prog)s {metadata.version(PROG)}")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        pass
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    path_help = "the checkpoint path handed to snapshot(): the folder holding environment/"

    # A URL is refused here, before anything reads (nemo_ckpt.location).
    p = sub.add_parser("inspect", help="show what a snapshot holds (reads its manifest)",
                       description="Show a snapshot's rollouts by instance, their attempts "
                                   "and turns, bytes per shard, the restarted count and the "
                                   "metrics. Reads only the manifest; run `verify` to check "
                                   "the shards.")
    p.add_argument("path", metavar="PATH", type=checkpoint_path, help=path_help)
    p.add_argument("--json", action="store_true", help="print the same as JSON")
    p.set_defaults(run=_cmd_inspect)

    p = sub.add_parser("verify", help="make every check a restore makes, without Ray",
                       description="Check the manifest (version, schema, shard names) and "
                                   "every shard (length, content hash, decoding, contents). Exits "
                                   "0 when intact, 1 listing every problem found.")
    p.add_argument("path", metavar="PATH", type=checkpoint_path, help=path_help)
    p.set_defaults(run=_cmd_verify)

    p = sub.add_parser("diff", help="compare two snapshots rollout by rollout",
                       description="Show the rollouts added in B, those finished (in A, not "
                                   "in B), and how many turns each rollout in both advanced.")
    p.add_argument("a", metavar="A", type=checkpoint_path, help="the earlier checkpoint path")
    p.add_argument("b", metavar="B", type=checkpoint_path, help="the later checkpoint path")
    p.set_defaults(run=_cmd_diff)

    p = sub.add_parser("status", help="show the holders of a running job",
                       description="Show each session holder's node, state, sessions, last "
                                   "snapshot id and lease expiry. Read-only: creates no "
                                   "actor. Exits 1 when no holder is found or one does not "
                                   "answer.")
    p.add_argument("--address", default="auto", type=ray_address,
                   help="Ray cluster address: HOST:PORT of the head, ray://HOST:PORT, or "
                        "'auto' (default), the cluster `ray start` started on this node "
                        "or $RAY_ADDRESS. A cluster with token authentication needs "
                        "RAY_AUTH_MODE=token and its token (README, 'Ray token "
                        "authentication')")
    p.add_argument("--namespace", default="nemo_ckpt", type=non_empty,
                   help="the job's CheckpointConfig.namespace (default: nemo_ckpt); the "
                        "demo and the examples print theirs")
    p.add_argument("--timeout", type=positive_float, default=10.0,
                   help="seconds to wait for the holders to answer (default: 10)")
    p.set_defaults(run=_cmd_status)

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
    p.set_defaults(run=_cmd_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nemo-ckpt`` with ``argv`` (default: the process's arguments); return the
    exit code."""
    args = build_parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    try:
        code: int = args.run(args, out, err)
        out.flush()
        return code
    except BrokenPipeError:
        # `nemo-ckpt inspect PATH | head`: the reader left; exit quietly.
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except KeyboardInterrupt:
        return 130
