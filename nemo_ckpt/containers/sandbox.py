"""A session's container as a sandbox: recorded at each turn's commit, created again as
the next attempt's container (blocking; a holder calls these through its runtime).

Recording (``ContainerSandboxes.record``) reads what the container changed against its
image straight from its overlay upper directory with the sandbox scan
(``nemo_ckpt.trees.scan`` in its overlay mode: no link followed, names and sizes
bounded, only what changed since the last turn re-read), into the node's blob cache, so
rollouts from one image share their bytes in the store. Where CRIU works, the
container's processes are checkpointed first (podman stops them), the filesystem is
scanned while nothing runs, and the processes are restored in place: memory and files
are one consistent image of the container as of the turn's commit.

Restoring (``ContainerSandboxes.restore``) verifies the stored record and tree, makes
the files in a staging folder (``nemo_ckpt.trees.materialize``: setuid dropped,
nothing created outside it), creates the container from the image and the record's own
fields (never from a stored configuration: ``archive.py``), copies the files in and
deletes what the container deleted, walked component by component without following a
link, through the container's mount before anything runs in it. Then either podman
restores the processes from the checked archive's CRIU images, placed in the
container's own folder (``podman init`` made it, ``podman container restore`` reads
it), or the container's command starts afresh when there is no memory to restore or no
CRIU on this node. podman is never handed a list of deletions: it removes them
following links (issue 50, case 3).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_ckpt.containers.archive import INIT_MOUNT, check_archive, place_checkpoint
from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.errors import ContainerRuntimeError, SandboxError
from nemo_ckpt.trees.container_record import ContainerConfig, ContainerRecord
from nemo_ckpt.trees.limits import MAX_DEPTH, SandboxLimits, TreeBudget
from nemo_ckpt.trees.materialize import materialize
from nemo_ckpt.trees.node_cache import BlobCache
from nemo_ckpt.trees.scan import Listings, OverlayMarks, scan
from nemo_ckpt.trees.tree_codec import decode_tree
from nemo_ckpt.trees.tree_types import tree_digests, tree_stats

__all__ = ["ContainerSandboxes", "RecordedContainer", "RestoredContainer", "LABEL"]

log = logging.getLogger("nemo_ckpt.holder")
LABEL = "io.nemo-ckpt.capture-key"  # on every container a restore creates
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_OPAQUE_ENTRIES = 200_000


@dataclass(frozen=True, slots=True)
class RecordedContainer:
    """A container as one turn's commit recorded it."""

    record: ContainerRecord
    listings: Listings  # what the next scan may skip
    blobs: frozenset[bytes]  # every blob it references: tree objects, files, memory
    file_count: int
    file_bytes: int
    files_read: int  # by this recording: the files that changed since the previous


@dataclass(frozen=True, slots=True)
class RestoredContainer:
    """What ``ContainerSandboxes.restore`` made."""

    running: bool  # its processes restored from their memory (else started afresh)
    blobs: frozenset[bytes]  # every blob its record references
    file_count: int
    file_bytes: int


