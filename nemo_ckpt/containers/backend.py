"""Containers as a sandbox backend (``nemo_ckpt.sandbox_backend``; blocking): the
holder's side of ``nemo_ckpt.containers.sandbox``, with what a restore needs around it.

A restore creates each container as ``nemo-ckpt-<namespace>-<capture key>`` (beside one
left by an earlier restore, as directories go), running, before the restore goes live.
Each is marked in the holder's private folder before it is made, and unmarked once its
restore goes live (the session's from then on) or it is removed: the next holder of the
instance removes every container still marked (``remove_left``), made by a holder that
died mid-restore.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.containers.sandbox import ContainerSandboxes
from nemo_ckpt.errors import ContainerRuntimeError, RestoreConflictError
from nemo_ckpt.sandbox_backend import (
    BlobSink,
    ContainerRef,
    Fetch,
    MemoryPolicy,
    Recorded,
    Staged,
    StoredSandbox,
)
from nemo_ckpt.storage.names import beside
from nemo_ckpt.trees.container_record import decode_record
from nemo_ckpt.trees.limits import SandboxLimits, TreeBudget
from nemo_ckpt.trees.node_cache import BlobCache

__all__ = ["ContainerBackend", "container_name"]

log = logging.getLogger("nemo_ckpt.holder")
MADE = "made-by-restores"  # markers of containers made by restores not live yet


def container_name(text: str) -> str:
    """``text`` as a podman container name: other characters become ``_``; past 128
    characters, its end is a 16-digit tag of the whole."""
    name = re.sub(r"[^a-zA-Z0-9_.-]", "_", text)
    if len(name) > 128:
        tag = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8)
        name = f"{name[:111]}.{tag.hexdigest()}"
    return name


class ContainerBackend:
    """The containers of one holder's sessions (see the module docstring)."""

    def __init__(self, instance_id: str, namespace: str, env: dict[str, str],
                 cache: BlobCache, private: Path, limits: SandboxLimits,
                 tree_budget: TreeBudget, restore_setid: bool) -> None:
        self.instance_id = instance_id
        self.namespace = namespace
        self.private = private
        self.containers = ContainerSandboxes(Podman(env=env), cache, private / "work",
                                             limits, tree_budget, restore_setid)

    @property
    def podman(self) -> Podman:
        return self.containers.podman

    def check(self) -> tuple[list[str], list[str]]:
        problems, warnings = self.containers.check()
        return ([f"{self.instance_id}: {p}" for p in problems],
                [f"{self.instance_id}: {w}" for w in warnings])

    def restart_only_reason(self, ref: ContainerRef) -> str | None:
        """Why a session with this container cannot be captured here: it needs its
        memory where CRIU does not work; else None."""
        return self.containers.criu_problem() if ref.memory == "required" else None

    def record(self, location: ContainerRef, previous: Recorded | None,
               sink: BlobSink) -> Recorded:
        got = self.containers.record(location.name, previous.listings if previous else None,
                                     memory=location.memory != "off",
                                     policy=location.memory)
        return Recorded(got.listings, got.record.tree, got.record.tree_size, got.blobs,
                        got.file_count, got.file_bytes, got.record)

    def restore(self, stored: StoredSandbox, fetch: Fetch, key: str, restore_id: str,
                staging: Path) -> Staged:
        """Create the container of one stored session, running, not live yet."""
        assert stored.container is not None
        where = stored.where
        record = decode_record(stored.container, where)
        if (record.tree, record.tree_size) != (stored.tree, stored.tree_size):
            raise ContainerRuntimeError(f"the container record of {where} names another "
                                        f"tree than its row: crafted or damaged")
        criu = self.containers.criu_problem()
        if record.policy == "required" and record.memory is not None and criu is not None:
            raise ContainerRuntimeError(
                f"{self.instance_id}: the container of {where} needs its processes' memory "
                f"(opened with memory='required'), which this node cannot restore "
                f"({criu}); restore where CRIU works (check_startup warns of each node "
                f"where it does not)")
        name = self._target(key, restore_id)
        self._mark(name, True)
        try:
            made = self.containers.restore(record, fetch, name, key, where)
        except BaseException:
            self._mark(name, False)  # restore() removed what it made
            raise
        if record.memory is not None and not made.running:
            log.warning("%s: the container of %s was restored with its files only, its "
                        "command started again: %s", self.instance_id, where,
                        criu or "memory capture is off")
        policy: MemoryPolicy = record.policy  # type: ignore[assignment]
        return Staged(stored.rollout_id, None, ContainerRef(name, policy),
                      Recorded({}, stored.tree, stored.tree_size, made.blobs,
                               made.file_count, made.file_bytes, record))

    def _target(self, key: str, restore_id: str) -> str:
        """The name of a restored session's container: ``nemo-ckpt-<namespace>-<key>``,
        or beside one of that name left by an earlier restore; refuses the restore
        when both are taken."""
        base = container_name(f"nemo-ckpt-{self.namespace}-{key}")
        for name in (base, container_name(f"{base}.{beside(key, restore_id)}")):
            if not self.podman.exists(name):
                return name
        raise RestoreConflictError(
            f"{self.instance_id}: cannot restore the container of {key}: containers "
            f"{base} and the one beside it already exist; remove them, or restore into "
            f"a fresh job")

    def conflict(self, staged: Staged) -> str | None:
        return None  # created under its name already

    def place(self, staged: Staged) -> None:
        assert isinstance(staged.target, ContainerRef)
        self._mark(staged.target.name, False)  # the session's from now on

    def discard(self, location: ContainerRef) -> None:
        try:
            self.containers.discard(location.name)
            self._mark(location.name, False)
        except ContainerRuntimeError as exc:
            log.warning("%s: the container %s of an undone restore could not be removed: "
                        "%s", self.instance_id, location.name, exc)

    def _mark(self, name: str, made: bool) -> None:
        """Mark (or unmark) the container ``name`` as made by a restore not live yet."""
        marker = self.private / MADE / name
        if made:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        else:
            marker.unlink(missing_ok=True)

    @staticmethod
    def remove_left(instance_id: str, env: dict[str, str], private: Path) -> None:
        """Remove the containers an earlier holder of this instance made in restores
        that never went live (it died mid-restore), as its markers under ``private``
        say; before this holder's cache replaces that folder."""
        made = private / MADE
        if not made.is_dir():
            return
        podman = Podman(env=env)
        for marker in made.iterdir():
            try:
                podman.remove(marker.name)
                log.warning("%s: removed container %s, made by a restore of an earlier "
                            "holder of this instance that never went live", instance_id,
                            marker.name)
            except ContainerRuntimeError as exc:
                log.warning("%s: container %s, left by an earlier holder's restore, could "
                            "not be removed: %s", instance_id, marker.name, exc)
