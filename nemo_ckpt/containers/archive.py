"""podman's checkpoint archive (``podman container checkpoint --export``), checked and
put together again for a restore.

The archive a capture stores holds the processes (CRIU's images) and the container's
configuration, not its filesystem (``--ignore-rootfs``: that is recorded apart, in the
blob store). A stored archive may come from anyone, and podman creates a container from
the configuration inside it, so before a restore hands one to podman it is checked:
only the members podman writes, regular files and folders only, within bounds; the
container unprivileged, created from the record's image, with the default capabilities,
no namespace joined from elsewhere, and no mount but podman's own (proc, sysfs, tmpfs,
devpts, mqueue, cgroup, and binds of its own storage's files). Then the restore adds
the filesystem changes the way podman's own export would have: ``rootfs-diff.tar`` and
``deleted.files``.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nemo_ckpt.errors import ContainerRuntimeError

__all__ = ["check_archive", "assemble_archive"]

MAX_MEMBERS = 20_000
MAX_DUMP_BYTES = 16 << 20  # config.dump, spec.dump
_TOP_FILES = {"config.dump", "spec.dump", "network.status", "stats-dump", "ctr.log",
              "devshm-checkpoint.tar", "pod.options", "bind.mounts"}
_TOP_DIRS = {"checkpoint", "artifacts"}
_PLAIN = re.compile(r"^[A-Za-z0-9._-]{1,255}$")
_PODMAN_NETNS = re.compile(r"^/run/netns/netns-[0-9a-f-]{1,64}$")
_MOUNT_TYPES = {"proc", "sysfs", "tmpfs", "devpts", "mqueue", "cgroup", "bind"}
_STORAGE_PREFIXES = ("/run/containers/storage/", "/var/lib/containers/storage/")
# podman's default capabilities (containers.conf `default_capabilities`).
_DEFAULT_CAPS = frozenset({
    "CAP_AUDIT_WRITE", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_MKNOD", "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SETFCAP",
    "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"})


def check_archive(data: bytes, image_id: str, where: str) -> list[tarfile.TarInfo]:
    """The archive's members, once checked (see the module docstring); raises
    ``ContainerRuntimeError`` naming ``where`` and what is refused."""

    def refuse(why: str) -> ContainerRuntimeError:
        return ContainerRuntimeError(f"the checkpoint archive of {where} {why}; it was "
                                     f"not written by podman's checkpoint, or was changed: "
                                     f"restore another snapshot")

    members: list[tarfile.TarInfo] = []
    dumps: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                members.append(member)
                if len(members) > MAX_MEMBERS:
                    raise refuse(f"holds more than {MAX_MEMBERS} members")
                name = member.name.removeprefix("./").rstrip("/")
                parts = name.split("/")
                if not (member.isreg() or member.isdir()):
                    raise refuse(f"holds {name[:200]!r}, neither a file nor a folder")
                if len(parts) == 1:
                    ok = parts[0] in (_TOP_DIRS if member.isdir() else _TOP_FILES)
                else:
                    ok = len(parts) == 2 and parts[0] in _TOP_DIRS and member.isreg() \
                        and bool(_PLAIN.match(parts[1]))
                if not ok:
                    raise refuse(f"holds {name[:200]!r}, which podman's export never "
                                 f"writes")
                if name in ("config.dump", "spec.dump"):
                    if member.size > MAX_DUMP_BYTES:
                        raise refuse(f"holds a {name} of {member.size} bytes")
                    read = tar.extractfile(member)
                    dumps[name] = read.read() if read is not None else b""
    except tarfile.TarError as exc:
        raise refuse(f"is not a readable tar ({exc})") from None
    for name in ("config.dump", "spec.dump"):
        if name not in dumps:
            raise refuse(f"lacks {name}")
    try:
        config = json.loads(dumps["config.dump"])
        spec = json.loads(dumps["spec.dump"])
    except ValueError as exc:
        raise refuse(f"holds a dump that is not JSON ({exc})") from None
    problem = _config_problem(config, image_id) or _spec_problem(spec)
    if problem is not None:
        raise refuse(problem)
    return members


def _config_problem(config: Any, image_id: str) -> str | None:
    if not isinstance(config, dict):
        return "holds a config.dump that is not an object"
    if config.get("privileged"):
        return "asks for a privileged container"
    if config.get("rootfsImageID") != image_id:
        return f"names image {str(config.get('rootfsImageID'))[:80]}, not the record's"
    for field in ("userVolumes", "namedVolumes", "imageVolumes", "overlayVolumes"):
        if config.get(field):
            return f"asks for volumes ({field})"
    if config.get("rootfs"):
        return "asks for a root filesystem from the host"
    return None


def _spec_problem(spec: Any) -> str | None:
    if not isinstance(spec, dict):
        return "holds a spec.dump that is not an object"
    mounts = spec.get("mounts") or []
    if not isinstance(mounts, list):
        return "holds mounts that are not a list"
    for m in mounts:
        if not isinstance(m, dict):
            return "holds a mount that is not an object"
        kind, source = m.get("type"), str(m.get("source", ""))
        if kind not in _MOUNT_TYPES:
            return f"asks for a mount of type {str(kind)[:40]!r}"
        if kind == "bind" and (not source.startswith(_STORAGE_PREFIXES) or ".." in source):
            return f"asks to mount {source[:200]!r} from the host"
    process = spec.get("process") or {}
    caps = process.get("capabilities") or {} if isinstance(process, dict) else {}
    if not isinstance(caps, dict):
        return "holds capabilities that are not an object"
    for kind, listed in caps.items():
        extra = set(listed or ()) - _DEFAULT_CAPS
        if extra:
            return f"asks for capabilities {sorted(extra)[:5]} ({kind})"
    linux = spec.get("linux") or {}
    namespaces = linux.get("namespaces") or [] if isinstance(linux, dict) else []
    for ns in namespaces:
        if not isinstance(ns, dict):
            return "holds a namespace that is not an object"
        path = ns.get("path")
        # podman's own network namespace, made again for the restored container.
        if path and not (ns.get("type") == "network" and _PODMAN_NETNS.match(str(path))):
            return f"joins the {str(ns.get('type'))[:20]} namespace {str(path)[:100]!r}"
    have = {ns.get("type") for ns in namespaces if isinstance(ns, dict)}
    missing = {"pid", "mount", "ipc", "uts"} - have
    if missing:
        return f"shares the host's {sorted(missing)} namespaces"
    return None


def assemble_archive(data: bytes, members: Iterable[tarfile.TarInfo], rootfs: Path,
                     deleted: list[str], out: Path) -> None:
    """Write to ``out`` the checked archive ``data`` (its ``members``, from
    ``check_archive``) with ``rootfs``'s contents as ``rootfs-diff.tar`` and ``deleted``
    as ``deleted.files``, as podman's own export with the filesystem would hold."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as src, \
            tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for member in members:
            tar.addfile(member, src.extractfile(member) if member.isreg() else None)
        diff = out.with_name(out.name + ".rootfs-diff")
        try:
            with tarfile.open(diff, "w", format=tarfile.PAX_FORMAT) as inner:
                for child in sorted(rootfs.iterdir()):
                    inner.add(child, arcname=child.name, recursive=True)  # links as links
            tar.add(diff, arcname="rootfs-diff.tar")
        finally:
            diff.unlink(missing_ok=True)
        _add_bytes(tar, "deleted.files", json.dumps(["/" + p for p in deleted]).encode())


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))
