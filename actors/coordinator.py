"""The checkpoint coordinator: one named actor that fans every phase out to the holders.

It reaches the holders only through its ``Transport`` (``nemo_ckpt.transport``), so
the same code runs as a Ray actor (``actors.ray_transport``) and in the simulation. It
keeps no state between snapshots that a restart would lose: holders are found by
name in the namespace, and a snapshot in progress when it dies is abandoned (the
holders resume by their lease). Every fan-out runs concurrently, each call under a
deadline; a holder that dies or misses its deadline surfaces as
``BackendUnavailableError`` after every other holder has been resumed.

Call order for a snapshot (driven by ``RayEnvironmentCheckpoint.snapshot``)::

    begin_snapshot(id, path)   ensure holders; pause and capture all (one call each)
    start_writes(id)           at the yield: every holder starts its write; the manifest's
                               rollouts are encoded meanwhile (neither is waited for)
    renew(id)                  every lease period while the caller's block runs
    commit_snapshot(id, path)  wait for every shard; write manifest.json; resume all
    abort_snapshot(id, path)   instead, on any failure: resume all; delete partial files

and for a restore (driven by ``RayEnvironmentCheckpoint.restored``)::

    prepare_restore(id, path)  read manifest; place instances; holders verify shards
    renew(id)
    commit_restore(id) | abort_restore(id)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.errors import (
    BackendUnavailableError,
    RestoreConflictError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.manifest import (
    EncodedRollouts,
    RolloutRow,
    ShardEntry,
    encode_manifest,
    encode_rollouts,
    shard_file_name,
)
from nemo_ckpt.phases import (
    CaptureReport,
    HolderInfo,
    PauseReport,
    instance_sort_key,
)
from nemo_ckpt.storage import (
    environment_dir,
    prepare_environment_dir,
    read_manifest,
    remove_snapshot_files,
    remove_unreferenced_files,
    write_manifest,
)
from nemo_ckpt.transport import Actor, Transport

__all__ = ["CheckpointCoordinator", "SnapshotBegun", "SnapshotCommitted", "RestoreBegun"]

log = logging.getLogger("nemo_ckpt.coordinator")
T = TypeVar("T")


@dataclass(frozen=True)
class SnapshotBegun:
    """The aggregate capture of every holder, handed to the driver at the yield."""

    snapshot_id: str
    instances: tuple[str, ...]
    pauses: tuple[PauseReport, ...]
    captures: tuple[CaptureReport, ...]
    entry_seconds: float


@dataclass(frozen=True)
class SnapshotCommitted:
    """What the commit wrote, in brief: the driver needs no per-session data back."""

    metrics: dict[str, float]
    rollouts: int
    shards: int
    removed_files: tuple[str, ...]


@dataclass(frozen=True)
class RestoreBegun:
    """What a prepared restore will continue, and where each instance landed."""

    restore_id: str
    continued_attempts: frozenset[tuple[str, str, int]]
    staging_keys: frozenset[str]
    placement: dict[str, str]  # instance id -> node id
    bytes_read: int


class CheckpointCoordinator:
    """Fans pause, snapshot and restore out to the session holders."""

    def __init__(self, config: CheckpointConfig, transport: Transport) -> None:
        self._config = config
        self._transport = transport
        self._runtime = transport.runtime
        self._clock = transport.runtime.clock
        self._metrics = transport.runtime.metrics
        self._holders: dict[str, Actor] = {}  # instance id -> actor handle
        self._holder_nodes: dict[str, str] = {}  # instance id -> node id
        self._ops: dict[str, list[str]] = {}  # snapshot/restore id -> instances taking part
        self._started: dict[str, float] = {}  # snapshot/restore id -> monotonic start
        self._captures: dict[str, tuple[CaptureReport, ...]] = {}  # snapshot id -> captures
        self._background: set[asyncio.Future[Any]] = set()  # kept so they are not collected
        # snapshot id -> the manifest's rollouts, encoded while the shards are written
        self._rollouts: dict[str, asyncio.Future[EncodedRollouts]] = {}
        self._placement_lock = asyncio.Lock()

    # --- holders ---------------------------------------------------------------------

    async def ensure_holders(self) -> list[HolderInfo]:
        """Find every live holder, and create one on each alive node that has none."""
        async with self._placement_lock:
            infos = await self._discover()
            hosted = {i.node_id for i in infos}
            for node_id in self._alive_node_ids():
                if node_id not in hosted:
                    try:
                        infos.append(await self._create_holder(self._free_instance_id(),
                                                               node_id))
                    except BackendUnavailableError as exc:
                        # Typically a node that died but is not yet declared dead. A
                        # node that stays without a holder fails check_startup.
                        log.warning("no holder could start on node %s: %s", node_id, exc)
            return sorted(infos, key=_instance_order)

    async def _known_holders(self) -> list[str]:
        """The holders to fan out to, re-discovered (and created on new nodes) only when
        none are known or the alive nodes changed: discovery costs a GCS round trip per
        holder, which the pause must not pay every time."""
        if not self._holders or set(self._alive_node_ids()) != set(self._holder_nodes.values()):
            await self.ensure_holders()
        return sorted(self._holders, key=instance_sort_key)

    async def holder_infos(self) -> list[HolderInfo]:
        """Every live holder's info, without creating any."""
        return sorted(await self._discover(), key=_instance_order)

    async def probe_storage(self, root: str) -> dict[str, str]:
        """Have every holder write a probe file under ``root``; returns instance -> path
        or ``error: ...``."""
        await self.ensure_holders()
        results = await asyncio.gather(
            *(self._transport.call(h, "probe_storage", root,
                                   timeout=self._config.phase_timeout_s)
              for h in self._holders.values()),
            return_exceptions=True)
        return {inst: (r if isinstance(r, str) else f"error: {r}")
                for inst, r in zip(self._holders, results, strict=True)}

    # --- snapshot ---------------------------------------------------------------------

    async def begin_snapshot(self, snapshot_id: str, checkpoint_path: str) -> SnapshotBegun:
        """Pause every holder, capture, and start persisting in the background.

        This is the pause's hot path: the holder set is the one known since the last
        discovery, re-discovered only when the alive nodes changed, and each holder
        pauses and captures in one call (``SessionHolder.begin``). The writes start at
        ``start_writes``, which the driver sends once it has this answer: started
        earlier, four writers on a shared machine slowed the answer by ~5 ms.
        ``finish_persist`` starts any write whose start message has not arrived.
        """
        start = self._clock.monotonic()
        self._started[snapshot_id] = start
        instances = await self._known_holders()
        self._ops[snapshot_id] = instances
        cfg = self._config
        try:
            directory = await self._runtime.run_blocking(prepare_environment_dir, checkpoint_path)
            begun = await self._fan(
                instances, "pause_capture",
                lambda h: self._transport.call(
                    h, "begin", snapshot_id, cfg.drain_timeout_s, cfg.lease_s, str(directory),
                    timeout=cfg.drain_timeout_s + cfg.phase_timeout_s),
                cfg.drain_timeout_s + cfg.phase_timeout_s, op_id=snapshot_id)
        except BaseException as exc:
            self._count_failure("snapshot", exc)
            if isinstance(exc, BackendUnavailableError):
                self._holders = {}  # a holder is gone: the next snapshot re-discovers
            await self.abort_snapshot(snapshot_id, checkpoint_path)
            raise
        captures = tuple(c for _, c in begun)
        self._captures[snapshot_id] = captures
        return SnapshotBegun(
            snapshot_id=snapshot_id, instances=tuple(instances),
            pauses=tuple(p for p, _ in begun), captures=captures,
            entry_seconds=self._clock.monotonic() - start)

    async def start_writes(self, snapshot_id: str) -> None:
        """Start every holder's write of the snapshot, and encode the manifest's
        rollouts meanwhile; waits for neither. Never raises: whatever fails here fails
        the commit (``finish_persist`` starts a write that did not start)."""
        instances = self._ops.get(snapshot_id)
        if instances is None or snapshot_id in self._rollouts:
            return
        refs = [self._transport.call(self._holders[i], "start_persist", snapshot_id)
                for i in instances if i in self._holders]
        done = asyncio.ensure_future(asyncio.gather(*refs, return_exceptions=True))
        self._background.add(done)
        done.add_done_callback(self._background.discard)
        self._encoding(snapshot_id)

    def _encoding(self, snapshot_id: str) -> asyncio.Future[EncodedRollouts]:
        """The encoding of the snapshot's rollouts, started on first use: by
        ``start_writes``, or by a commit that came first (then start_writes does
        nothing)."""
        encoding = self._rollouts.get(snapshot_id)
        if encoding is None:
            encoding = asyncio.ensure_future(self._runtime.run_blocking(
                _encode_rollouts, snapshot_id, self._captures.get(snapshot_id, ())))
            # Its error is raised by the commit's await; an aborted snapshot never awaits.
            encoding.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._rollouts[snapshot_id] = encoding
        return encoding

    async def renew(self, operation_id: str) -> None:
        """Renew the lease of every holder taking part in the operation."""
        instances = self._ops.get(operation_id)
        if instances is None:
            raise BackendUnavailableError(
                f"coordinator knows no operation {operation_id}; it was restarted, so the "
                f"holders resume by their lease; retry")
        await self._fan(instances, "renew_lease",
                        lambda h: self._transport.call(
                            h, "renew_lease", operation_id, self._config.lease_s,
                            timeout=self._config.phase_timeout_s),
                        self._config.phase_timeout_s)

    async def commit_snapshot(self, snapshot_id: str, checkpoint_path: str,
                              metrics: dict[str, float], restarted: int) -> SnapshotCommitted:
        """Wait for every shard, write the manifest last, then resume every holder."""
        instances = self._require_op(snapshot_id)
        directory = environment_dir(checkpoint_path)
        try:
            persists = await self._fan(
                instances, "finish_persist",
                lambda h: self._transport.call(h, "finish_persist", snapshot_id,
                                               timeout=self._config.persist_timeout_s),
                self._config.persist_timeout_s, op_id=snapshot_id)
            shards: list[ShardEntry] = [s for p in persists for s in p.shards]
            all_metrics = dict(metrics)
            all_metrics.update(
                persist_seconds=max((p.persist_seconds for p in persists), default=0.0),
                bytes_written=float(sum(p.bytes_written for p in persists)),
            )
            rollouts = await self._encoding(snapshot_id)
            await self._runtime.run_blocking(write_manifest, directory, encode_manifest(
                snapshot_id=snapshot_id,
                created_at=datetime.fromtimestamp(self._clock.wall(), timezone.utc),
                instances=instances, shards=shards, rollouts=rollouts,
                restarted_rollouts=restarted, metrics=all_metrics))
            captured = rollouts.count
        except BaseException as exc:
            self._count_failure("snapshot", exc)
            await self.abort_snapshot(snapshot_id, checkpoint_path)
            raise
        # Committed: resume first; the older snapshots' files are garbage from here on
        # and their removal must not lengthen the pause.
        await self._resume_all(snapshot_id, instances)
        removed = await self._runtime.run_blocking(remove_unreferenced_files, directory,
                                          [s.file for s in shards])
        self._record_commit(snapshot_id, all_metrics, captured, restarted)
        return SnapshotCommitted(metrics=all_metrics, rollouts=captured,
                                 shards=len(shards), removed_files=tuple(removed))

    async def abort_snapshot(self, snapshot_id: str, checkpoint_path: str,
                             caller_error: str | None = None) -> list[str]:
        """Resume every holder and delete this snapshot's files. Never raises for a
        holder that is gone: it is not paused any more either.

        ``caller_error`` names the exception that ended the caller's block, counted in
        the failure metric (the coordinator counts its own failures itself)."""
        if caller_error is not None:
            self._count_failure("snapshot", caller_error)
        instances = self._ops.get(snapshot_id)
        if instances is None:
            # A coordinator that did not begin this snapshot (its predecessor died):
            # every holder may be paused for it.
            await self._discover()
            instances = sorted(self._holders, key=instance_sort_key)
        self._started.pop(snapshot_id, None)
        await self._resume_all(snapshot_id, instances)
        return await self._runtime.run_blocking(
            remove_snapshot_files, environment_dir(checkpoint_path), snapshot_id)

    # --- restore ----------------------------------------------------------------------

    async def prepare_restore(self, restore_id: str, checkpoint_path: str) -> RestoreBegun:
        """Verify the snapshot and have each instance's holder load it, nothing live yet."""
        self._started[restore_id] = self._clock.monotonic()
        try:
            return await self._prepare_restore(restore_id, checkpoint_path)
        except BaseException as exc:
            self._started.pop(restore_id, None)
            self._count_failure("restore", exc)
            raise

    async def _prepare_restore(self, restore_id: str, checkpoint_path: str) -> RestoreBegun:
        manifest = await self._runtime.run_blocking(read_manifest, checkpoint_path)
        await self._known_holders()
        async with self._placement_lock:
            for inst in sorted(manifest.instances, key=instance_sort_key):
                if inst not in self._holders:
                    await self._create_holder(inst, await self._least_loaded_node())
        instances = sorted(self._holders, key=instance_sort_key)
        self._ops[restore_id] = instances
        restored = {r.rollout_id for r in manifest.rollouts}
        try:
            directory = str(environment_dir(checkpoint_path))
            shards_of: dict[str, list[ShardEntry]] = {i: [] for i in instances}
            for shard in manifest.shards:
                shards_of[shard.instance_id].append(shard)
            prepared = await self._fan(
                instances, "prepare_restore",
                lambda h, inst: self._transport.call(
                    h, "prepare_restore", restore_id, directory, shards_of[inst],
                    self._config.lease_s, timeout=self._config.persist_timeout_s),
                self._config.persist_timeout_s, with_instance=True, op_id=restore_id)
            # Nothing is live yet: a rollout live on any holder refuses the whole restore.
            clash = sorted({(p.instance_id, rid) for p in prepared
                            for rid in p.live_rollouts if rid in restored})
            if clash:
                raise RestoreConflictError(
                    f"cannot restore {checkpoint_path}: rollouts it holds are live now "
                    f"({', '.join(f'{i}/{k}' for i, k in clash[:10])}"
                    f"{' ...' if len(clash) > 10 else ''}); retire or close them first, or "
                    f"restore into a fresh job")
        except BaseException:
            await self.abort_restore(restore_id)
            raise
        return RestoreBegun(
            restore_id=restore_id,
            continued_attempts=frozenset(
                (p.instance_id, rid, attempt) for p in prepared for rid, attempt in p.continued),
            staging_keys=frozenset().union(*(p.staging_keys for p in prepared)),
            placement={i: self._holder_nodes[i] for i in instances},
            bytes_read=sum(p.bytes_read for p in prepared),
        )

    async def commit_restore(self, restore_id: str) -> int:
        """Make every restored session live. Returns how many."""
        instances = self._require_op(restore_id)
        try:
            counts = await self._fan(instances, "commit_restore",
                                     lambda h: self._transport.call(
                                         h, "commit_restore", restore_id,
                                         timeout=self._config.phase_timeout_s),
                                     self._config.phase_timeout_s, op_id=restore_id)
        except BaseException as exc:
            self._count_failure("restore", exc)
            await self.abort_restore(restore_id)
            raise
        self._ops.pop(restore_id, None)
        started = self._started.pop(restore_id, None)
        if started is not None:
            self._metrics.observe("restore_duration", self._clock.monotonic() - started)
        return sum(counts)

    async def abort_restore(self, restore_id: str, caller_error: str | None = None) -> None:
        """Every holder drops what it restored and resumes. ``caller_error`` as in
        ``abort_snapshot``."""
        if caller_error is not None:
            self._count_failure("restore", caller_error)
        instances = self._ops.pop(restore_id, None)
        if instances is None:
            await self._discover()
            instances = sorted(self._holders, key=instance_sort_key)
        self._started.pop(restore_id, None)
        await self._fan(instances, "abort_restore",
                        lambda h: self._transport.call(h, "abort_restore", restore_id,
                                                       timeout=self._config.phase_timeout_s),
                        self._config.phase_timeout_s, tolerate_failures=True)

    # --- ledger operations --------------------------------------------------------------

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Retire these attempts on every holder; returns the capture keys dropped."""
        return await self._ledger_op("retire", episodes)

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Forget these attempts on every holder; returns the capture keys dropped."""
        return await self._ledger_op("forget", episodes)

    async def _ledger_op(self, op: str, episodes: list[EnvironmentEpisode]) -> list[str]:
        # RL retires an attempt per finished rollout: use the known holders, and pay for
        # a rediscovery only when there are none or one of them has gone.
        if not self._holders:
            await self.ensure_holders()
        try:
            dropped = await self._fan(sorted(self._holders, key=instance_sort_key), op,
                                      lambda h: self._transport.call(
                                          h, op, episodes,
                                          timeout=self._config.phase_timeout_s),
                                      self._config.phase_timeout_s)
        except BackendUnavailableError:
            await self.ensure_holders()
            dropped = await self._fan(sorted(self._holders, key=instance_sort_key), op,
                                      lambda h: self._transport.call(
                                          h, op, episodes,
                                          timeout=self._config.phase_timeout_s),
                                      self._config.phase_timeout_s)
        return sorted(k for keys in dropped for k in keys)

    # --- internals ----------------------------------------------------------------------

    def _require_op(self, op_id: str) -> list[str]:
        instances = self._ops.get(op_id)
        if instances is None:
            raise BackendUnavailableError(
                f"coordinator knows no operation {op_id}: it restarted since the operation "
                f"began, and the holders resume by their lease; retry the operation")
        return instances

    async def _resume_all(self, snapshot_id: str, instances: list[str]) -> None:
        self._ops.pop(snapshot_id, None)
        self._captures.pop(snapshot_id, None)
        self._rollouts.pop(snapshot_id, None)
        await self._fan(instances, "resume",
                        lambda h: self._transport.call(h, "resume", snapshot_id,
                                                       timeout=self._config.phase_timeout_s),
                        self._config.phase_timeout_s, tolerate_failures=True)

    async def _fan(
        self,
        instances: Iterable[str],
        what: str,
        call: Callable[..., Awaitable[T]],
        timeout: float,
        tolerate_failures: bool = False,
        with_instance: bool = False,
        op_id: str | None = None,
    ) -> list[T]:
        """Call every instance's holder concurrently; raise after all have answered.

        With ``op_id``, logs one structured line: the phase, its per-holder seconds and
        the slowest holder, so that a slow pause names its cause.
        """
        instances = list(instances)
        seconds: dict[str, float] = {}
        start = self._clock.monotonic()

        async def one(inst: str) -> T:
            handle = self._holders.get(inst)
            if handle is None:
                raise BackendUnavailableError(f"holder {inst} is gone (during {what})")
            try:
                return await (call(handle, inst) if with_instance else call(handle))
            finally:
                seconds[inst] = self._clock.monotonic() - start

        results = await asyncio.gather(*(one(i) for i in instances), return_exceptions=True)
        errors = [(i, r) for i, r in zip(instances, results, strict=True)
                  if isinstance(r, BaseException)]
        if op_id is not None:
            _log_phase(op_id, what, self._clock.monotonic() - start, seconds,
                       {i: f"{type(e).__name__}: {e}" for i, e in errors})
        if errors and not tolerate_failures:
            # A real refusal says more than "unreachable": raise it first.
            errors.sort(key=lambda e: isinstance(e[1], BackendUnavailableError))
            first = errors[0][1]
            if len(errors) > 1:
                log.warning("%s failed on %d holders: %s", what, len(errors),
                            "; ".join(f"{i}: {e}" for i, e in errors))
            raise first
        for inst, err in errors:
            log.warning("%s on %s failed (tolerated): %s", what, inst, err)
        return [r for r in results if not isinstance(r, BaseException)]

    async def _discover(self) -> list[HolderInfo]:
        found = self._transport.holders()
        results = await asyncio.gather(
            *(self._transport.call(h, "info", timeout=self._config.phase_timeout_s)
              for h in found.values()),
            return_exceptions=True)
        infos = []
        self._holders = {}
        self._holder_nodes = {}
        for (inst, handle), res in zip(found.items(), results, strict=True):
            if isinstance(res, HolderInfo):
                self._holders[inst] = handle
                self._holder_nodes[inst] = res.node_id
                infos.append(res)
            else:
                log.warning("holder %s does not answer (%s); treating it as lost", inst, res)
        return infos

    def _record_commit(self, snapshot_id: str, figures: dict[str, float], captured: int,
                       restarted: int) -> None:
        started = self._started.pop(snapshot_id, None)
        if started is not None:
            elapsed = self._clock.monotonic() - started
            self._metrics.observe("snapshot_duration", elapsed)
            # Holders pause at the start of begin_snapshot and resume at the end of the
            # commit, so the coordinator's span bounds their paused time.
            self._metrics.observe("paused", elapsed)
        self._metrics.inc("bytes_written", figures.get("bytes_written", 0.0))
        self._metrics.inc("captured", float(captured))
        self._metrics.inc("restarted", float(restarted))

    def _count_failure(self, operation: str, error: BaseException | str) -> None:
        kind = error if isinstance(error, str) else type(error).__name__
        self._metrics.inc("failures", 1.0, tags={"operation": operation, "kind": kind})

    def _alive_node_ids(self) -> list[str]:
        return self._transport.alive_nodes()

    def _free_instance_id(self) -> str:
        k = 0
        while f"holder-{k}" in self._holders:
            k += 1
        return f"holder-{k}"

    async def _least_loaded_node(self) -> str:
        infos = await self._discover()
        load = {n: 0 for n in self._alive_node_ids()}
        for info in infos:
            if info.node_id in load:
                load[info.node_id] += 1
        if not load:
            raise BackendUnavailableError("no alive Ray node to place a holder on")
        return min(load, key=lambda n: (load[n], n))

    async def _create_holder(self, instance_id: str, node_id: str) -> HolderInfo:
        cfg = self._config
        handle = self._transport.create_holder(
            instance_id, node_id,
            {"max_state_bytes": cfg.max_state_bytes, "turn_timeout_s": cfg.turn_timeout_s})
        info: HolderInfo = await self._transport.call(handle, "info",
                                                      timeout=cfg.phase_timeout_s)
        self._holders[instance_id] = handle
        self._holder_nodes[instance_id] = info.node_id
        log.info("created holder %s on node %s", instance_id, node_id)
        return info

