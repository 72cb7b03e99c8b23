"""NeMo Gym's own sandboxes, recovered with their rollouts: ``NemoCkptLocalProvider``, a
sandbox provider of NeMo Gym (``nemo_gym.sandbox.providers.base.SandboxProvider``) over
Gym's ``local`` provider, that ties each sandbox to its rollout's session.

A Gym config selects it by name (the entry point ``nemo_ckpt_local`` of the group
``nemo_gym.sandbox_providers``)::

    sandbox:
      nemo_ckpt_local:
        sandbox_root: /scratch/sandboxes   # the job's CheckpointConfig.sandbox_root
        namespace: my-job                  # the job's CheckpointConfig.namespace

The process must be on the job's Ray cluster (a Ray actor, or a driver that joined with
``nemo_ckpt.connect.connect``). A sandbox names its rollout in ``SandboxSpec.metadata``
(``sandbox_metadata(episode)``): ``create`` makes its directory,
``<sandbox_root>/<capture key>``, and opens the rollout's session on the holder with that
directory and an empty state. From then on the holder records the directory when each of
the session's turns commits (``SessionClient.turn``), and a snapshot stores its last
recording with the session. A restore makes it again, as the continued attempt's
directory, on the node of the instance that continues the rollout; ``connect`` with
``sandbox_descriptor(continued episode, instance id)`` hands it to Gym's
``AsyncSandbox.connect`` there.

What is captured is the directory's files (``SandboxRecovery.FILES_ONLY``): a process a
command left running is not, and ``SandboxSpec.env`` is not stored (give it again per
command). Importing this module imports no part of NeMo Gym: Gym's import changes
``sys.path``, ``print`` and ``HF_HOME``, so it happens at the provider's first use only.

``RolloutSandboxProvider`` is what this provider and the one over Gym's ``docker``
(``nemo_ckpt.integrations.nemo_gym_docker``) share: the descriptor, ``connect``
through the rollout's live session, and the clean-up: each sandbox is marked on its
node before it is made (``nemo_ckpt.sandboxes.provided``), so it is removed once
whatever happens: by ``close``, by its holder when RL retires or forgets its rollout or
its worker closes the session, or, after a crash, by the next holder of its instance as
it starts. A ``create`` whose open's answer was lost asks the holder whether the
session opened, and keeps the sandbox (or, retried, adopts it) if it did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_ckpt.errors import BackendUnavailableError, SandboxError, SessionNotFoundError
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.sandboxes.provided import ProvidedSandboxes
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.sessions import SessionClient
from nemo_ckpt.storage.names import safe_name_part

if TYPE_CHECKING:
    from nemo_gym.sandbox.providers.base import (
        SandboxExecResult,
        SandboxHandle,
        SandboxSpec,
        SandboxStatus,
    )

__all__ = ["NemoCkptLocalProvider", "RolloutSandboxProvider", "SandboxRecovery",
           "sandbox_descriptor", "sandbox_metadata", "PROVIDER_NAME", "ROLLOUT_KEY",
           "ATTEMPT_KEY", "INSTANCE_KEY"]

PROVIDER_NAME = "nemo_ckpt_local"
# The keys of SandboxSpec.metadata that name a sandbox's rollout (Gym's metadata values
# are strings).
ROLLOUT_KEY = "nemo_ckpt.rollout_id"
ATTEMPT_KEY = "nemo_ckpt.attempt"
INSTANCE_KEY = "nemo_ckpt.instance_id"
_ASK_S = 30.0  # how long a create whose open's answer was lost asks whether it opened


class SandboxRecovery(str, Enum):
    """What a provider's sandboxes keep through a crash, in the terms NeMo Gym's users
    ask providers to declare: never more than the provider does."""

    # Files and the memory of the processes running in it.
    SNAPSHOT_WITH_MEMORY = "snapshot_with_memory"
    # Its files as the last committed turn left them; no process survives.
    FILES_ONLY = "files_only"
    # Nothing: the rollout starts over after a crash.
    RESTART_ONLY = "restart_only"


def sandbox_metadata(episode: EnvironmentEpisode, instance_id: str | None = None
                     ) -> dict[str, str]:
    """The ``SandboxSpec.metadata`` that ties a sandbox to ``episode``'s session (on
    ``instance_id``'s holder; by default the provider's, else the one on this node)."""
    meta = {ROLLOUT_KEY: episode.rollout_id, ATTEMPT_KEY: str(episode.attempt)}
    if instance_id is not None:
        meta[INSTANCE_KEY] = instance_id
    return meta


def sandbox_descriptor(episode: EnvironmentEpisode, instance_id: str,
                       provider: str = PROVIDER_NAME) -> dict[str, Any]:
    """What ``AsyncSandbox.connect`` takes to reach the sandbox of ``episode``'s session
    on ``instance_id`` (made by ``provider``, ours by that name): after a restore, the
    continued attempt's (``RestoredEnvironmentRollouts.continued_attempts`` names the
    instance)."""
    return {"provider": provider, "rollout_id": episode.rollout_id,
            "attempt": episode.attempt, "instance_id": instance_id}


@dataclass
class _Box:
    """Our side of a Gym handle (``SandboxHandle.raw``): the rollout, Gym's own provider's
    handle on its sandbox (and its directory, for ``local``), what of it a crash keeps, and
    whether it is paused or closed."""

    episode: EnvironmentEpisode
    instance_id: str
    inner: Any  # the wrapped Gym provider's SandboxHandle
    recovery: SandboxRecovery
    directory: Path | None = None
    paused: bool = False
    closed: bool = False


class RolloutSandboxProvider(ABC):
    """What the providers of this package share: each sandbox belongs to a rollout's
    session on a holder, found through that session again by ``connect``."""

    name: str
    recovery: SandboxRecovery  # the most any of its sandboxes keeps (``recovery_of``)

    def __init__(self, namespace: str, instance_id: str | None) -> None:
        self.namespace = namespace
        self.instance_id = instance_id
        self._clients: dict[str | None, SessionClient] = {}
        self._ledgers: dict[str, ProvidedSandboxes] = {}

    async def _client(self, instance_id: str | None) -> SessionClient:
        """The session client of ``instance_id``'s holder (None: the provider's, else
        this node's), connected once."""
        instance_id = instance_id or self.instance_id
        client = self._clients.get(instance_id)
        if client is None:
            client = await SessionClient.connect(instance_id, namespace=self.namespace)
            self._clients[instance_id] = self._clients[client.instance_id] = client
        return client

    async def _ledger(self, client: SessionClient) -> ProvidedSandboxes:
        """The marks of the sandboxes made for sessions on ``client``'s holder, under
        the holder's own ``sandbox_root``."""
        ledger = self._ledgers.get(client.instance_id)
        if ledger is None:
            root = (await client.holder_info()).options.get("sandbox_root")
            if not root:
                raise SandboxError(
                    f"{self.name}: holder {client.instance_id} has no sandbox_root, where "
                    f"the sandboxes it releases are marked; set CheckpointConfig."
                    f"sandbox_root")
            ledger = self._ledgers[client.instance_id] = ProvidedSandboxes(
                root, self.namespace, client.instance_id)
        return ledger

    async def _opened(self, client: SessionClient, episode: EnvironmentEpisode,
                      sandbox: str) -> bool | None:
        """Whether ``episode``'s session is live on ``client``'s holder with ``sandbox``
        (its directory or container), asked after an open failed (its answer may have
        been lost, the open done): None when the holder cannot be asked."""
        try:
            record = await asyncio.wait_for(client.get(episode), _ASK_S)
        except SessionNotFoundError:
            return False
        except Exception:  # the holder is unreachable: never guess
            return None
        return sandbox in (record.directory, record.container)

    async def _unmark(self, box: _Box) -> None:
        """The sandbox of ``box`` is removed: its mark goes (after it, so that a crash
        in between leaves it marked, for the next holder to remove again)."""
        try:
            ledger = await self._ledger(await self._client(box.instance_id))
        except (BackendUnavailableError, SessionNotFoundError):
            return  # its holder is gone: the next one's start drops the mark
        await asyncio.to_thread(ledger.unmark, box.episode.capture_key)

    def recovery_of(self, handle: SandboxHandle) -> SandboxRecovery:
        """What a crash keeps of this sandbox, as its session was opened."""
        box: _Box = handle.raw
        return box.recovery

    def _handle(self, box: _Box) -> SandboxHandle:
        from nemo_gym.sandbox.providers.base import SandboxHandle

        return SandboxHandle(sandbox_id=f"{box.instance_id}/{box.episode.capture_key}",
                             provider_name=self.name, raw=box)

    def _live(self, handle: SandboxHandle, doing: str) -> _Box:
        box: _Box = handle.raw
        if box.closed:
            raise SandboxError(f"{self.name}: cannot {doing} sandbox {handle.sandbox_id}: "
                               f"it is closed")
        if box.paused:
            raise SandboxError(f"{self.name}: cannot {doing} sandbox {handle.sandbox_id}: "
                               f"it is paused; resume() it first")
        return box

    async def serialize_handle(self, handle: SandboxHandle, *, scope: str | None = None
                               ) -> dict[str, Any]:
        """Its rollout and instance (``sandbox_descriptor``); ``scope`` is not used."""
        box: _Box = handle.raw
        return sandbox_descriptor(box.episode, box.instance_id, self.name)

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle:
        """A handle on the sandbox of the live session ``descriptor`` names: after a
        restore, the one the restore made."""
        episode, instance_id = _episode_of(descriptor, self.name)
        client = await self._client(instance_id)
        try:
            record = await client.get(episode)
        except SessionNotFoundError as exc:
            later = [s.episode for s in await client.sessions()
                     if s.episode.rollout_id == episode.rollout_id]
            if later:
                raise SessionNotFoundError(
                    f"{self.name}: {episode.capture_key} is not live on "
                    f"{client.instance_id}: its rollout continues as attempt "
                    f"{later[0].attempt}; connect with sandbox_descriptor("
                    f"EnvironmentEpisode({episode.rollout_id!r}, {later[0].attempt}), "
                    f"{client.instance_id!r})") from exc
            raise
        return self._handle(await self._adopt(record, client.instance_id))

    @abstractmethod
    async def _adopt(self, record: SessionRecord, instance_id: str) -> _Box:
        """Gym's own handle on the sandbox of the live session ``record``."""