class ContainerSandboxes:
    """The containers of one holder's sessions (see the module docstring)."""

    def __init__(self, podman: Podman, cache: BlobCache, staging: Path,
                 limits: SandboxLimits | None = None, tree_budget: TreeBudget | None = None,
                 allow_setid: bool = False, memory: bool = True) -> None:
        self.podman = podman
        self.cache = cache
        self.staging = staging
        self.limits = limits or SandboxLimits()
        self.tree_budget = tree_budget or TreeBudget()
        self.allow_setid = allow_setid
        self.memory = memory
        self._criu_problem: str | None | bool = False  # False: not asked yet

    # --- what this node can do -------------------------------------------------------

    def criu_problem(self) -> str | None:
        """None when process memory can be captured here, else why not (asked once)."""
        if self._criu_problem is False:
            self._criu_problem = self.podman.criu_problem()
        return self._criu_problem  # type: ignore[return-value]

    def check(self) -> tuple[list[str], list[str]]:
        """(problems, warnings) for ``check_startup``: a problem means containers cannot
        be recorded on this node at all; a warning that their memory is not captured."""
        missing = self.podman.available()
        if missing is not None:
            return [missing], []
        storage = self.podman.storage()
        problems = []
        if storage.driver != "overlay":
            problems.append(f"podman stores containers with the {storage.driver!r} driver; "
                            f"recording a container's changes needs 'overlay'")
        elif storage.metacopy:
            problems.append("podman's overlay storage uses metacopy: a changed file's "
                            "content may not be in the upper directory; turn it off "
                            "(storage.conf: mountopt without metacopy=on)")
        warnings = []
        if self.memory and self.criu_problem() is not None:
            warnings.append(f"process memory is not captured on this node (filesystems "
                            f"only): {self.criu_problem()}")
        return problems, warnings

    # --- recording ---------------------------------------------------------------

    def describe(self, container: str, memory: bool = False
                 ) -> tuple[ContainerConfig, Path, bool, Path | None]:
        """The container's creation config, its upper directory, whether it runs, and
        its folder in podman's storage; ``ContainerRuntimeError`` for one that cannot be
        recorded (with ``memory``: stopped by a recording whose restore failed)."""
        info = self.podman.inspect(container)
        driver = info.get("GraphDriver") or {}
        if driver.get("Name") != "overlay":
            raise ContainerRuntimeError(
                f"container {container} is stored with the {driver.get('Name')!r} driver; "
                f"recording its changes needs podman's overlay driver")
        upper = (driver.get("Data") or {}).get("UpperDir")
        if not upper:
            raise ContainerRuntimeError(f"container {container} has no overlay upper "
                                        f"directory in podman's answer")
        mounts = info.get("Mounts") or []
        if mounts:
            where = ", ".join(str(m.get("Destination")) for m in mounts[:5])
            raise ContainerRuntimeError(
                f"container {container} has mounts ({where}): their files live outside "
                f"the container and would not be recovered; create it without volumes "
                f"or bind mounts")
        config = info.get("Config") or {}
        entry = config.get("Entrypoint")
        if isinstance(entry, str):
            entry = [entry] if entry else None
        cfg = ContainerConfig(
            image=str(info.get("Image", "")),
            command=tuple(config.get("Cmd") or ()),
            entrypoint=None if not entry else tuple(entry),
            env=tuple(config.get("Env") or ()),
            workdir=str(config.get("WorkingDir") or "/"),
            user=str(config.get("User") or ""),
            init=(info.get("HostConfig") or {}).get("Init") is True)
        state = info.get("State") or {}
        running = bool(state.get("Running"))
        if memory and not running and state.get("Checkpointed"):
            raise ContainerRuntimeError(
                f"container {container} is stopped with its processes checkpointed and "
                f"not restored (a recording of an earlier turn could not restore them): "
                f"its memory would be lost; close the session (its rollout starts over) "
                f"or restore the last snapshot")
        static = info.get("StaticDir")
        return cfg, Path(upper), running, Path(static) if static else None

    def record(self, container: str, previous: Listings | None, memory: bool = True,
               policy: str = "preferred") -> RecordedContainer:
        """Record ``container`` now: its processes' memory where ``memory``, CRIU works
        and it runs, and its filesystem changes (re-reading only what changed since the
        recording whose listings are ``previous``)."""
        config, upper, running, static = self.describe(container, memory and self.memory)
        captured: tuple[bytes, int] | None = None
        capture_memory = memory and self.memory and running and self.criu_problem() is None
        if capture_memory:
            captured = self._checkpoint(container)
            if static is not None:
                # A filesystem diff that someone's own `podman container checkpoint`
                # left there would be applied by the restore in place, over the files
                # as they are (found by benchmarks/containers.py).
                for stale in ("rootfs-diff.tar", "deleted.files"):
                    (static / stale).unlink(missing_ok=True)
        try:
            marks = OverlayMarks()
            result = scan(upper, previous, self.cache.store, limits=self.limits,
                          overlay=marks)
        finally:
            if capture_memory:
                self._continue(container)
        for digest, data in result.objects.items():
            self.cache.put(digest, data)
        blobs = set(result.blobs())
        if captured is not None:
            blobs.add(captured[0])
        record = ContainerRecord(
            config, result.root, result.root_size, tuple(sorted(marks.whiteouts)),
            tuple(sorted(marks.opaque)), tuple(sorted(marks.fifos)),
            None if captured is None else captured[0],
            0 if captured is None else captured[1], policy)
        return RecordedContainer(record, result.listings, frozenset(blobs),
                                 result.file_count(), result.file_bytes(),
                                 result.files_read)

    def _continue(self, container: str) -> None:
        """Restore the processes of the recording's checkpoint in place: on the
        container's own address, or on a new one when that fails (on podman's default
        network another container may have taken it while they were stopped)."""
        try:
            self.podman.restore_in_place(container)
            return
        except ContainerRuntimeError as exc:
            first = str(exc).splitlines()[-1]
        try:
            self.podman.restore_in_place(container, fresh_address=True)
        except ContainerRuntimeError as exc:
            raise ContainerRuntimeError(
                f"container {container} was stopped for this turn's recording (its "
                f"processes checkpointed) and podman could not restore them in place: "
                f"{str(exc).splitlines()[-1]}; the turn is not committed and the container "
                f"stays stopped: close the session (its rollout starts over) or restore "
                f"the last snapshot") from None
        log.warning("container %s continues on a new address: podman could not restore "
                    "it on its own (%s)", container, first[-500:])

    def _checkpoint(self, container: str) -> tuple[bytes, int]:
        """Checkpoint the processes (they stop, the dump kept for the restore in place)
        into the cache: the archive's digest and length."""
        self.staging.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.staging, prefix="checkpoint-") as tmp:
            archive = os.path.join(tmp, "checkpoint.tar")
            self.podman.checkpoint(container, archive, keep=True)
            with open(archive, "rb") as f:
                return self.cache.store(iter(lambda: f.read(4 << 20), b""))

    # --- restoring ---------------------------------------------------------------

    def restore(self, record: ContainerRecord, fetch: Callable[[bytes, int], Any],
                name: str, capture_key: str, where: str) -> RestoredContainer:
        """Create the container ``name`` as ``record`` left it; ``fetch(digest, size)``
        returns a blob's verified content. Says whether its processes were restored
        running (else it was started afresh from its command, files restored). What it
        made is removed if it fails."""
        config = record.config
        self.podman.image_id(config.image)  # this node must have the image
        tree, objects = decode_tree(record.tree, record.tree_size, fetch, where,
                                    self.tree_budget)
        self.staging.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.staging, prefix="restore-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            try:
                materialize(tree, rootfs, fetch, allow_setid=self.allow_setid)
            except OSError as exc:
                raise SandboxError(f"cannot make the files of {where} in {rootfs}: "
                                   f"{exc.strerror or exc}") from exc
            for path, mode in record.fifos:
                _mkfifo_below(str(rootfs), path, mode)
            deleted = list(record.whiteouts) + self._hidden(config.image, record, tree)
            memory = record.memory is not None and self.memory \
                and self.criu_problem() is None
            data: bytes | None = None
            if memory:
                assert record.memory is not None
                data = bytes(fetch(record.memory, record.memory_size))
            try:
                # Created from the record's own fields whether or not memory comes
                # back: no stored configuration reaches podman (archive.py).
                self.podman.create(name, config.image, config.command,
                                   config.entrypoint, config.env, config.workdir,
                                   config.user, {LABEL: capture_key}, init=config.init)
                if data is not None:
                    # Set up (podman's own files in its folder), never run: the CRIU
                    # images restore into it below.
                    self.podman.init(name)
                    self.podman.stop(name)
                    folder = self._folder(name)
                    # Checked once podman has set the container up: its init binary
                    # is the one podman mounted into it (its configuration's path).
                    members = check_archive(data, config.image, where,
                                            _init_path(folder) if config.init else None)
                self.podman.copy_in(str(rootfs), name)
                self._delete(name, deleted)  # by descriptor, before anything runs
                if data is not None:
                    place_checkpoint(data, members, folder, where)
                    del data
                    self.podman.restore_prepared(name)
                else:
                    self.podman.start(name)
            except BaseException:
                self.podman.remove(name)
                raise
        blobs = set(objects) | tree_digests(tree)
        if record.memory is not None:
            blobs.add(record.memory)
        stats = tree_stats(tree)
        return RestoredContainer(memory, frozenset(blobs), stats.files, stats.bytes)

    def _folder(self, container: str) -> Path:
        """The container's folder in podman's storage (its bundle: ``config.json``,
        ``checkpoint/``), as podman names it."""
        static = self.podman.inspect(container).get("StaticDir")
        if not isinstance(static, str) or not os.path.isabs(static):
            raise ContainerRuntimeError(f"podman names no folder for container "
                                        f"{container}")
        return Path(static)

    def _hidden(self, image: str, record: ContainerRecord, tree: dict[str, Any]
                ) -> list[str]:
        """The image's entries below each opaque directory that the container does not
        have there: what the opaque directory hid, to delete on restore."""
        if not record.opaque:
            return []
        root = self.podman.text("image", "mount", image)
        try:
            out: list[str] = []
            for directory in record.opaque:
                names = _list_below(root, directory)
                out.extend(f"{directory}/{n}" for n in names
                           if f"{directory}/{n}" not in tree)
                if len(out) > _MAX_OPAQUE_ENTRIES:
                    raise ContainerRuntimeError(
                        f"image {image[:12]} holds more than {_MAX_OPAQUE_ENTRIES} entries "
                        f"below the container's opaque directories")
            return out
        finally:
            self.podman.run("image", "unmount", image, check=False)

    def _delete(self, container: str, paths: Iterable[str]) -> None:
        paths = list(paths)
        if not paths:
            return
        root = self.podman.mount(container)
        try:
            for path in paths:
                _remove_below(root, path)
        finally:
            self.podman.unmount(container)

    def discard(self, name: str) -> None:
        """Remove the container ``name`` (stopped at once) if it exists."""
        self.podman.remove(name)


