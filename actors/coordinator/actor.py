"""The checkpoint coordinator: one named actor that fans every phase out to the holders.

It reaches the holders only through its ``Transport`` (``nemo_ckpt.transport``), so
the same code runs as a Ray actor (``actors.ray_transport``) and in the simulation.

The coordinator routes each call to its parts:

- ``actors.coordinator.operation_table.OperationTable``: one record per snapshot or restore, whose
  state is a value (``actors.coordinator.states``) changed only by ``set_state``, which
  alone records the outcome; a late or repeated call is answered with it or refused;
- ``actors.coordinator.holders.HolderRegistry``: the holders, their placement, the fan-out
  (a failure that several holders report carries each one's error:
  ``nemo_ckpt.errors.aggregate``);
- ``actors.coordinator.folders.ClaimedFolders``: the claims on snapshot folders and the clean-up;
- ``actors.coordinator.blobs.BlobCollector``: snapshots' holds on the blob store and its
  collection;
- ``actors.coordinator.lifecycle.OperationLifecycle``: an operation opened, renewed,
  reaped when its driver stopped renewing, and aborted: the one place an operation ends
  without committing; each kind's undo (``SnapshotHolds``, ``RestoreHolds``) lives
  beside its phases;
- ``actors.coordinator.snapshot.Snapshots`` and ``actors.coordinator.restore.Restores``: the phases;
- ``actors.coordinator.restore_plan``: a restore's shard assignment and checks, pure.

The coordinator's interface is ``nemo_ckpt.protocol.coordinator_api.CoordinatorApi``.

The order of the driver's calls is stated once, numbered, on
``nemo_ckpt.protocol.coordinator_api.CoordinatorApi``; the holders', on
``nemo_ckpt.protocol.holder_api.HolderControl``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from actors.coordinator.blobs import BlobCollector
from actors.coordinator.folders import ClaimedFolders
from actors.coordinator.holders import HolderRegistry
from actors.coordinator.ledger import Ledger
from actors.coordinator.lifecycle import OperationLifecycle
from actors.coordinator.operation_table import OperationTable
from actors.coordinator.parts import CoordinatorParts
from actors.coordinator.restore import RestoreHolds, Restores
from actors.coordinator.retire_marks import RetireMarks
from actors.coordinator.snapshot import SnapshotHolds, Snapshots
from nemo_ckpt import tracing
from nemo_ckpt.config import (
    ADOPTED_FIELDS,
    DRIVER_FIELDS,
    CheckpointConfig,
    config_differences,
)
from nemo_ckpt.errors import (
    BackendUnavailableError,
    ConfigMismatchError,
)
from nemo_ckpt.phases import (
    HolderInfo,
    instance_sort_key,
)
from nemo_ckpt.protocol.calls import serves
from nemo_ckpt.protocol.coordinator_api import (
    CoordinatorHolderCalls,
    CoordinatorLedgerCalls,
    CoordinatorOperationCalls,
    CoordinatorRestoreCalls,
    CoordinatorSetupCalls,
    CoordinatorSnapshotCalls,
    RestoreBegun,
    SnapshotBegun,
    SnapshotCommitted,
)
from nemo_ckpt.storage.claims import ClaimWatch
from nemo_ckpt.storage.location import join_location
from nemo_ckpt.transport import COORDINATOR, Transport
from nemo_ckpt.trees.blob_store import BLOB_DIR
from nemo_ckpt.trees.collection import CollectionReport

__all__ = ["CheckpointCoordinator", "SnapshotBegun", "SnapshotCommitted", "RestoreBegun"]

log = logging.getLogger("nemo_ckpt.coordinator")


@serves({
    CoordinatorSetupCalls: None,  # the coordinator's own
    CoordinatorHolderCalls: ("_holder_calls", HolderRegistry),
    CoordinatorOperationCalls: ("_lifecycle", OperationLifecycle),
    CoordinatorSnapshotCalls: ("_snapshots", Snapshots),
    CoordinatorRestoreCalls: ("_restores", Restores),
    CoordinatorLedgerCalls: ("_ledger", Ledger),
})
class CheckpointCoordinator:
    """Fans pause, snapshot and restore out to the session holders."""

    if TYPE_CHECKING:
        # The routed methods are made as the class is (``serves``), so mypy does not
        # see them; ``serves`` checks each against its Protocol, and each part is
        # typed by the Protocol it serves (``__init__``).
        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, config: CheckpointConfig, transport: Transport) -> None:
        self._transport = transport
        self._trace_problem = tracing.write_spans_or_say_why(
            None if config.trace_file is None else str(config.trace_file))
        if self._trace_problem is not None:
            log.warning("the coordinator writes no spans: %s", self._trace_problem)
        self._runtime = transport.runtime
        self._clock = transport.runtime.clock
        self._metrics = transport.runtime.metrics
        # Every counter's series exists from the start, at 0: a dashboard reads "no
        # failure yet", not "no data" (kind "" reads as no kind label in Prometheus).
        for counter in ("bytes_written", "captured", "restarted"):
            self._metrics.inc(counter, 0.0)
        for operation in ("snapshot", "restore"):
            self._metrics.inc("failures", 0.0, {"operation": operation, "kind": ""})
        self._owner = f"{config.namespace}@{transport.cluster_id}"
        # This incarnation: Ray may declare a coordinator dead that runs again later (a
        # stalled node), beside its successor of the same owner; their claims differ.
        self._incarnation = self._runtime.token()[:16]
        self.collector_name = f"{self._owner}#{self._incarnation}"
        # Other writers' claims (paths, the blob store), judged on this process's clock:
        # kept for the coordinator's life, as only a claim seen before can be found
        # abandoned (nemo_ckpt.storage.claims).
        claim_watch = ClaimWatch(self._clock.monotonic)
        operations = OperationTable(config.lease_s)
        self._parts = CoordinatorParts(
            config=config, transport=transport, operations=operations,
            holders=HolderRegistry(transport, lambda: self._config.phase_timeout_s,
                                   lambda: holder_options(self._config),
                                   lambda: self._config.relay_min_holders,
                                   RetireMarks(lambda: self._config.max_retired_marks)),
            folders=ClaimedFolders(self._runtime, self._owner, self._incarnation,
                                   claim_watch, lambda: self._parts.claim_ttl),
            blobs=BlobCollector(
                _blob_store_root(config),
                self._runtime, self._owner, self.collector_name, claim_watch,
                lambda: bool(operations), config.tree_budget))
        self.operations = operations
        self.holders = self._parts.holders
        self._holder_calls: CoordinatorHolderCalls = self.holders  # mypy checks it serves
        self.folders = self._parts.folders
        self.blobs = self._parts.blobs
        self._calls = self._parts.calls
        snapshot_holds = SnapshotHolds(self._parts)
        lifecycle = OperationLifecycle(self._parts, snapshot_holds, RestoreHolds())
        # Each part typed by the Protocol it serves: mypy checks that it does.
        self._lifecycle: CoordinatorOperationCalls = lifecycle
        self._snapshots: CoordinatorSnapshotCalls = Snapshots(
            self._parts, lifecycle, snapshot_holds, self._incarnation)
        self._restores: CoordinatorRestoreCalls = Restores(self._parts, lifecycle)
        self._ledger: CoordinatorLedgerCalls = Ledger(transport, self._parts.holders)
        self._ending = False  # stepping aside for a coordinator of the job's config

    @property
    def _config(self) -> CheckpointConfig:
        return self._parts.config

    # --- the job's config ------------------------------------------------------------

    async def attach(self, config: CheckpointConfig) -> None:
        """A driver's first call: its ``config`` against the one this coordinator and the
        holders it finds were made with (a restarted driver finds them alive, made by
        whoever created them). Deadlines are adopted from the newest driver; any other
        difference is refused with ``ConfigMismatchError`` naming each field
        (``nemo_ckpt.config.ADOPTED_FIELDS`` says which are which).

        A coordinator whose own config the holders it finds were not made with was made
        after its predecessor died, by a call of a driver with another config: it cannot
        serve them, so it ends itself (``_step_aside``) and frees the name for a driver
        with the job's config, which is told to retry (simulation seed 2654)."""
        async with self.holders.lock:
            infos = await self.holders.discover()
        if _made_otherwise(infos, holder_options(self._config)):
            self._step_aside()
            yours = _made_otherwise(infos, holder_options(config))
            if not yours:
                raise _stepping_aside(self._config.namespace)
            raise _mismatch(self._config.namespace, yours)
        fixed = config_differences(
            self._config, config,
            frozenset(CheckpointConfig.model_fields) - DRIVER_FIELDS - ADOPTED_FIELDS)
        problems = [f"{name} is {theirs!r} there, {ours!r} in yours"
                    for name, (theirs, ours) in fixed.items()]
        if problems:
            raise _mismatch(self._config.namespace, problems)
        adopted = config_differences(self._config, config, ADOPTED_FIELDS)
        if adopted:
            log.warning("a driver attached with other deadlines; adopting them: %s",
                        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in adopted.items()))
            self._parts.config = CheckpointConfig.model_validate({
                **self._config.model_dump(),
                **{k: getattr(config, k) for k in ADOPTED_FIELDS | DRIVER_FIELDS}})
            self.operations.lease_s = self._config.lease_s

    def _step_aside(self) -> None:
        """End this coordinator once its answer has left (once, and only while the name
        is still its own: a successor's is not ours to end)."""
        if self._ending or not self._transport.is_registered_coordinator():
            return
        self._ending = True
        log.warning("this coordinator was made with a config the namespace's holders were "
                    "not made with; it ends itself")
        asyncio.get_running_loop().call_later(_STEP_ASIDE_AFTER_S, self._transport.end_self)

    # --- holders ---------------------------------------------------------------------

    async def startup_warnings(self) -> list[str]:
        """What ``check_startup`` warns of about the coordinator itself (its trace file)."""
        if self._trace_problem is None:
            return []
        return [f"the coordinator writes no spans: {self._trace_problem}"]

    async def probe_storage(self, root: str) -> dict[str, str]:
        """Have every holder write a probe file under ``root``; returns instance -> path
        or ``error: ...``."""
        await self.holders.ensure_holders()
        results = await asyncio.gather(
            *(self._calls(h).probe_storage(root) for h in self.holders.handles.values()),
            return_exceptions=True)
        return {inst: (r if isinstance(r, str) else f"error: {r}")
                for inst, r in zip(self.holders.handles, results, strict=True)}

    async def probe_sandboxes(self) -> dict[str, str]:
        """Have every holder check its sandbox cache; instance -> "" or ``error: ...``."""
        await self.holders.ensure_holders()
        results = await asyncio.gather(
            *(self._calls(h).probe_sandbox() for h in self.holders.handles.values()),
            return_exceptions=True)
        return {inst: ("" if not isinstance(r, BaseException) else f"error: {r}")
                for inst, r in zip(self.holders.handles, results, strict=True)}

    async def probe_containers(self) -> dict[str, tuple[list[str], list[str]]]:
        """Have every holder check its node's container runtime: instance ->
        (problems, warnings)."""
        await self.holders.ensure_holders()
        results = await asyncio.gather(
            *(self._calls(h).probe_containers() for h in self.holders.handles.values()),
            return_exceptions=True)
        return {inst: (r if not isinstance(r, BaseException)
                       else ([f"{inst}: the container check failed: {r}"], []))
                for inst, r in zip(self.holders.handles, results, strict=True)}

    async def collection_done(self) -> CollectionReport | None:
        """Wait for the blob store's collection in progress, if any; the last one's
        report (for tests and tools)."""
        return await self.blobs.done()


