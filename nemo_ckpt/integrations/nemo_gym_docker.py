"""NeMo Gym's ``docker`` sandboxes, recovered with their rollouts:
``NemoCkptDockerProvider`` (entry point ``nemo_ckpt_docker``), Gym's own ``docker``
provider under a rollout's session, each sandbox the session's container
(``SessionClient.open(container=...)``, the holder's container backend).

    sandbox:
      nemo_ckpt_docker:
        namespace: my-job          # the job's CheckpointConfig.namespace (containers=True)
        memory: required           # or "off": its files only

``create`` runs Gym's ``docker run`` (on podman: the project's ``docker`` command runs
``podman "$@"``), then opens the session of the rollout ``SandboxSpec.metadata`` names
(``nemo_ckpt.integrations.nemo_gym.sandbox_metadata``) with the container: the holder
records its files, and with ``memory: required`` its processes' memory (CRIU), at the open
and at each turn's commit. A restore creates it again running, as
``nemo-ckpt-<namespace>-<capture key>``; ``connect`` hands it to Gym's
``AsyncSandbox.connect`` (Gym's own ``docker`` connect, by the new name).

What a sandbox keeps is ``recovery_of(handle)``: ``snapshot_with_memory`` with ``memory:
required`` where CRIU works on its node, ``restart_only`` there where it does not (the
holder makes the session so, and says why in its log), ``files_only`` with ``memory:
off``. ``SandboxSpec.env`` lives in the container, but Gym's ``exec`` sets it per command
and a restored handle has none: give it again per command. Gym's default ``--init`` works:
the record says so, and the restore creates the container under the init binary of its
node's podman configuration (the only host file a restore mounts). Refused at
``create``, naming the option: volumes and ``run_args`` (a host mount is refused by a
restore).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_ckpt.errors import ContainerRuntimeError, SandboxError, SessionNotFoundError
from nemo_ckpt.integrations.nemo_gym import (
    RolloutSandboxProvider,
    SandboxRecovery,
    _Box,
    _episode_of,
)
from nemo_ckpt.sandbox_backend import ContainerRef
from nemo_ckpt.sandboxes.provided import provided_label
from nemo_ckpt.session_record import SessionRecord

if TYPE_CHECKING:
    from nemo_gym.sandbox.providers.base import (
        SandboxExecResult,
        SandboxHandle,
        SandboxSpec,
        SandboxStatus,
    )

__all__ = ["NemoCkptDockerProvider", "DOCKER_PROVIDER_NAME"]

DOCKER_PROVIDER_NAME = "nemo_ckpt_docker"
_MEMORY = {"required": SandboxRecovery.SNAPSHOT_WITH_MEMORY, "off": SandboxRecovery.FILES_ONLY}
_CLI_TIMEOUT_S = 60.0


class NemoCkptDockerProvider(RolloutSandboxProvider):
    """Gym's ``docker`` provider, each sandbox a session's recorded container (the module
    docstring says how; ``recovery_of`` what survives a crash)."""

    name = DOCKER_PROVIDER_NAME
    recovery = SandboxRecovery.SNAPSHOT_WITH_MEMORY

    def __init__(self, namespace: str = "nemo_ckpt", instance_id: str | None = None,
                 memory: str = "required", exec: dict[str, Any] | None = None,
                 create: dict[str, Any] | None = None,
                 probe: dict[str, Any] | None = None) -> None:
        from nemo_gym.sandbox.providers.docker import DockerProvider

        if memory not in _MEMORY:
            raise SandboxError(f"{self.name}: memory must be one of {sorted(_MEMORY)}, not "
                               f"{memory!r}")
        super().__init__(namespace, instance_id)
        self.memory = memory
        self.recovery = _MEMORY[memory]
        self._docker = DockerProvider(exec=exec, create=create, probe=probe)
        self._binary = shutil.which("docker") or "docker"

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Run Gym's container for the rollout ``spec.metadata`` names and open its session
        with it (empty state): recorded now, and at each of its turns' commits."""
        episode, instance_id = _episode_of(spec.metadata, self.name, descriptor=False)
        for option in ("volumes", "run_args"):
            if spec.provider_options.get(option):
                raise SandboxError(
                    f"{self.name}: SandboxSpec.provider_options[{option!r}] is not "
                    f"supported: a restore refuses a host mount, and extra run flags may "
                    f"make one; copy inputs in with files= or upload()")
        client = await self._client(instance_id)
        ledger = await self._ledger(client)
        key = episode.capture_key
        try:
            live: SessionRecord | None = await client.get(episode)
        except SessionNotFoundError:
            live = None
        if live is not None and live.container is not None:  # repeated after its answer
            return self._handle(await self._adopt(live, client.instance_id))  # was lost
        # Labelled with its holder: should this process die before it is marked, the
        # next holder of the instance still finds it (nemo_ckpt.sandboxes.provided).
        label = provided_label(self.namespace, client.instance_id)
        inner = await self._docker.create(dataclasses.replace(spec, provider_options={
            **spec.provider_options, "run_args": ["--label", label]}))
        await asyncio.to_thread(ledger.mark, key, container=inner.sandbox_id,
                                rollout_id=episode.rollout_id)
        try:
            record = await client.open(episode, b"", container=ContainerRef(
                inner.sandbox_id, memory="off" if self.memory == "off" else "required"))
        except BaseException as exc:
            opened = await self._opened(client, episode, inner.sandbox_id)
            if opened and isinstance(exc, Exception):  # only the answer was lost
                return self._handle(await self._adopt(await client.get(episode),
                                                      client.instance_id))
            if opened is False:
                await self._docker.close(inner)
                ledger.unmark(key)
            elif opened is None:
                raise SandboxError(
                    f"{self.name}: the session of {key} may or may not have opened "
                    f"({type(exc).__name__}: {exc}), and its holder {client.instance_id} "
                    f"cannot be asked: its container {inner.sandbox_id} stays, for a "
                    f"retried create to adopt, or for the holder's next start to "
                    f"remove") from exc
            raise
        return self._handle(_Box(episode, client.instance_id, inner, _recovery(record,
                                                                           self.recovery)))

    async def _adopt(self, record: SessionRecord, instance_id: str) -> _Box:
        """The restored container, by its new name (Gym's own ``connect``)."""
        if record.container is None:
            raise SandboxError(f"{self.name}: the session of {record.episode.capture_key} on "
                               f"{instance_id} owns no container (finished, or opened "
                               f"without one)")
        inner = await self._docker.connect({"sandbox_id": record.container})
        # A restore made it: released with its session from now on, as one made here.
        ledger = await self._ledger(await self._client(instance_id))
        await asyncio.to_thread(ledger.mark, record.episode.capture_key,
                                container=record.container,
                                rollout_id=record.episode.rollout_id)
        return _Box(record.episode, instance_id, inner, _recovery(record, self.recovery))

    async def exec(self, handle: SandboxHandle, command: str, *, cwd: str | None = None,
                   env: dict[str, str] | None = None, timeout_s: int | float | None = None,
                   user: str | int | None = None) -> SandboxExecResult:
        box = self._live(handle, "run a command in")
        result: SandboxExecResult = await self._docker.exec(
            box.inner, command, cwd=cwd, env=env, timeout_s=timeout_s, user=user)
        return result

    async def upload_file(self, handle: SandboxHandle, source_path: Path,
                          target_path: str) -> None:
        await self._docker.upload_file(self._live(handle, "upload into").inner, source_path,
                                       target_path)

    async def download_file(self, handle: SandboxHandle, source_path: str,
                            target_path: Path) -> None:
        await self._docker.download_file(self._live(handle, "download from").inner,
                                         source_path, target_path)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        """As Gym's ``docker`` says, but a paused container is ``PAUSED`` (Gym's says
        running)."""
        from nemo_gym.sandbox.providers.base import SandboxStatus

        box: _Box = handle.raw
        if box.closed:
            return SandboxStatus.STOPPED
        code, out, _ = await self._cli("inspect", "--format", "{{.State.Status}}",
                                       box.inner.sandbox_id, check=False)
        if code == 0 and out.strip() == "paused":
            return SandboxStatus.PAUSED
        status: SandboxStatus = await self._docker.status(box.inner)
        return status

    async def pause(self, handle: SandboxHandle) -> None:
        """Freeze its processes (``docker pause``); resume it before its session's next
        turn."""
        box = self._live(handle, "pause")
        await self._cli("pause", box.inner.sandbox_id)
        box.paused = True

    async def resume(self, handle: SandboxHandle) -> None:
        box: _Box = handle.raw
        if box.closed:
            raise SandboxError(f"{self.name}: cannot resume sandbox {handle.sandbox_id}: "
                               f"it is closed")
        if box.paused:
            await self._cli("unpause", box.inner.sandbox_id)
        box.paused = False

    async def close(self, handle: SandboxHandle) -> None:
        """Remove the container (Gym's ``docker rm -f``); its session is the worker's to
        finish. A sandbox already closed (here, or through another handle) is left as it
        is."""
        box: _Box = handle.raw
        if box.closed:
            return
        box.closed = True
        await self._docker.close(box.inner)
        await self._unmark(box)

    async def aclose(self) -> None:
        await self._docker.aclose()

    async def _cli(self, *args: str, check: bool = True) -> tuple[int, str, str]:
        """The ``docker`` command line (the one Gym's provider runs), within a deadline."""
        proc = await asyncio.create_subprocess_exec(
            self._binary, *args, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), _CLI_TIMEOUT_S)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise ContainerRuntimeError(f"{self.name}: docker {' '.join(args)} did not end "
                                        f"within {_CLI_TIMEOUT_S:g}s") from None
        code = proc.returncode or 0
        if check and code != 0:
            raise ContainerRuntimeError(
                f"{self.name}: docker {' '.join(args)} failed ({code}): "
                f"{err.decode(errors='replace').strip()[:500]}")
        return code, out.decode(errors="replace"), err.decode(errors="replace")


def _recovery(record: SessionRecord, declared: SandboxRecovery) -> SandboxRecovery:
    """What a crash keeps of the sandbox of ``record``: nothing if the holder made its
    session restart-only (no CRIU on its node, memory required)."""
    return SandboxRecovery.RESTART_ONLY if record.restart_only else declared
