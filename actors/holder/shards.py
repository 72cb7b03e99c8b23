"""A holder's file work for its operations: a snapshot's shard written from its capture,
and a restore's shards read back into sessions not yet live. Each file step runs off the
loop through ``Runtime.run_blocking`` (the simulation names them, to aim faults at them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgpack

from actors.holder.heap import collector_paused
from actors.holder.sandbox_restores import RestoredSandbox
from actors.holder.sandboxes import Sandboxes
from actors.holder.session_table import Held
from actors.holder.states import Capture
from nemo_ckpt.errors import HolderStateError, ShardCorruptedError, SnapshotReadError
from nemo_ckpt.phases import ShardRef
from nemo_ckpt.shard_refs import shard_entry, shard_ref
from nemo_ckpt.storage.cleanup import remove_files
from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.names import shard_file_name, trees_file_name
from nemo_ckpt.storage.shards import ShardParts, read_shard_parts, write_shard_parts
from nemo_ckpt.transport import Runtime

__all__ = ["PREFETCH_BYTES", "RestoredShard", "ShardPrefetch", "load_shard",
           "read_restore_shard", "write_capture", "write_held_shard"]

# The most shard bytes (as the manifest claims them; a read never goes past a claim) a
# holder reads ahead of a restore: its memory bound. Shards past it are read by the
# restore itself.
PREFETCH_BYTES = 2 << 30


def write_held_shard(directory: Folder, name: str, instance_id: str,
                     held: list[Held], index: bytes) -> ShardRef:
    """Write captured sessions as one shard, from their bytes as held; ``index`` is
    their capture's ``captured_msgpack`` (the shard's index, the same bytes)."""
    return shard_ref(write_shard_parts(directory, name, instance_id, index, len(held),
                                       ((h.turns_pieces(), h.state) for h in held)))


def load_shard(directory: Folder, entry: ShardRef) -> ShardParts:
    """``read_shard_parts`` with the collector paused while the index is decoded."""
    with collector_paused():
        return read_shard_parts(directory, shard_entry(entry))


async def write_capture(runtime: Runtime, sandboxes: Sandboxes, instance_id: str,
                        op_id: str, directory: Folder,
                        capture: Capture) -> tuple[ShardRef, list[str]]:
    """Write ``capture`` as this instance's shard of snapshot ``op_id``: its sandboxes'
    blobs and trees file first, then the shard, all before the manifest. Returns the
    shard's entry and the names of the files written."""
    name = shard_file_name(op_id, instance_id)
    names = [name]
    trees = None
    if capture.sandboxes is not None and capture.sandboxes.any():
        names.append(trees_file_name(op_id, instance_id))
        try:
            trees = await runtime.run_blocking(
                sandboxes.persist, capture.sandboxes, directory, op_id,
                runtime.clock.monotonic)
        except BaseException:
            await runtime.run_blocking(remove_files, directory, names)
            raise
    entry = await runtime.run_blocking(
        write_held_shard, directory, name, instance_id, capture.held,
        capture.report.captured_msgpack)
    if trees is not None:
        entry = replace(entry, trees=trees)
    if capture.report.finished_count:
        entry = replace(entry, finished=capture.report.finished_count)
    return entry, names


class ShardPrefetch:
    """A holder's shards read ahead of a restore (``RayEnvironmentCheckpoint.prefetch``):
    each one read and verified into parts (``load_shard``), installed nowhere, kept
    until a restore of the very same shard entry takes it. Not an operation: nothing here
    changes what a holder holds. One snapshot at a time: a new prefetch replaces the last
    one, and a restore drops every read it did not take."""

    def __init__(self, runtime: Runtime, limit_bytes: int = PREFETCH_BYTES) -> None:
        self._runtime = runtime
        self._limit = limit_bytes
        self._reads: dict[tuple[str, ShardRef], asyncio.Future[ShardParts]] = {}

    def start(self, directory: Folder, where: str, shards: list[ShardRef]) -> int:
        """Start reading ``shards`` of snapshot folder ``where``; returns how many."""
        self.discard()
        total = 0
        for entry in shards:
            total += entry.bytes
            if total > self._limit:
                break
            read = asyncio.ensure_future(self._runtime.run_blocking(load_shard, directory,
                                                                     entry))
            read.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._reads[(where, entry)] = read
        return len(self._reads)

    def take(self, where: str, entry: ShardRef) -> asyncio.Future[ShardParts] | None:
        """The read of exactly ``entry`` at ``where`` started ahead, if any."""
        return self._reads.pop((where, entry), None)

    def discard(self) -> None:
        """Drop every read not taken (one still running ends in its thread, unused)."""
        for read in self._reads.values():
            read.cancel()
        self._reads.clear()


async def _parts(runtime: Runtime, directory: Folder, entry: ShardRef,
                 ahead: asyncio.Future[ShardParts] | None) -> ShardParts:
    """The shard's parts: those read ahead when that read succeeded, else read now (a
    prefetch that failed changes nothing: the restore reads, and refuses, for itself)."""
    if ahead is not None:
        try:
            return await ahead
        except (OSError, SnapshotReadError):
            pass
    return await runtime.run_blocking(load_shard, directory, entry)


@dataclass(frozen=True)
class RestoredShard:
    """One shard read back: its sessions, their staging keys, ``[[rollout_id, captured
    attempt], ...]`` as msgpack, and its sandboxes staged. ``finished`` lists
    ``[rollout_id, attempt, result]`` of its finished sessions (``nemo_ckpt.receipts``),
    which the restore installs as they are instead of continuing them."""

    held: list[Held]
    staging_keys: set[str]
    sessions_msgpack: bytes
    sandboxes: list[RestoredSandbox]
    finished: list[list[object]]


async def read_restore_shard(
    runtime: Runtime, sandboxes: Sandboxes, instance_id: str, restore_id: str,
    directory: Folder, entry: ShardRef, blob_store: str | None,
    still_open: Callable[[], object], ahead: asyncio.Future[ShardParts] | None = None,
) -> RestoredShard:
    """Read and verify one of this instance's shards, decode its sessions and stage their
    directories. ``still_open`` raises once the restore ended, checked after each step
    so that an ended restore stages nothing more. ``ahead``: the shard's read started by
    a prefetch, if any."""
    if entry.instance_id != instance_id:
        raise HolderStateError(
            f"{instance_id}: asked to restore shard {entry.file} of {entry.instance_id}")
    parts = await _parts(runtime, directory, entry, ahead)
    still_open()
    keys: set[str] = set()
    try:
        with collector_paused():
            held = [Held.continued(row, turns, state) for row, turns, state
                    in zip(parts.rows, parts.turns, parts.states, strict=True)]
            for row in parts.rows:
                keys.update(row[2])
            pairs = [row[:2] for row in parts.rows]
    except ValueError as exc:
        raise ShardCorruptedError(
            directory.describe(entry.file),
            f"shard {directory.describe(entry.file)} matches its hash but a session in "
            f"it does not decode ({exc}): restore an earlier checkpoint") from exc
    staged: list[RestoredSandbox] = []
    if entry.trees is not None:
        staged = await runtime.run_blocking(
            sandboxes.restores.prepare_restore, restore_id, directory, entry, blob_store,
            {h.rollout_id: h.capture_key for h in held if not h.finished}, runtime.threads)
    finished: list[list[object]] = [[h.rollout_id, h.attempt, h.state_bytes()] for h in held
                                    if h.finished]
    return RestoredShard(held, keys, msgpack.packb(pairs, use_bin_type=True), staged,
                         finished)