def _encode_rollouts(snapshot_id: str, captures: tuple[CaptureReport, ...]
                     ) -> EncodedRollouts:
    """The manifest's rollouts, from what each holder captured; each sits in the shard
    its holder writes (``shard_file_name``, which the commit checks against the shards
    written).

    Built here rather than by the holders: shipping a validated model per session from
    every holder cost more than writing the shards (benchmarks/README.md)."""
    rows: list[RolloutRow] = []
    for c in captures:
        shard = shard_file_name(snapshot_id, c.instance_id)
        rows += [(c.instance_id, rollout_id, attempt, turns, sorted(keys), shard)
                 for rollout_id, attempt, keys, turns in c.captured()]
    return encode_rollouts(rows)


def _log_phase(op_id: str, phase: str, seconds: float, per_holder: dict[str, float],
               errors: dict[str, str]) -> None:
    slowest = max(per_holder, key=lambda i: per_holder[i], default=None)
    line = {
        "event": "phase", "operation": op_id, "phase": phase, "seconds": round(seconds, 6),
        "holders": {i: round(t, 6) for i, t in sorted(per_holder.items())},
        "slowest": slowest,
    }
    if errors:
        line["errors"] = errors
    log.log(logging.WARNING if errors else logging.INFO, "nemo_ckpt %s", json.dumps(line))


def _instance_order(info: HolderInfo) -> tuple[int, str]:
    return instance_sort_key(info.instance_id)

