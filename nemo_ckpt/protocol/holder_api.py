"""A session holder's interface as its callers see it: typed, whatever carries the call.

Each call is declared once, as a method of the Protocol of the holder's part that serves
it (``nemo_ckpt.protocol.calls``): ``HolderControl`` gathers what the coordinator calls
(the driver sends ``release`` too, ``nemo_ckpt.driver.holder_handles``), and states their
order once; ``HolderSessions`` what an environment worker's ``SessionClient`` calls.
``actors.holder.actor.SessionHolder`` serves both, each Protocol by one part
(``serves``); ``holder_calls`` and ``session_calls`` are their callers' typed proxies,
which hand each call to a ``Transport`` (``nemo_ckpt.transport``), so the transport
(Ray, or the simulation's seeded one) keeps its control over delivery.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, cast

from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.phases import (
    CaptureReport,
    HolderInfo,
    PauseReport,
    PersistReport,
    RestorePrepared,
    ShardRef,
)
from nemo_ckpt.protocol.calls import Call, Proxy, methods, one_way
from nemo_ckpt.sandbox_backend import ContainerRef
from nemo_ckpt.session_record import SessionHead, SessionRecord
from nemo_ckpt.transport import CONTROL_GROUP, HOLDER, Actor, Transport

__all__ = [
    "SESSION_METHODS",
    "HolderControl",
    "HolderLedgerCalls",
    "HolderOperationCalls",
    "HolderProbeCalls",
    "HolderRestoreCalls",
    "HolderSessionCalls",
    "HolderSessions",
    "HolderSnapshotCalls",
    "HolderTurnCalls",
    "OpeningSessions",
    "concurrency_group",
    "holder_calls",
    "probe_calls",
    "session_calls",
]


class HolderProbeCalls(Protocol):
    """Who a holder is, and whether its node can do what the job asks (check_startup)."""

    async def info(self) -> HolderInfo: ...

    async def probe_storage(self, root: str) -> str: ...

    async def probe_sandbox(self) -> None: ...

    async def probe_containers(self) -> tuple[list[str], list[str]]: ...


class HolderOperationCalls(Protocol):
    """What every operation takes: its lease kept up, and its end without a trace."""

    async def renew(self, operation_id: str, lease_s: float) -> float: ...

    async def abort(self, operation_id: str, keep_committed: bool = False) -> None: ...


class HolderSnapshotCalls(Protocol):
    """A snapshot's steps on a holder (their order: ``HolderControl``). ``pause`` and
    ``capture`` are ``begin_snapshot``'s two halves, callable apart in-process."""

    async def begin_snapshot(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
                             directory: str, trace: str = "", stop: bool = False
                             ) -> tuple[PauseReport, CaptureReport]: ...

    async def pause(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
                    directory: str | None = None) -> PauseReport: ...

    async def capture(self, snapshot_id: str, stop: bool = False) -> CaptureReport: ...

    @one_way
    async def start_writes(self, snapshot_id: str, directory: str | None = None) -> None: ...

    @one_way
    async def release(self, snapshot_id: str) -> None: ...

    async def finish_writes(self, snapshot_id: str) -> PersistReport: ...

    async def commit_snapshot(self, snapshot_id: str, stop: bool = False) -> None: ...


class HolderRestoreCalls(Protocol):
    """A restore's steps on a holder (their order: ``HolderControl``)."""

    async def prefetch_restore(self, where: str, shards: list[ShardRef]) -> int: ...

    async def prepare_restore(self, restore_id: str, where: str,
                              shards: list[ShardRef], lease_s: float,
                              blob_store: str | None = None, trace: str = ""
                              ) -> RestorePrepared: ...

    async def commit_restore(self, restore_id: str) -> int: ...


class HolderLedgerCalls(Protocol):
    """RL's ledger operations, through the coordinator: the capture keys dropped."""

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]: ...

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]: ...


class HolderControl(HolderProbeCalls, HolderOperationCalls, HolderSnapshotCalls,
                    HolderRestoreCalls, HolderLedgerCalls, Protocol):
    """The calls the coordinator makes of a session holder.

    The call order, as the coordinator drives it (stated here once; the other
    docstrings point here; the driver's own calls:
    ``nemo_ckpt.protocol.coordinator_api.CoordinatorApi``). A snapshot, every call carrying the
    snapshot's id:

        1) begin_snapshot(id, drain, lease, folder[, trace][, stop])
                                            close the turn gate, wait up to ``drain`` for
                                            turns in flight, take a lease, capture in
                                            memory (``pause`` then ``capture``, in one
                                            call; with ``stop``, sessions mid-turn too, as
                                            of their last committed turn)
                                            -> (PauseReport, CaptureReport)
        2) start_writes(id)                 write the shard in the background (a
                                            finish_writes that comes first starts it)
        3) renew(id, lease)                 while the driver's block runs
        4) release(id)                      the driver's block exited: open the gate while
                                            the shard is still being written (the capture
                                            is an immutable copy); sent by the driver and
                                            by the coordinator, so it comes twice, and
                                            either may come late; the snapshot stays open
        5) finish_writes(id)                the shard is durable -> PersistReport, its
                                            manifest entry
        6) commit_snapshot(id[, stop])      the manifest is written: the snapshot ends here;
                                            with ``stop`` (4 was not sent: the gate stayed
                                            closed) the holder parks: it drops every
                                            session, frees their sandboxes and refuses new
                                            sessions and turns until a restore commits
        or abort(id), at any point, instead of 2-6.

    A restore, carrying the restore's id (ahead of it, ``prefetch_restore(folder,
    shards)`` may start reading the shards a restore to come will read):

        1) prepare_restore(id, folder, shards, lease)   close the gate, read and verify
                                                        the shards; nothing goes live yet
                                                        -> RestorePrepared
        2) renew(id, lease)
        3) commit_restore(id)                           the sessions go live; open the gate
        or abort(id) instead of 3, or after 3 while the restore is not yet in use: every
        session it made live goes again (a restore is all or nothing across holders).
    """