# How long a coordinator that steps aside waits for its answer to leave before it ends.
_STEP_ASIDE_AFTER_S = 0.5


def _blob_store_root(cfg: CheckpointConfig) -> str | None:
    """The root whose blob store holds sandbox files: the checkpoint root, once sessions
    may own sandboxes."""
    if cfg.sandbox_root is None or cfg.checkpoint_root is None:
        return None
    return str(cfg.checkpoint_root)


def holder_options(cfg: CheckpointConfig) -> dict[str, Any]:
    """The ``SessionHolder`` keyword arguments ``cfg``'s holders are made with."""
    root = _blob_store_root(cfg)
    return {"max_state_bytes": cfg.max_state_bytes, "turn_timeout_s": cfg.turn_timeout_s,
            "max_retired_marks": cfg.max_retired_marks, "namespace": cfg.namespace,
            "sandbox_root": None if cfg.sandbox_root is None else str(cfg.sandbox_root),
            "blob_root": None if root is None else join_location(root, BLOB_DIR),
            "sandbox_limits": cfg.sandbox_limits, "tree_budget": cfg.tree_budget,
            "sandbox_restore_setid": cfg.sandbox_restore_setid,
            "container_env": dict(cfg.container_env) if cfg.containers else None,
            "trace_file": None if cfg.trace_file is None else str(cfg.trace_file)}


