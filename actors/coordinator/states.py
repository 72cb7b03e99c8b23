"""The lifecycle of a snapshot and of a restore on the coordinator, as state values.

Every operation is one record (``SnapshotOperation`` or ``RestoreOperation``) whose
``state`` is one of the classes below, each carrying the data that exists in it and no
more. A state changes only through ``OperationTable.set_state``
(``actors.coordinator.operation_table``), which checks the move against ``_MOVES`` and, on entering
a terminal state, alone records the outcome. The call order that drives these moves is
stated once, on ``nemo_ckpt.protocol.coordinator_api.CoordinatorApi``.

A snapshot::

    SnapshotBeginning -> SnapshotCaptured -> SnapshotWriting -> SnapshotCommitting
           |                   |                  |                   |      \\
           +-------------------+------------------+-------------------+-> Aborted
                                                                      |
                                                                  Committed
    Aborted -> FoundCommitted    the abort found the manifest renamed into place: the
                                 commit had won (committed is final)

A restore::

    RestorePreparing -> RestoreVerified -> RestoreCommitting -> Committed
           +-------------------+------------------+-------------> Aborted

An abort of an operation this coordinator never saw (its predecessor died, or the
abort overtook the first call) opens a record in ``Unseen`` and moves it at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from nemo_ckpt.phases import CaptureReport
from nemo_ckpt.protocol.operations import Outcome
from nemo_ckpt.transport import Actor

if TYPE_CHECKING:
    from actors.coordinator.read_claim import ReadClaim

__all__ = [
    "Aborted",
    "Committed",
    "FoundCommitted",
    "Operation",
    "OperationState",
    "RestoreCommitting",
    "RestoreOperation",
    "RestoreVerified",
    "RestorePreparing",
    "SnapshotBeginning",
    "SnapshotCaptured",
    "SnapshotCommitting",
    "SnapshotOperation",
    "SnapshotWriting",
    "Terminal",
    "Unseen",
    "can_move",
]


class OperationState:
    """One state of an operation's lifecycle."""

    def __repr__(self) -> str:
        return type(self).__name__


# --- a snapshot ----------------------------------------------------------------------


@dataclass(repr=False)
class SnapshotBeginning(OperationState):
    """The path is being claimed and every holder asked to pause and capture."""


@dataclass(repr=False)
class SnapshotCaptured(OperationState):
    """Every holder paused and captured; the writes are not started yet.

    ``order`` is this coordinator's count of captures when this one completed: a holder
    pauses for a snapshot only once the one before released it, so the captures' order.
    """

    captures: tuple[CaptureReport, ...]
    order: int


@dataclass(repr=False)
class SnapshotWriting(SnapshotCaptured):
    """Every holder was told to write its shard (the driver's ``start_writes``)."""


@dataclass(repr=False)
class SnapshotCommitting(SnapshotCaptured):
    """The holders were released at ``released`` (this process's monotonic clock); the
    shards are awaited and the manifest written. An abort waits for the outcome.

    ``unique_check`` is the check that no rollout was captured by two instances (the
    count of captured sessions when it passes), run while the shards are written.
    """

    released: float = 0.0
    unique_check: asyncio.Future[int] | None = None


# --- a restore -----------------------------------------------------------------------


@dataclass(repr=False)
class RestorePreparing(OperationState):
    """Instances placed, the holders reading and verifying their shards."""


@dataclass(repr=False)
class RestoreVerified(OperationState):
    """Every holder read and verified its shards; nothing is live yet."""

    read_seconds: float  # the slowest holder's shard reads


@dataclass(repr=False)
class RestoreCommitting(RestoreVerified):
    """Every holder is asked to make its sessions live; an abort waits for the outcome."""


# --- either --------------------------------------------------------------------------


@dataclass(repr=False)
class Unseen(OperationState):
    """An operation this coordinator learns of only by its abort."""


@dataclass(repr=False)
class Terminal(OperationState):
    """An ended operation: ``outcome`` is its one outcome."""

    outcome: Outcome
    result: Any = None  # a committed snapshot's ``SnapshotCommitted``