class NemoCkptLocalProvider(RolloutSandboxProvider):
    """Gym's ``local`` provider, each sandbox a session's recorded directory (the module
    docstring says how; ``recovery`` what survives a crash)."""

    name = PROVIDER_NAME
    recovery = SandboxRecovery.FILES_ONLY

    def __init__(self, sandbox_root: str, namespace: str = "nemo_ckpt",
                 instance_id: str | None = None, shell: str = "/bin/bash",
                 default_timeout_s: float = 180.0, concurrency: int = 8) -> None:
        from nemo_gym.sandbox.providers.local import LocalProvider

        if not sandbox_root:
            raise SandboxError(f"{PROVIDER_NAME}: give sandbox_root, the job's "
                               f"CheckpointConfig.sandbox_root")
        super().__init__(namespace, instance_id)
        self.sandbox_root = Path(sandbox_root).expanduser()
        self._local = LocalProvider(workspace_root=str(self.sandbox_root), shell=shell,
                                    default_timeout_s=default_timeout_s,
                                    concurrency=concurrency)

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Make the sandbox of the rollout ``spec.metadata`` names and open its session
        with it (empty state): recorded now, and at each of its turns' commits."""
        episode, instance_id = _episode_of(spec.metadata, self.name, descriptor=False)
        if spec.workdir:
            raise SandboxError(
                f"{PROVIDER_NAME}: SandboxSpec.workdir ({spec.workdir}) is not supported: "
                f"the sandbox of {episode.capture_key} is a directory the provider makes "
                f"under sandbox_root; leave workdir unset")
        client = await self._client(instance_id)
        ledger = await self._ledger(client)
        key = episode.capture_key
        directory = self.sandbox_root / safe_name_part(key)
        if os.path.lexists(directory):
            opened = await self._opened(client, episode, str(directory))
            if opened:  # a create repeated after its answer was lost: the same sandbox
                return self._handle(await self._adopt(await client.get(episode),
                                                      client.instance_id))
            if opened is None or not ledger.is_marked(key):
                raise SandboxError(
                    f"{PROVIDER_NAME}: {directory} already exists"
                    f"{'' if opened is None else ', no live session its own'}: a sandbox "
                    f"of {key} was made before; close it, or remove it")
            # Ours, left by a create that could not learn whether its session opened.
            await asyncio.to_thread(shutil.rmtree, directory, True)
        await asyncio.to_thread(ledger.mark, key, directory=directory,
                                rollout_id=episode.rollout_id)
        try:
            directory.mkdir()
        except OSError as exc:
            ledger.unmark(key)
            raise SandboxError(
                f"{PROVIDER_NAME}: cannot make the sandbox of {key} in "
                f"sandbox_root {self.sandbox_root}: {exc.strerror or exc}; it must be the "
                f"job's CheckpointConfig.sandbox_root, made") from None
        try:
            inner = await self._local.create(dataclasses.replace(spec, workdir=str(directory)))
            await client.open(episode, b"", directory=directory)
        except BaseException as exc:
            opened = await self._opened(client, episode, str(directory))
            if opened and isinstance(exc, Exception):  # only the answer was lost
                return self._handle(_Box(episode, client.instance_id, inner,
                                         self.recovery, directory))
            if opened is False:
                await asyncio.to_thread(shutil.rmtree, directory, True)
                ledger.unmark(key)
            elif opened is None:
                raise SandboxError(
                    f"{PROVIDER_NAME}: the session of {key} may or may not have opened "
                    f"({type(exc).__name__}: {exc}), and its holder {client.instance_id} "
                    f"cannot be asked: its sandbox {directory} stays, for a retried create "
                    f"to adopt, or for the holder's next start to remove") from exc
            raise
        return self._handle(_Box(episode, client.instance_id, inner, self.recovery,
                                 directory))

    def _inside(self, box: _Box, path: str | Path, handle: SandboxHandle) -> Path:
        """``path`` (relative to the sandbox, or absolute) inside its directory: only
        that is captured."""
        assert box.directory is not None
        full = Path(os.path.realpath(box.directory / path))
        top = Path(os.path.realpath(box.directory))
        if full != top and top not in full.parents:
            raise SandboxError(
                f"{PROVIDER_NAME}: {path} is outside sandbox {handle.sandbox_id} "
                f"({box.directory}): only its directory is captured; give a path inside it")
        return full

    async def exec(self, handle: SandboxHandle, command: str, *, cwd: str | None = None,
                   env: dict[str, str] | None = None, timeout_s: int | float | None = None,
                   user: str | int | None = None) -> SandboxExecResult:
        box = self._live(handle, "run a command in")
        where = None if cwd is None else str(self._inside(box, cwd, handle))
        result: SandboxExecResult = await self._local.exec(
            box.inner, command, cwd=where, env=env, timeout_s=timeout_s, user=user)
        return result

    async def upload_file(self, handle: SandboxHandle, source_path: Path,
                          target_path: str) -> None:
        box = self._live(handle, "upload into")
        await self._local.upload_file(box.inner, source_path,
                                      str(self._inside(box, target_path, handle)))

    async def download_file(self, handle: SandboxHandle, source_path: str,
                            target_path: Path) -> None:
        box = self._live(handle, "download from")
        await self._local.download_file(box.inner, str(self._inside(box, source_path, handle)),
                                        target_path)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        from nemo_gym.sandbox.providers.base import SandboxStatus

        box: _Box = handle.raw
        if box.closed:
            return SandboxStatus.STOPPED
        if box.paused:
            return SandboxStatus.PAUSED
        status: SandboxStatus = await self._local.status(box.inner)
        return status

    async def pause(self, handle: SandboxHandle) -> None:
        """Refuse commands and file transfers until ``resume``; a local sandbox runs no
        process of its own to stop."""
        self._live(handle, "pause").paused = True

    async def resume(self, handle: SandboxHandle) -> None:
        box: _Box = handle.raw
        if box.closed:
            raise SandboxError(f"{PROVIDER_NAME}: cannot resume sandbox {handle.sandbox_id}: "
                               f"it is closed")
        box.paused = False

    async def close(self, handle: SandboxHandle) -> None:
        """Remove the sandbox's directory; its session is the worker's to finish. A
        sandbox already closed (here, or through another handle) is left as it is."""
        box: _Box = handle.raw
        if box.closed:
            return
        box.closed = True
        assert box.directory is not None
        await asyncio.to_thread(shutil.rmtree, box.directory, ignore_errors=True)
        await self._local.close(box.inner)
        await self._unmark(box)

    async def aclose(self) -> None:
        await self._local.aclose()

    async def _adopt(self, record: SessionRecord, instance_id: str) -> _Box:
        """The restored directory, on this node."""
        key = record.episode.capture_key
        if record.directory is None:
            raise SandboxError(f"{PROVIDER_NAME}: the session of {key} on {instance_id} "
                               f"owns no sandbox directory (finished, or opened without one)")
        directory = Path(record.directory)
        if not directory.is_dir():
            raise SandboxError(
                f"{PROVIDER_NAME}: the sandbox of {key}, {directory}, is not on this node: "
                f"connect from a worker on the node of {instance_id}")
        from nemo_gym.sandbox.providers.base import SandboxSpec

        inner = await self._local.create(SandboxSpec(workdir=str(directory)))
        # A restore made it: released with its session from now on, as one made here.
        ledger = await self._ledger(await self._client(instance_id))
        await asyncio.to_thread(ledger.mark, record.episode.capture_key, directory=directory,
                                rollout_id=record.episode.rollout_id)
        return _Box(record.episode, instance_id, inner, self.recovery, directory)


