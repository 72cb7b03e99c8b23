"""What a session's sandbox is, and the interface every sandbox backend keeps.

Two backends keep it, neither importing the other: directories
(``nemo_ckpt.sandboxes.directories``) and containers (``nemo_ckpt.containers.backend``);
the holder's ``Sandboxes`` picks one per session. What both record into,
file trees and their blobs, is ``nemo_ckpt.trees``.

An environment declares, per session, what of it lives outside the session's state
(``SessionClient.open``), in one of three classes (NeMo Gym's participant classes):

- ``capturable``: a sandbox nemo-ckpt records at each turn's commit and creates again as
  the next attempt's: a directory on the holder's node (``directory=``), or a container
  on the node's podman (``container=``; its processes' memory too where CRIU works);
- ``restart_only``: state nemo-ckpt cannot capture (a remote service, a container whose
  memory matters where CRIU does not work): the session runs its turns as usual, a
  snapshot does not capture it but reports it restarting (``restarted_rollouts``, the
  ``restart_only_rollouts`` metric), and after a crash RL starts it over, as the seed
  treats a rollout the backend could not capture;
- ``stateless``: nothing outside the session's state (no sandbox).

The call order a backend keeps, for one session's sandbox (the holder makes every call;
the blocking ones in a thread):

1. At ``check_startup``, on each node: what the backend needs there. Directories need
   the node cache under ``sandbox_root`` writable (the holder's probe); containers say
   their problems (no podman, another storage driver) and warnings (no CRIU: filesystems
   only) through ``ContainerBackend.check``.
2. ``record(location, previous)``: when the session opens and at each turn's commit,
   before the turn counts as committed: what the sandbox holds now, its bytes in the
   node's blob cache, re-reading only what changed since ``previous``.
3. A snapshot captures the last recording of each session (nothing is read in the
   pause) and its persist writes the blobs the store lacks beside the shard.
4. ``restore(stored, fetch, ...)``: as the next attempt, from the verified store, before
   the restore goes live; what it made is discarded if the restore does not.
5. ``discard(location)``: a restore undone, or a session that leaves the holder while
   the holder still owns its sandbox.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, Union

if TYPE_CHECKING:
    from nemo_ckpt.trees.container_record import ContainerRecord
    from nemo_ckpt.trees.scan import Listings

__all__ = ["ContainerRef", "MemoryPolicy", "SandboxLocation",
           "SandboxBackend", "Recorded", "Staged", "StoredSandbox", "BlobSink", "Fetch",
           "container_name_problem"]


# What a container session needs of its processes' memory on a restore:
# "required": without CRIU on its node, the session is restart-only (its processes'
#   memory is the environment: a REPL, a database without its files flushed);
# "preferred": captured where CRIU works, else its files only, its command run again;
# "off": its files only, everywhere.
MemoryPolicy = Literal["required", "preferred", "off"]
_MEMORY = ("required", "preferred", "off")
_CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$")


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """A session's container on the holder's node, by name, and what it needs of its
    processes' memory."""

    name: str
    memory: MemoryPolicy = "preferred"

    def __post_init__(self) -> None:
        problem = container_name_problem(self.name)
        if problem is not None:
            raise ValueError(problem)
        if self.memory not in _MEMORY:
            raise ValueError(f"memory must be one of {_MEMORY}, not {self.memory!r}")


def container_name_problem(name: object) -> str | None:
    """None for a podman container name, else what is wrong with it."""
    if not isinstance(name, str) or not _CONTAINER_NAME.match(name):
        return (f"container name {str(name)[:200]!r} is not a podman container name "
                f"(letters, digits, '_', '.', '-'; at most 128)")
    return None


# Where a session's sandbox is: a directory on the node, or a container.
SandboxLocation = Union[Path, ContainerRef]

# ``fetch(digest, size)``: a blob's verified content, from the node cache or the store.
Fetch = Callable[[bytes, int], Any]


@dataclass(frozen=True, slots=True)
class Recorded:
    """A sandbox as one recording left it: its tree (for a container, of its changes)
    and every blob it references."""

    listings: Listings  # what the next recording may skip
    tree: bytes  # its top tree object's digest
    tree_size: int
    blobs: frozenset[bytes]  # every blob it references: tree objects, files, memory
    file_count: int
    file_bytes: int
    # A container's: its image, config, deletions and memory (its tree is ``tree``).
    container: ContainerRecord | None = None


@dataclass(frozen=True, slots=True)
class StoredSandbox:
    """One session's sandbox as a snapshot stored it (a trees file's row)."""

    rollout_id: str
    attempt: int
    tree: bytes
    tree_size: int
    container: bytes | None  # a container's encoded record, None for a directory
    where: str  # names it in errors: the rollout, the attempt and the trees file


@dataclass(slots=True)
class Staged:
    """A sandbox a restore made, not live yet: a directory in its staging folder, to
    move to ``target``; or a container, created (running) under its name."""

    rollout_id: str
    staging: Path | None
    target: SandboxLocation
    recorded: Recorded


class BlobSink(Protocol):
    """Where a recording puts what it read: the node's blob cache, and the holder's
    account of blobs it kept that the new tree does not reference."""

    def store(self, chunks: Iterable[bytes]) -> tuple[bytes, int]: ...

    def put(self, digest: bytes, data: bytes) -> None: ...

    def orphan(self, digests: set[bytes]) -> None: ...


class SandboxBackend(Protocol):
    """One kind of sandbox; the call order is in the module docstring."""

    def record(self, location: Any, previous: Recorded | None, sink: BlobSink) -> Recorded:
        """What the sandbox at ``location`` holds now, its new blobs given to ``sink``;
        only what changed since ``previous`` is read again (blocking)."""
        ...

    def restore(self, stored: StoredSandbox, fetch: Fetch, key: str, restore_id: str,
                staging: Path) -> Staged:
        """Make the sandbox of ``stored`` again for the attempt whose capture key is
        ``key``, not live yet (blocking): a directory in ``staging``, a container
        created. ``fetch`` returns a blob's verified content."""
        ...

    def conflict(self, staged: Staged) -> str | None:
        """Why ``staged`` cannot go live now (its place taken since), else None."""
        ...

    def place(self, staged: Staged) -> None:
        """Make ``staged`` the session's sandbox (the restore goes live; blocking)."""
        ...

    def discard(self, location: Any) -> None:
        """Remove what a restore made that will not go live (blocking)."""
        ...