def _init_path(folder: Path) -> str | None:
    """The host path of the init binary podman mounted at ``INIT_MOUNT`` in the container
    it set up in ``folder`` (its own ``config.json``, from its configuration's
    ``init_path``); None when it mounted none."""
    try:
        spec = json.loads((folder / "config.json").read_bytes())
    except (OSError, ValueError) as exc:
        raise ContainerRuntimeError(f"cannot read podman's config.json in {folder}: "
                                    f"{exc}") from None
    mounts = spec.get("mounts") if isinstance(spec, dict) else None
    for m in mounts if isinstance(mounts, list) else []:
        if isinstance(m, dict) and m.get("destination") == INIT_MOUNT \
                and m.get("type") == "bind" and isinstance(m.get("source"), str):
            return str(m["source"])
    return None


def _open_parent(root: str, path: str) -> tuple[int, str] | None:
    """A descriptor of ``path``'s parent below ``root`` (walked without following a
    link) and its last name; None when a component is missing or not a directory."""
    parts = path.split("/")
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            try:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    os.close(fd)
                    return None
                raise
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def _remove_below(root: str, path: str) -> None:
    """Remove ``root/path`` (a file, a link or a whole directory), never following a
    link on the way; nothing to do when it is not there."""
    found = _open_parent(root, path)
    if found is None:
        return
    fd, name = found
    try:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            _rmtree_at(fd, name, 0)
        else:
            os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def _rmtree_at(parent: int, name: str, depth: int) -> None:
    """Remove the directory ``name`` of ``parent`` and all below it by descriptor: a
    link swapped in is removed as a link, never followed."""
    if depth > MAX_DEPTH:
        raise ContainerRuntimeError(f"{name}: deeper than {MAX_DEPTH} directories")
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                _rmtree_at(fd, entry.name, depth + 1)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def _mkfifo_below(root: str, path: str, mode: int) -> None:
    """Make the FIFO ``root/path``; its parent is a directory the tree made, or the
    FIFO is refused with the tree (a stored record naming it elsewhere)."""
    found = _open_parent(root, path)
    if found is None:
        raise ContainerRuntimeError(f"the container record names the FIFO {path!r}, "
                                    f"whose folder its tree does not hold")
    fd, name = found
    try:
        os.mkfifo(name, mode & 0o777, dir_fd=fd)
        os.chmod(name, mode & 0o777, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


def _list_below(root: str, path: str) -> list[str]:
    """The names in the directory ``root/path``, walked without following a link."""
    found = _open_parent(root, path)
    if found is None:
        return []
    fd, name = found
    try:
        try:
            sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            return []
        try:
            return os.listdir(sub)
        finally:
            os.close(sub)
    finally:
        os.close(fd)