def _episode_of(fields: Mapping[str, Any], provider: str, descriptor: bool = True
                ) -> tuple[EnvironmentEpisode, str | None]:
    """The rollout attempt and instance a descriptor of ``provider`` (or a spec's
    metadata) names."""
    keys = ("rollout_id", "attempt", "instance_id") if descriptor else \
        (ROLLOUT_KEY, ATTEMPT_KEY, INSTANCE_KEY)
    what = "the descriptor" if descriptor else "SandboxSpec.metadata"
    if descriptor and fields.get("provider") != provider:
        raise SandboxError(f"{provider}: {what} {dict(fields)!r} was not made by "
                           f"{provider}; use sandbox_descriptor(episode, instance_id)")
    rollout, attempt, instance = (fields.get(k) for k in keys)
    try:
        if isinstance(attempt, bool):
            raise TypeError(attempt)
        episode = EnvironmentEpisode(rollout, int(attempt))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        help_ = ("sandbox_descriptor(episode, instance_id)" if descriptor
                 else "sandbox_metadata(episode)")
        raise SandboxError(
            f"{provider}: {what} names no rollout attempt ({keys[0]}={rollout!r}, "
            f"{keys[1]}={attempt!r}): every sandbox belongs to a rollout's session; give "
            f"{help_}") from None
    if instance is not None and not isinstance(instance, str):
        raise SandboxError(f"{provider}: {what}'s {keys[2]} must be a string, not "
                           f"{instance!r}")
    return episode, instance