@dataclass(repr=False)
class Committed(Terminal):
    outcome: Outcome = Outcome.COMMITTED


@dataclass(repr=False)
class Aborted(Terminal):
    """Aborted by its driver or a failed phase (``Outcome.ABORTED``), or reaped when its
    lease lapsed (``Outcome.LAPSED``)."""

    outcome: Outcome = Outcome.ABORTED


@dataclass(repr=False)
class FoundCommitted(Committed):
    """Aborted, then found committed: the manifest had been renamed into place before a
    later step failed (or the coordinator that wrote it died), so the commit won."""


_SNAPSHOT = (SnapshotBeginning, SnapshotCaptured, SnapshotWriting, SnapshotCommitting)
_RESTORE = (RestorePreparing, RestoreVerified, RestoreCommitting)

# Every move allowed, from -> to (exact classes). Any live state may abort.
_MOVES: dict[type[OperationState], tuple[type[OperationState], ...]] = {
    SnapshotBeginning: (SnapshotCaptured, Aborted),
    SnapshotCaptured: (SnapshotWriting, SnapshotCommitting, Aborted),
    SnapshotWriting: (SnapshotCommitting, Aborted),
    SnapshotCommitting: (Committed, Aborted),
    RestorePreparing: (RestoreVerified, Aborted),
    RestoreVerified: (RestoreCommitting, Aborted),
    RestoreCommitting: (Committed, Aborted),
    Unseen: (Aborted,),
    Aborted: (FoundCommitted,),
    Committed: (),
    FoundCommitted: (),
}


def can_move(old: OperationState, new: OperationState) -> bool:
    """Whether ``old`` may be followed by ``new``."""
    return type(new) in _MOVES[type(old)]


@dataclass(eq=False)
class Operation:
    """One snapshot or restore, from its first call to its outcome."""

    id: str
    path: str | None
    started: float
    lease_deadline: float
    state: OperationState
    holders: dict[str, Actor] = field(default_factory=dict)  # instance -> handle
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    # The driver's span, for the later phases' spans (``nemo_ckpt.tracing``).
    trace: str = ""
    kind: ClassVar[str]  # "snapshot" or "restore", for metrics and messages

    @property
    def outcome(self) -> Outcome | None:
        return self.state.outcome if isinstance(self.state, Terminal) else None

    @property
    def committing(self) -> bool:
        """Commit and abort exclude each other: while a commit runs, it decides."""
        return isinstance(self.state, (SnapshotCommitting, RestoreCommitting))


@dataclass(eq=False)
class SnapshotOperation(Operation):
    """A snapshot, with what it holds outside the holders: the path's claim and the
    blob store's hold."""

    # The manifest's blob_store ("../blobs") when sessions may own sandboxes, and the
    # snapshot's hold on that store (``nemo_ckpt.trees.blob_claims``), taken beside the pause.
    blob_ref: str | None = None
    blob_hold: asyncio.Future[None] | None = None
    # The path's claim being written beside the pause: an abort's release waits for it,
    # so that its write never lands after the release removed the snapshot's files.
    claiming: asyncio.Future[None] | None = None
    # When (this process's monotonic clock) the path's claim and the store's hold were
    # last written: a renewal that failed leaves them standing for their ttl only.
    claimed_at: float | None = None
    held_at: float | None = None
    # Every beat this incarnation wrote (or tried to write) the path's claim with: a claim
    # with another beat, or none, means another incarnation aborted the operation.
    claim_beats: set[str] = field(default_factory=set)
    kind: ClassVar[str] = "snapshot"

    @property
    def captured(self) -> SnapshotCaptured | None:
        """The capture, from the holders' pause until the snapshot ends."""
        return self.state if isinstance(self.state, SnapshotCaptured) else None


@dataclass(eq=False)
class RestoreOperation(Operation):
    """A restore, with its claim on the folder it reads (from its prepare to its end)."""

    read_claim: ReadClaim | None = None
    kind: ClassVar[str] = "restore"


assert set(_MOVES) == {*_SNAPSHOT, *_RESTORE, Unseen, Aborted, Committed, FoundCommitted}