# A batch of sessions to open: ``(episode, initial state)``, or with its sandbox (a
# directory's path, or a container), or with that and whether it is restart-only.
OpeningSessions = list[tuple[EnvironmentEpisode, bytes] |
                       tuple[EnvironmentEpisode, bytes, str | ContainerRef | None] |
                       tuple[EnvironmentEpisode, bytes, str | ContainerRef | None, bool]]


class HolderSessionCalls(Protocol):
    """An environment worker's sessions, on the holder of its node."""

    async def open_session(self, episode: EnvironmentEpisode, state: bytes = b"",
                           directory: str | ContainerRef | None = None,
                           restart_only: bool = False) -> SessionRecord: ...

    async def open_sessions(self, sessions: OpeningSessions) -> int: ...

    async def get_session(self, episode: EnvironmentEpisode | str) -> SessionRecord: ...

    async def read_turns(self, episode: EnvironmentEpisode | str, start: int = 0,
                         stop: int | None = None) -> list[bytes]: ...

    async def close_session(self, episode: EnvironmentEpisode | str) -> SessionRecord: ...

    async def finish_session(self, episode: EnvironmentEpisode, result: bytes
                             ) -> SessionRecord: ...

    async def sessions(self) -> list[SessionRecord]: ...

    async def replay_diverged(self, episode: EnvironmentEpisode, detail: str) -> int: ...


class HolderTurnCalls(Protocol):
    """A session's turns: begun, committed, aborted, and resolved after a lost reply."""

    async def begin_turn(self, episode: EnvironmentEpisode, token: str) -> SessionHead: ...

    async def commit_turn(self, episode: EnvironmentEpisode, token: str, record: bytes,
                          state: bytes, staging_keys: Iterable[str] = ()
                          ) -> SessionHead: ...

    async def abort_turn(self, episode: EnvironmentEpisode, token: str) -> None: ...

    async def resolve_turn(self, episode: EnvironmentEpisode, token: str
                           ) -> SessionHead | None: ...


class HolderSessions(HolderSessionCalls, HolderTurnCalls, Protocol):
    """The calls an environment worker makes of the holder on its node."""


# The calls that run in a holder's default slots; every other holder call is a control
# call, with slots of its own that a burst of turns cannot take.
SESSION_METHODS = frozenset(methods(HolderSessions))


def concurrency_group(kind: str, method: str) -> str | None:
    """The group of slots a call of ``method`` on an actor of ``kind`` runs in: None for
    the actor's default slots (a holder's session calls; every coordinator call)."""
    if kind == HOLDER and method not in SESSION_METHODS:
        return CONTROL_GROUP
    return None


def holder_calls(transport: Transport, holder: Actor, timeout: float | None
                 ) -> HolderControl:
    """``HolderControl``'s calls to one holder through ``transport``, each with
    ``timeout`` (None: the transport's default) unless the call carries its own."""

    def invoke(made: Call[Any]) -> Awaitable[Any]:
        return transport.call(holder, made.method, *made.args,
                              timeout=timeout if made.timeout is None else made.timeout)

    return cast(HolderControl, Proxy(
        (HolderControl,), invoke,
        lambda made: transport.send(holder, made.method, *made.args)))


def session_calls(invoke: Callable[..., Awaitable[Any]]) -> HolderSessions:
    """``HolderSessions``' calls through ``invoke(method, *args)``, which carries a call
    to the worker's holder (the client's, which looks the holder up again after its
    death) and returns its answer."""
    return cast(HolderSessions, _carried(HolderSessions, invoke))


def probe_calls(invoke: Callable[..., Awaitable[Any]]) -> HolderProbeCalls:
    """``HolderProbeCalls``' calls through ``invoke`` as ``session_calls``: a worker
    asks its holder who it is (``SessionClient.holder_info``)."""
    return cast(HolderProbeCalls, _carried(HolderProbeCalls, invoke))


def _carried(protocol: type, invoke: Callable[..., Awaitable[Any]]) -> Proxy:
    """``protocol``'s calls, each handed to ``invoke`` as its method's name and args."""
    return Proxy((protocol,), lambda made: invoke(made.method, *made.args))
