"""podman's checkpoint archive (``podman container checkpoint --export``): checked, and
its CRIU images placed in the folder of a container we created for the restore.

The archive a capture stores holds the processes (CRIU's images) and the container's
configuration, not its filesystem (``--ignore-rootfs``: that is recorded apart, in the
blob store). A stored archive may come from anyone. What we hand a runtime, we wrote
(docs/DESIGN.md): the archive's ``config.dump`` and ``spec.dump`` are never given to
podman. The restore creates the container from the record's image and its own bounded
fields (``podman create``), and only the CRIU images (``checkpoint/``) and a
``devshm-checkpoint.tar`` rebuilt from checked plain files go into that container's
folder; no ``rootfs-diff.tar``, no ``deleted.files``, no ``network.status``. A denylist
of a stored configuration always misses a field (hooks, pid files, port mappings).

The dumps are still read and checked, as a sign of an archive that podman's checkpoint
did not write or that was changed: only the members podman writes, regular files and
folders only, within bounds; the container unprivileged, created from the record's
image, with the default capabilities, no namespace joined from elsewhere, and no mount
but podman's own: its storage's files, and for a container made with ``--init`` the init
binary at ``/run/podman-init`` from exactly the path the restoring node's podman mounted
into the container it set up (its configuration's ``init_path``), never a path the
archive names. A refusal names the member or field.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nemo_ckpt.errors import ContainerRuntimeError
from nemo_ckpt.storage.stored_json import load_stored_json
from nemo_ckpt.trees.container_record import check_relative_path

__all__ = ["check_archive", "place_checkpoint", "INIT_MOUNT"]

MAX_MEMBERS = 20_000
MAX_DUMP_BYTES = 16 << 20  # config.dump, spec.dump
_TOP_FILES = {"config.dump", "spec.dump", "network.status", "stats-dump", "ctr.log",
              "devshm-checkpoint.tar", "pod.options", "bind.mounts"}
_TOP_DIRS = {"checkpoint", "artifacts"}
_PLAIN = re.compile(r"^[A-Za-z0-9._-]{1,255}$")
_PODMAN_NETNS = re.compile(r"^/run/netns/netns-[0-9a-f-]{1,64}$")
_MOUNT_TYPES = {"proc", "sysfs", "tmpfs", "devpts", "mqueue", "cgroup", "bind"}
_STORAGE_PREFIXES = ("/run/containers/storage/", "/var/lib/containers/storage/")
INIT_MOUNT = "/run/podman-init"  # where podman's --init mounts its init binary
# podman's default capabilities (containers.conf `default_capabilities`).
_DEFAULT_CAPS = frozenset({
    "CAP_AUDIT_WRITE", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_MKNOD", "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SETFCAP",
    "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"})


def check_archive(data: bytes, image_id: str, where: str, init_path: str | None = None
                  ) -> list[tarfile.TarInfo]:
    """The archive's members, once checked (see the module docstring); raises
    ``ContainerRuntimeError`` naming ``where`` and what is refused. ``init_path``: the
    init binary podman mounted into the container the restore made (None: it has no
    ``--init``)."""

    def refuse(why: str) -> ContainerRuntimeError:
        return ContainerRuntimeError(f"the checkpoint archive of {where} {why}; it was "
                                     f"not written by podman's checkpoint, or was changed: "
                                     f"restore another snapshot")

    members: list[tarfile.TarInfo] = []
    seen: set[str] = set()
    dumps: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                members.append(member)
                if len(members) > MAX_MEMBERS:
                    raise refuse(f"holds more than {MAX_MEMBERS} members")
                name = member.name.removeprefix("./").rstrip("/")
                parts = name.split("/")
                if name in seen:
                    raise refuse(f"holds {name[:200]!r} twice")
                seen.add(name)
                if not (member.isreg() or member.isdir()):
                    raise refuse(f"holds {name[:200]!r}, neither a file nor a folder")
                if len(parts) == 1:
                    ok = parts[0] in (_TOP_DIRS if member.isdir() else _TOP_FILES)
                else:
                    ok = len(parts) == 2 and parts[0] in _TOP_DIRS and member.isreg() \
                        and bool(_PLAIN.match(parts[1])) and parts[1] not in (".", "..")
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
        config = load_stored_json(dumps["config.dump"], "config.dump", MAX_DUMP_BYTES)
        spec = load_stored_json(dumps["spec.dump"], "spec.dump", MAX_DUMP_BYTES)
    except ValueError as exc:
        raise refuse(f"holds a dump that does not read ({exc})") from None
    problem = _config_problem(config, image_id) or _spec_problem(spec, init_path)
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


def _spec_problem(spec: Any, init_path: str | None) -> str | None:
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
        if kind == "bind" and init_path is not None and source == init_path \
                and m.get("destination") == INIT_MOUNT:
            continue  # podman's own init binary, where podman mounts it here
        if kind == "bind" and (not source.startswith(_STORAGE_PREFIXES) or ".." in source):
            return (f"asks to mount {source[:200]!r} from the host (at "
                    f"{str(m.get('destination', ''))[:200]!r})")
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


def place_checkpoint(data: bytes, members: Iterable[tarfile.TarInfo], bundle: Path,
                     where: str) -> None:
    """Write into ``bundle`` (the folder podman made for a container we created) the CRIU
    images of the checked archive ``data`` (its ``members``, from ``check_archive``) as
    ``checkpoint/``, and its ``/dev/shm`` contents rebuilt from plain files and folders;
    nothing else of the archive. By descriptor, creating every name afresh."""
    try:
        _place(data, members, bundle, where)
    except OSError as exc:
        raise ContainerRuntimeError(f"cannot place the checkpoint of {where} in {bundle}: "
                                    f"{exc.strerror or exc}") from exc


def _place(data: bytes, members: Iterable[tarfile.TarInfo], bundle: Path, where: str
           ) -> None:
    fd = os.open(bundle, _DIR_FLAGS)
    try:
        os.mkdir("checkpoint", 0o700, dir_fd=fd)
        images = os.open("checkpoint", _DIR_FLAGS, dir_fd=fd)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as src:
            try:
                for member in members:
                    name = member.name.removeprefix("./").rstrip("/")
                    body = src.extractfile(member) if member.isreg() else None
                    if body is None:
                        continue
                    if name.startswith("checkpoint/"):
                        _write_at(images, name.split("/", 1)[1], body.read())
                    elif name == "devshm-checkpoint.tar":
                        _write_at(fd, name, _rebuilt_shm(body.read(), where))
            finally:
                os.close(images)
    finally:
        os.close(fd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_at(dir_fd: int, name: str, data: bytes) -> None:
    fd = os.open(name, _NEW_FILE, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _rebuilt_shm(data: bytes, where: str) -> bytes:
    """The container's ``/dev/shm`` contents as a tar we wrote: plain relative names,
    regular files and folders only, permission bits only (podman unpacks it into the
    restored container's ``/dev/shm``)."""
    out = io.BytesIO()
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as src, \
                tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
            for count, member in enumerate(src):
                name = member.name.removeprefix("./").rstrip("/")
                if name in ("", "."):
                    continue  # the tar's own top folder
                if count >= MAX_MEMBERS or not (member.isreg() or member.isdir()) \
                        or check_relative_path(name) is not None:
                    raise ContainerRuntimeError(
                        f"the checkpoint archive of {where} holds {name[:200]!r} in its "
                        f"/dev/shm contents, not a plain file or folder (or past "
                        f"{MAX_MEMBERS} entries); restore another snapshot")
                info = tarfile.TarInfo(name)
                info.type = tarfile.DIRTYPE if member.isdir() else tarfile.REGTYPE
                info.mode, info.uid, info.gid = member.mode & 0o777, member.uid, member.gid
                info.mtime = member.mtime
                body = None
                if member.isreg():
                    info.size = member.size
                    body = src.extractfile(member)
                dst.addfile(info, body)
    except tarfile.TarError as exc:
        raise ContainerRuntimeError(f"the checkpoint archive of {where} holds /dev/shm "
                                    f"contents that are not a readable tar ({exc}); "
                                    f"restore another snapshot") from None
    return out.getvalue()
