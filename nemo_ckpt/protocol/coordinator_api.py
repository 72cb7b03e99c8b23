"""The coordinator's interface as the driver sees it, and what its phases answer.

Each call is declared once, as a method of the Protocol of the coordinator's part that
serves it (``nemo_ckpt.protocol.calls``); ``CoordinatorApi`` gathers them and states their
order once. ``actors.coordinator.actor.CheckpointCoordinator`` serves it, each Protocol by
one part (``serves``); ``coordinator_calls`` is the driver's typed proxy, which hands each
call to whatever carries it to the one named coordinator (the driver's retrying call).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.phases import CaptureReport, HolderInfo, PauseReport
from nemo_ckpt.protocol.calls import Call, Proxy, one_way
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.transport import Transport

__all__ = [
    "CoordinatorApi",
    "CoordinatorHolderCalls",
    "CoordinatorLedgerCalls",
    "CoordinatorOperationCalls",
    "CoordinatorRestoreCalls",
    "CoordinatorSetupCalls",
    "CoordinatorSnapshotCalls",
    "RestoreBegun",
    "SnapshotBegun",
    "SnapshotCommitted",
    "coordinator_calls",
    "direct_coordinator_calls",
]


@dataclass(frozen=True)
class SnapshotBegun:
    """The aggregate capture of every holder, handed to the driver at the yield."""

    snapshot_id: str
    instances: tuple[str, ...]
    pauses: tuple[PauseReport, ...]
    captures: tuple[CaptureReport, ...]
    entry_seconds: float
    # Names the holders paused, incarnation by incarnation: it changes whenever one of
    # them does, so that the driver looks its handles on them up again (it releases
    # them itself as its block exits: ``RayEnvironmentCheckpoint``).
    holder_set: str = ""


@dataclass(frozen=True)
class SnapshotCommitted:
    """What the commit wrote, in brief: the driver needs no per-session data back."""

    metrics: dict[str, float | int]
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
    read_seconds: float  # the slowest holder's shard reads (``RestorePrepared``)
    finished: tuple[FinishedRollout, ...] = ()  # results to hand back (nemo_ckpt.receipts)


class CoordinatorSetupCalls(Protocol):
    """The job's config, and the checks of ``check_startup``."""

    async def attach(self, config: CheckpointConfig) -> None: ...

    async def startup_warnings(self) -> list[str]: ...

    async def probe_storage(self, root: str) -> dict[str, str]: ...

    async def probe_sandboxes(self) -> dict[str, str]: ...

    async def probe_containers(self) -> dict[str, tuple[list[str], list[str]]]: ...


class CoordinatorHolderCalls(Protocol):
    """The job's holders: each alive node's made (``ensure_holders``) or listed."""

    async def ensure_holders(self) -> list[HolderInfo]: ...

    async def holder_infos(self) -> list[HolderInfo]: ...


class CoordinatorOperationCalls(Protocol):
    """What every operation takes: its lease kept up, and its end without a trace."""

    async def renew(self, operation_id: str) -> None: ...

    async def abort(self, operation_id: str, checkpoint_path: str | None = None,
                    caller_error: str | None = None) -> str: ...


class CoordinatorSnapshotCalls(Protocol):
    """A snapshot's steps (their order: ``CoordinatorApi``)."""

    async def begin_snapshot(self, snapshot_id: str, checkpoint_path: str,
                             drain_timeout_s: float | None = None, trace: str = "",
                             stop: bool = False) -> SnapshotBegun: ...

    @one_way
    async def start_writes(self, snapshot_id: str) -> None: ...

    async def commit_snapshot(self, snapshot_id: str, checkpoint_path: str,
                              metrics: dict[str, float | int], restarted: int,
                              stop: bool = False) -> SnapshotCommitted: ...


class CoordinatorRestoreCalls(Protocol):
    """A restore's steps (their order: ``CoordinatorApi``)."""

    async def prefetch_restore(self, checkpoint_path: str) -> int: ...

    async def prepare_restore(self, restore_id: str, checkpoint_path: str, trace: str = ""
                              ) -> RestoreBegun: ...

    async def commit_restore(self, restore_id: str) -> int: ...


