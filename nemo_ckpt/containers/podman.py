"""The local container runtime, podman, driven through its command line (blocking).

The PyPI clients (``podman``, ``docker``) have no checkpoint method, and the command line
is what a user's node has: every call here is one ``podman`` command with a deadline,
run with the configured environment (``CONTAINERS_CONF``, and a ``PATH`` that finds
CRIU for runc). A command that fails raises ``ContainerRuntimeError`` quoting the
command and what podman said.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_ckpt.errors import ContainerRuntimeError

__all__ = ["Podman", "Storage", "criu_check_problem"]

_SAID = 2000  # characters of podman's output an error quotes


@dataclass(frozen=True, slots=True)
class Storage:
    """How podman stores containers on this node (``podman info``)."""

    driver: str
    metacopy: bool


class Podman:
    """One node's podman (see the module docstring). ``env`` is added to the process's
    environment for every command."""

    def __init__(self, binary: str = "podman", env: Mapping[str, str] | None = None,
                 timeout_s: float = 120.0) -> None:
        self.binary = binary
        self.env = dict(env or {})
        self.timeout_s = timeout_s

    def _environment(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def available(self) -> str | None:
        """None when podman answers, else why not."""
        path = self.binary if os.sep in self.binary else shutil.which(
            self.binary, path=self._environment().get("PATH"))
        if path is None:
            return f"`{self.binary}` is not installed on this node"
        try:
            self.run("version", "--format", "{{.Client.Version}}", timeout_s=30)
        except ContainerRuntimeError as exc:
            return str(exc)
        return None

    def run(self, *args: str, input: bytes | None = None, timeout_s: float | None = None,
            check: bool = True) -> subprocess.CompletedProcess[bytes]:
        cmd = [self.binary, *args]
        try:
            done = subprocess.run(cmd, input=input, capture_output=True,
                                  env=self._environment(),
                                  timeout=self.timeout_s if timeout_s is None else timeout_s)
        except FileNotFoundError:
            raise ContainerRuntimeError(
                f"`{self.binary}` is not installed on this node: install podman "
                f"(the project's `make container-runtime` does, on Debian)") from None
        except subprocess.TimeoutExpired:
            raise ContainerRuntimeError(
                f"`{_quote(cmd)}` did not finish within "
                f"{self.timeout_s if timeout_s is None else timeout_s} s") from None
        if check and done.returncode != 0:
            said = (done.stderr or done.stdout).decode("utf-8", "replace").strip()
            raise ContainerRuntimeError(f"`{_quote(cmd)}` failed (exit {done.returncode}): "
                                        f"{said[-_SAID:]}")
        return done

    def text(self, *args: str, timeout_s: float | None = None) -> str:
        return self.run(*args, timeout_s=timeout_s).stdout.decode("utf-8", "replace").strip()

    # --- what podman knows ---------------------------------------------------------

    def storage(self) -> Storage:
        info = json.loads(self.text("info", "--format", "json"))
        store = info.get("store", {})
        status = store.get("graphStatus", {})
        return Storage(driver=str(store.get("graphDriverName", "")),
                       metacopy=str(status.get("Using metacopy", "false")) == "true")

    def inspect(self, container: str) -> dict[str, Any]:
        found = json.loads(self.text("container", "inspect", container))
        if not isinstance(found, list) or len(found) != 1 or not isinstance(found[0], dict):
            raise ContainerRuntimeError(f"podman inspect {container}: unexpected answer")
        return found[0]

    def exists(self, container: str) -> bool:
        return self.run("container", "exists", container, check=False).returncode == 0

    def image_id(self, image: str) -> str:
        """The image's full id (the digest of its configuration), or
        ``ContainerRuntimeError`` when this node does not have it."""
        done = self.run("image", "inspect", "--format", "{{.Id}}", image, check=False)
        if done.returncode != 0:
            raise ContainerRuntimeError(
                f"image {image} is not on this node: load or pull it on every node "
                f"that may restore this environment")
        return done.stdout.decode().strip()

    def criu_problem(self) -> str | None:
        """None when podman can checkpoint processes here (``criu check`` passes with
        the ``criu`` this podman's runc finds), else why not."""
        path = shutil.which("criu", path=self._environment().get("PATH"))
        if path is None:
            return "criu is not installed on this node"
        return criu_check_problem(path, self._environment())

    # --- lifecycle -----------------------------------------------------------------

    def create(self, name: str, image: str, command: Sequence[str],
               entrypoint: Sequence[str] | None, env: Sequence[str], workdir: str,
               user: str, labels: Mapping[str, str], init: bool = False) -> str:
        args = ["create", "--name", name, "--workdir", workdir or "/"]
        if init:  # podman's configured init binary (containers.conf `init_path`)
            args.append("--init")
        if user:
            args += ["--user", user]
        if entrypoint is not None:
            args += ["--entrypoint", json.dumps(list(entrypoint))]
        for var in env:
            args += ["--env", var]
        for key, value in labels.items():
            args += ["--label", f"{key}={value}"]
        return self.text(*args, image, *command)

    def start(self, container: str) -> None:
        self.run("start", container)

    def remove(self, container: str) -> None:
        """Remove the container if it exists, stopping it at once."""
        self.run("rm", "--force", "--time", "0", "--ignore", container)

    def mount(self, container: str) -> str:
        return self.text("mount", container)

    def unmount(self, container: str) -> None:
        self.run("unmount", container)

    def copy_in(self, source: str, container: str, destination: str = "/") -> None:
        """Copy the contents of the host directory ``source`` into ``container``."""
        self.run("cp", "--archive=false", f"{source.rstrip('/')}/.",
                 f"{container}:{destination}")

    def checkpoint(self, container: str, export: str, keep: bool) -> None:
        """Dump the container's processes with CRIU into the archive ``export`` (its
        filesystem not included: that is recorded apart). The processes stop; ``keep``
        leaves the dump in podman's storage for ``restore_in_place``."""
        args = ["container", "checkpoint", f"--export={export}", "--ignore-rootfs",
                "--compress=none", "--ignore-volumes"]
        if keep:
            args.append("--keep")
        self.run(*args, container)

    def restore_in_place(self, container: str, fresh_address: bool = False) -> None:
        """Restore the processes of ``checkpoint(keep=True)``. ``--ignore-rootfs``: the
        files are as they were (the processes stopped meanwhile); a rootfs diff left in
        the container's folder by someone's own ``podman container checkpoint`` must
        not be applied again over them. ``fresh_address``: podman assigns the container
        a new IP address rather than the one it had (taken by another container
        meanwhile, on a busy node)."""
        args = ["container", "restore", "--keep"]
        if fresh_address:
            args += ["--ignore-static-ip", "--ignore-static-mac"]
        self.run(*args, container)

    def init(self, container: str) -> None:
        """Have the runtime set the created container up (namespaces, mounts, podman's
        own files in its folder) without running its command."""
        self.run("init", container)

    def stop(self, container: str) -> None:
        """Stop the container at once (no grace period)."""
        self.run("stop", "--time", "0", container)

    def restore_prepared(self, container: str) -> None:
        """Restore the processes of the stopped ``container`` from the CRIU images
        placed in its folder (``checkpoint/``), with its files as they are now."""
        self.run("container", "restore", container)


def criu_check_problem(criu: str, env: Mapping[str, str] | None = None) -> str | None:
    """None when ``criu check`` passes with the binary ``criu``, else what it said."""
    try:
        done = subprocess.run([criu, "check"], capture_output=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{criu} check: {exc}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).decode("utf-8", "replace").strip()
        return f"{criu} check: {said.splitlines()[-1] if said else done.returncode}"
    return None


def _quote(cmd: Sequence[str]) -> str:
    return " ".join(cmd)