def _made_otherwise(infos: list[HolderInfo], wanted: dict[str, Any]) -> list[str]:
    """Each way the holders of ``infos`` were made otherwise than ``wanted`` says."""
    problems = []
    for info in sorted(infos, key=lambda i: instance_sort_key(i.instance_id)):
        differ = sorted(k for k, v in info.options.items() if k in wanted and wanted[k] != v)
        problems += [f"{info.instance_id} was made with {k}={info.options[k]!r}, "
                     f"yours gives {wanted[k]!r}" for k in differ]
    return problems


def _mismatch(namespace: str, problems: list[str]) -> ConfigMismatchError:
    return ConfigMismatchError(
        f"namespace {namespace!r} already runs nemo-ckpt actors made with another "
        f"CheckpointConfig: {'; '.join(problems)}. Use the job's values, end the old job's "
        f"actors first (RayEnvironmentCheckpoint(old_config).shutdown()), or give this job "
        f"a namespace of its own")


def _stepping_aside(namespace: str) -> BackendUnavailableError:
    """To a driver whose config the holders were made with, from a coordinator that was
    not: the coordinator is as good as gone, so the driver's call is sent again."""
    error = BackendUnavailableError(
        f"the nemo-ckpt coordinator of namespace {namespace!r} was made by a driver with "
        f"another CheckpointConfig after its predecessor ended; it ends itself so that a "
        f"driver with the job's config makes the next one; retry")
    error.unreachable = COORDINATOR
    return error