class CoordinatorLedgerCalls(Protocol):
    """RL's ledger operations, on every holder: the capture keys dropped."""

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]: ...

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]: ...


class CoordinatorApi(CoordinatorSetupCalls, CoordinatorHolderCalls,
                     CoordinatorOperationCalls, CoordinatorSnapshotCalls,
                     CoordinatorRestoreCalls, CoordinatorLedgerCalls, Protocol):
    """The calls a driver makes of the coordinator.

    The call order, stated here once (the other docstrings point here; what each holder
    is asked meanwhile: ``nemo_ckpt.protocol.holder_api.HolderControl``). A snapshot (driven by
    ``RayEnvironmentCheckpoint.snapshot``):

        1) (driver) renew(id)                   every renewal period, from the start to the
                                                end, whatever phase is running
        2) (driver) begin_snapshot(id, path[, drain][, trace][, stop])
                                                claim the path; every holder pauses, waits
                                                up to ``drain`` (default: the config's) for
                                                turns in flight, and captures (one call
                                                each; with ``stop``, the sessions still
                                                mid-turn too, as of their last committed
                                                turn: 4 will park them)
        3) (driver) start_writes(id)            at the yield: every holder starts writing;
                                                the manifest's rollouts are encoded meanwhile
        4) (driver) commit_snapshot(id, path, metrics, restarted[, stop])
                                                holders released (gates open) at once; every
                                                shard durable, manifest.json written last (the
                                                commit point), the snapshot ended on every
                                                holder, the files it replaced removed. With
                                                ``stop`` no holder is released: once the
                                                manifest is durable each parks its sessions
                                                (drops them, frees their sandboxes, refuses
                                                new turns until a restore), and 5 is not sent
        5) (driver) release(id) to each holder  right after 4 is sent, from the driver
                                                itself (``nemo_ckpt.driver.holder_handles``:
                                                handles looked up by name in the background
                                                once the driver knows the holders, again
                                                when 2 names a new ``holder_set``): each
                                                holder resumes at the sooner of this and 4's
                                                release, one hop shorter; 4 releases as
                                                before, so a driver that dies after 4, a lost
                                                or late copy, or a stale handle changes
                                                nothing (a holder ignores a release of a
                                                snapshot it is not paused for)
        or abort(id, path) instead of 3-5, on any failure or cancellation; it answers
        with the operation's outcome, which is "committed" if the commit won.

    and of a restore (driven by ``RayEnvironmentCheckpoint.restored``):

        1) (driver) renew(id)                   as above
        2) (driver) prepare_restore(id, path[, trace])
                                                read the manifest; place every instance;
                                                holders read and verify their shards; what
                                                they read is checked against the manifest
        3) (driver) commit_restore(id)          every holder makes its sessions live
        or abort(id) instead of 3, or after a 3 that failed on some holder: the holders
        that went live drop the restored sessions again (all or nothing).
    """


def coordinator_calls(invoke: Callable[..., Awaitable[Any]],
                      tell: Callable[..., None] | None = None) -> CoordinatorApi:
    """``CoordinatorApi``'s calls through ``invoke(method, *args)``, which carries a call
    to the coordinator and returns its answer; a message (``start_writes``) goes through
    ``tell(method, *args)``, as the driver never waits for it."""
    send = None if tell is None else (lambda made: tell(made.method, *made.args))
    return cast(CoordinatorApi, Proxy(
        (CoordinatorApi,), lambda made: invoke(made.method, *made.args), send))


def direct_coordinator_calls(transport: Transport, timeout: float | None = None
                             ) -> CoordinatorApi:
    """Calls to the transport's coordinator, each with ``timeout``, sent once."""

    def invoke(made: Call[Any]) -> Awaitable[Any]:
        return transport.call(transport.coordinator(), made.method, *made.args,
                              timeout=timeout)

    return cast(CoordinatorApi, Proxy(
        (CoordinatorApi,), invoke,
        lambda made: transport.send(transport.coordinator(), made.method, *made.args)))
