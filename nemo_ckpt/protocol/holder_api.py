"""A session holder's interface as its callers see it: typed, whatever carries the call.

``HolderControl`` is what the coordinator calls (the phases of a snapshot and a restore,
the ledger operations, probes; the driver sends ``release`` too,
``nemo_ckpt.driver.holder_handles``), ``HolderSessions`` what an environment worker's
``SessionClient`` calls; ``actors.session_holder.SessionHolder`` implements both, and
``actors.ray_transport`` has mypy check that it does. The order of the calls is stated
once, on ``HolderControl``. ``HolderCalls`` and ``SessionCalls`` make the same calls through a
``Transport`` (``nemo_ckpt.transport``), so a caller names a method and its arguments
once, checked by mypy, and the transport (Ray, or the simulation's seeded one) keeps its
control over delivery.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.phases import (
    CaptureReport,
    HolderInfo,
    PauseReport,
    PersistReport,
    RestorePrepared,
    ShardRef,
)
from nemo_ckpt.sandboxes.backend import ContainerRef
from nemo_ckpt.session_record import SessionHead, SessionRecord
from nemo_ckpt.transport import Actor, Transport

__all__ = ["HolderCalls", "HolderControl", "HolderSessions", "SessionCalls"]


class HolderControl(Protocol):
    """The calls the coordinator makes of a session holder.

    The call order, as the coordinator drives it (stated here once; the other
    docstrings point here; the driver's own calls:
    ``nemo_ckpt.protocol.coordinator_api.CoordinatorApi``). A snapshot, every call carrying the
    snapshot's id:

        1) begin(id, drain, lease, folder[, trace][, stop])  close the turn gate, wait up
                                            to ``drain`` for turns in flight, take a
                                            lease, capture in memory (``pause`` then
                                            ``capture``, in one call; with ``stop``,
                                            sessions mid-turn too, as of their last
                                            committed turn) -> (PauseReport, CaptureReport)
        2) start_persist(id)                write the shard in the background (a
                                            finish_persist that comes first starts it)
        3) renew_lease(id, lease)           while the driver's block runs
        4) release(id)                      the driver's block exited: open the gate while
                                            the shard is still being written (the capture
                                            is an immutable copy); sent by the driver and
                                            by the coordinator, so it comes twice, and
                                            either may come late; the snapshot stays open
        5) finish_persist(id)               the shard is durable -> PersistReport, its
                                            manifest entry
        6) resume(id[, stop])               the manifest is written: the snapshot ends here;
                                            with ``stop`` (4 was not sent: the gate stayed
                                            closed) the holder parks: it drops every
                                            session, frees their sandboxes and refuses new
                                            sessions and turns until a restore commits
        or abort(id), at any point, instead of 2-6.

    A restore, carrying the restore's id:

        1) prepare_restore(id, folder, shards, lease)   close the gate, read and verify
                                                        the shards; nothing goes live yet
                                                        -> RestorePrepared
        2) renew_lease(id, lease)
        3) commit_restore(id)                           the sessions go live; open the gate
        or abort(id) instead of 3, or after 3 while the restore is not yet in use: every
        session it made live goes again (a restore is all or nothing across holders).
    """

    async def info(self) -> HolderInfo: ...

    async def probe_storage(self, root: str) -> str: ...

    async def probe_sandbox(self) -> None: ...

    async def probe_containers(self) -> tuple[list[str], list[str]]: ...

    async def begin(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
                    directory: str, trace: str = "", stop: bool = False
                    ) -> tuple[PauseReport, CaptureReport]: ...

    async def renew_lease(self, operation_id: str, lease_s: float) -> float: ...

    async def release(self, snapshot_id: str) -> None: ...

    async def start_persist(self, snapshot_id: str, directory: str | None = None) -> None: ...

    async def finish_persist(self, snapshot_id: str) -> PersistReport: ...

    async def resume(self, snapshot_id: str, stop: bool = False) -> None: ...

    async def abort(self, operation_id: str, keep_committed: bool = False) -> None: ...

    async def prepare_restore(self, restore_id: str, where: str,
                              shards: list[ShardRef], lease_s: float,
                              blob_store: str | None = None, trace: str = ""
                              ) -> RestorePrepared: ...

    async def prefetch(self, where: str, shards: list[ShardRef]) -> int: ...

    async def commit_restore(self, restore_id: str) -> int: ...

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]: ...

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]: ...


class HolderCalls:
    """``HolderControl``'s calls to one holder through a transport, each with
    ``timeout`` (None: the transport's default); ``release`` and ``start_persist`` are
    one-way messages here, as their senders (the coordinator, and the driver's release)
    never wait for them."""

    def __init__(self, transport: Transport, holder: Actor, timeout: float | None) -> None:
        self._transport = transport
        self._holder = holder
        self._timeout = timeout

    def _call(self, method: str, *args: Any) -> Awaitable[Any]:
        return self._transport.call(self._holder, method, *args, timeout=self._timeout)

    def info(self) -> Awaitable[HolderInfo]:
        return self._call("info")

    def probe_storage(self, root: str) -> Awaitable[str]:
        return self._call("probe_storage", root)

    def probe_sandbox(self) -> Awaitable[None]:
        return self._call("probe_sandbox")

    def probe_containers(self) -> Awaitable[tuple[list[str], list[str]]]:
        return self._call("probe_containers")

    def begin(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
              directory: str, trace: str = "", stop: bool = False
              ) -> Awaitable[tuple[PauseReport, CaptureReport]]:
        if stop:
            return self._call("begin", snapshot_id, drain_timeout_s, lease_s, directory, trace,
                              True)
        if trace:
            return self._call("begin", snapshot_id, drain_timeout_s, lease_s, directory, trace)
        return self._call("begin", snapshot_id, drain_timeout_s, lease_s, directory)

    def renew_lease(self, operation_id: str, lease_s: float) -> Awaitable[float]:
        return self._call("renew_lease", operation_id, lease_s)

    def release(self, snapshot_id: str) -> None:
        self._transport.send(self._holder, "release", snapshot_id)

    def start_persist(self, snapshot_id: str) -> None:
        self._transport.send(self._holder, "start_persist", snapshot_id)

    def finish_persist(self, snapshot_id: str) -> Awaitable[PersistReport]:
        return self._call("finish_persist", snapshot_id)

    def resume(self, snapshot_id: str, stop: bool = False) -> Awaitable[None]:
        if stop:
            return self._call("resume", snapshot_id, True)
        return self._call("resume", snapshot_id)

    def abort(self, operation_id: str, keep_committed: bool = False) -> Awaitable[None]:
        return self._call("abort", operation_id, keep_committed)

    def prepare_restore(self, restore_id: str, where: str, shards: list[ShardRef],
                        lease_s: float, blob_store: str | None = None, trace: str = ""
                        ) -> Awaitable[RestorePrepared]:
        if trace:
            return self._call("prepare_restore", restore_id, where, shards, lease_s,
                              blob_store, trace)
        return self._call("prepare_restore", restore_id, where, shards, lease_s,
                          blob_store)

    def prefetch(self, where: str, shards: list[ShardRef]) -> Awaitable[int]:
        return self._call("prefetch", where, shards)

    def commit_restore(self, restore_id: str) -> Awaitable[int]:
        return self._call("commit_restore", restore_id)

    def retire(self, episodes: list[EnvironmentEpisode]) -> Awaitable[list[str]]:
        return self._call("retire", episodes)

    def forget(self, episodes: list[EnvironmentEpisode]) -> Awaitable[list[str]]:
        return self._call("forget", episodes)


# A batch of sessions to open: ``(episode, initial state)``, or with its sandbox (a
# directory's path, or a container), or with that and whether it is restart-only.
OpeningSessions = list[tuple[EnvironmentEpisode, bytes] |
                       tuple[EnvironmentEpisode, bytes, str | ContainerRef | None] |
                       tuple[EnvironmentEpisode, bytes, str | ContainerRef | None, bool]]


class HolderSessions(Protocol):
    """The calls an environment worker makes of the holder on its node."""

    async def open_session(self, episode: EnvironmentEpisode, state: bytes = b"",
                           directory: str | ContainerRef | None = None,
                           restart_only: bool = False) -> SessionRecord: ...

    async def open_sessions(self, sessions: OpeningSessions) -> int: ...

    async def get_session(self, episode: EnvironmentEpisode | str) -> SessionRecord: ...

    async def read_turns(self, episode: EnvironmentEpisode | str, start: int = 0,
                         stop: int | None = None) -> list[bytes]: ...

    async def begin_turn(self, episode: EnvironmentEpisode, token: str) -> SessionHead: ...

    async def commit_turn(self, episode: EnvironmentEpisode, token: str, record: bytes,
                          state: bytes, staging_keys: Iterable[str] = ()
                          ) -> SessionHead: ...

    async def abort_turn(self, episode: EnvironmentEpisode, token: str) -> None: ...

    async def resolve_turn(self, episode: EnvironmentEpisode, token: str
                           ) -> SessionHead | None: ...

    async def close_session(self, episode: EnvironmentEpisode | str) -> SessionRecord: ...

    async def finish_session(self, episode: EnvironmentEpisode, result: bytes
                             ) -> SessionRecord: ...

    async def sessions(self) -> list[SessionRecord]: ...

    async def replay_diverged(self, episode: EnvironmentEpisode, detail: str) -> int: ...


class SessionCalls:
    """``HolderSessions``' calls through ``invoke(method, *args)``, which carries a call
    to the worker's holder (the client's, which looks the holder up again after its
    death) and returns its answer."""

    def __init__(self, invoke: Callable[..., Awaitable[Any]]) -> None:
        self._invoke = invoke

    def open_session(self, episode: EnvironmentEpisode, state: bytes = b"",
                     directory: str | ContainerRef | None = None,
                     restart_only: bool = False) -> Awaitable[SessionRecord]:
        if restart_only:
            return self._invoke("open_session", episode, state, directory, True)
        return self._invoke("open_session", episode, state, directory)

    def open_sessions(self, sessions: OpeningSessions) -> Awaitable[int]:
        return self._invoke("open_sessions", sessions)

    def get_session(self, episode: EnvironmentEpisode | str) -> Awaitable[SessionRecord]:
        return self._invoke("get_session", episode)

    def read_turns(self, episode: EnvironmentEpisode | str, start: int = 0,
                   stop: int | None = None) -> Awaitable[list[bytes]]:
        return self._invoke("read_turns", episode, start, stop)

    def begin_turn(self, episode: EnvironmentEpisode, token: str) -> Awaitable[SessionHead]:
        return self._invoke("begin_turn", episode, token)

    def commit_turn(self, episode: EnvironmentEpisode, token: str, record: bytes,
                    state: bytes, staging_keys: Iterable[str] = ()
                    ) -> Awaitable[SessionHead]:
        return self._invoke("commit_turn", episode, token, record, state, staging_keys)

    def abort_turn(self, episode: EnvironmentEpisode, token: str) -> Awaitable[None]:
        return self._invoke("abort_turn", episode, token)

    def resolve_turn(self, episode: EnvironmentEpisode, token: str
                     ) -> Awaitable[SessionHead | None]:
        return self._invoke("resolve_turn", episode, token)

    def close_session(self, episode: EnvironmentEpisode | str) -> Awaitable[SessionRecord]:
        return self._invoke("close_session", episode)

    def finish_session(self, episode: EnvironmentEpisode, result: bytes
                       ) -> Awaitable[SessionRecord]:
        return self._invoke("finish_session", episode, result)

    def sessions(self) -> Awaitable[list[SessionRecord]]:
        return self._invoke("sessions")

    def replay_diverged(self, episode: EnvironmentEpisode, detail: str) -> Awaitable[int]:
        return self._invoke("replay_diverged", episode, detail)
