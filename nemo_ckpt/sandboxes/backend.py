"""What a session's sandbox is, and the interface every sandbox backend keeps.

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

1. ``check()``: at ``check_startup``, on each node: problems (the backend cannot work
   here) and warnings (it works partly: a container backend without CRIU captures
   filesystems only).
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

import enum
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, Union

__all__ = ["EnvironmentClass", "ContainerRef", "MemoryPolicy", "SandboxLocation",
           "SandboxBackend", "container_name_problem"]


class EnvironmentClass(str, enum.Enum):
    """How much of a session a snapshot can capture (see the module docstring)."""

    CAPTURABLE = "capturable"
    RESTART_ONLY = "restart_only"
    STATELESS = "stateless"


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


class SandboxBackend(Protocol):
    """One kind of sandbox; the call order is in the module docstring."""

    def check(self) -> tuple[list[str], list[str]]:
        """(problems, warnings) on this node."""
        ...
