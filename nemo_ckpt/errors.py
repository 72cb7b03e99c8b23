"""Every error nemo-ckpt raises, one class per kind.

Each message says what happened, where, and what to do. Whether a kind is retriable is
a property of its class (``retriable``), the one source that
``RayEnvironmentCheckpoint.is_unavailable`` reads and docs/FAILURES.md lists (a test
compares them): retriable kinds leave nothing RL holds changed and go away by
themselves (an actor unreachable or late, a lease that lapsed while something stalled,
a holder busy with another operation); a mismatch, bad input or a storage error never
does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]
             ) -> BaseException:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class NemoCkptError(Exception):
    """Base class of every error nemo-ckpt raises on purpose.

    Errors cross Ray actor boundaries, so each one pickles with its attributes even
    when its constructor takes other arguments than its message. ``failures`` holds,
    for an error raised by a fan-out, every holder's own error by instance id.
    """

    retriable: ClassVar[bool] = False
    failures: Mapping[str, BaseException] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def is_retriable(error: BaseException) -> bool:
    """Whether ``error`` is a retriable nemo-ckpt error (see the module docstring)."""
    return isinstance(error, NemoCkptError) and error.retriable


def aggregate(what: str, failures: Mapping[str, BaseException]) -> BaseException:
    """One error for a phase that failed on several holders, carrying every one.

    Its class is the first non-retriable holder error's (in the order given), or the
    first error's when all are retriable, so that ``is_unavailable`` says "retry" only
    when every holder's failure was retriable; its message lists every holder's error,
    and ``failures`` holds them (as torch DCP's ``CheckpointException`` does).
    """
    if not failures:
        raise ValueError("aggregate() needs at least one failure")
    if len(failures) == 1:
        return next(iter(failures.values()))
    primary = next((e for e in failures.values() if not is_retriable(e)),
                   next(iter(failures.values())))
    lines = "\n".join(f"  - {inst}: {type(e).__name__}: {e}" for inst, e in failures.items())
    message = f"{what} failed on {len(failures)} holders:\n{lines}"
    try:
        error = copy.copy(primary)
        error.args = (message,)
    except Exception:  # an exception type that does not copy: keep it as it is
        return primary
    if isinstance(error, NemoCkptError):
        error.failures = dict(failures)
    return error


# --- the cut check -------------------------------------------------------------------


class SnapshotMismatchError(NemoCkptError):
    """The backend's captured rollouts disagree with RL's ledger at the data-plane cut.

    ``differences`` lists every offending episode and staging key, not only the first.
    """

    def __init__(self, differences: tuple[object, ...]) -> None:
        self.differences = differences
        lines = "\n".join(f"  - {d}" for d in differences)
        super().__init__(
            f"environment snapshot does not match the data-plane cut "
            f"({len(differences)} difference(s)); this snapshot could not be restored, "
            f"so it is not committed. Check that RL records each dispatch in its ledger "
            f"before the environment opens the session, and that every staging row is "
            f"written inside a turn:\n{lines}"
        )


class StaleCutError(NemoCkptError):
    """A data-plane cut was used after its barrier section exited."""


class UncheckedSnapshotError(NemoCkptError):
    """A snapshot's block ended without ``check_against_cut``: nothing proved that what
    the backend captured matches RL's ledger, so it did not commit."""


# --- reading a snapshot --------------------------------------------------------------


def _where(path: Path | str) -> Path | str:
    """A path as a ``Path``, a URL as its text (``Path`` would collapse its ``//``)."""
    return path if isinstance(path, str) and "://" in path else Path(path)


class SnapshotReadError(NemoCkptError):
    """Base class of every refusal to read a snapshot. A refused read changes nothing."""

    def __init__(self, path: Path | str, message: str) -> None:
        self.path = _where(path)
        super().__init__(message)


class SnapshotNotFoundError(SnapshotReadError):
    """No committed snapshot (no manifest) exists at the path."""

    def __init__(self, path: Path | str, detail: str = "") -> None:
        extra = f" {detail}" if detail else ""
        super().__init__(
            path,
            f"no environment snapshot at {path}: {path}/manifest.json does not "
            f"exist.{extra} A snapshot is committed only when its manifest is written; "
            f"pass the checkpoint path that snapshot() was given, or restore an earlier "
            f"checkpoint.",
        )


class CheckpointPathError(SnapshotReadError):
    """The checkpoint path exists but cannot hold a snapshot (for example, it is a file)."""


class UnsupportedFormatVersionError(SnapshotReadError):
    """The manifest's format version is not one this nemo-ckpt can read."""


class ManifestInvalidError(SnapshotReadError):
    """The manifest does not parse as JSON or does not validate."""


class TornSnapshotError(SnapshotReadError):
    """A shard the manifest names is missing."""


class ShardCorruptedError(SnapshotReadError):
    """A shard's byte length or content hash differs from the manifest's, or it does not decode."""


class UnsafeShardNameError(SnapshotReadError):
    """A manifest names a shard file that is not a plain file name in its folder."""


# --- writing a snapshot --------------------------------------------------------------


class SnapshotWriteError(NemoCkptError):
    """Writing a shard or the manifest failed (read-only, gone, out of space, ...)."""

    def __init__(self, path: Path | str, message: str) -> None:
        self.path = _where(path)
        super().__init__(message)


# --- the Ray runtime -----------------------------------------------------------------


class BackendUnavailableError(NemoCkptError):
    """A holder or the coordinator was unreachable, died, or missed a deadline.

    Nothing RL holds has changed; the caller may retry the snapshot. ``unreachable``
    names the kind of actor a transport could not reach or that missed its deadline
    ("coordinator" or "holder"; None when the callee raised it, reporting another),
    and ``timed_out`` whether it missed a deadline (it may still be running the call)
    rather than being found dead.
    """

    retriable = True
    unreachable: str | None = None
    timed_out = False


class HolderStateError(NemoCkptError):
    """A session holder refused a call that does not fit its state (running, paused
    for a snapshot, restoring), or a phase out of order."""


class HolderBusyError(HolderStateError):
    """A holder is paused or restoring for another operation (another driver's, or one
    whose driver died: its lease ends it). Retry once that operation is over."""

    retriable = True


class StaleSnapshotError(HolderStateError):
    """A phase carried an operation id that has ended (a late or repeated call), that
    its driver has moved past, or that the callee never saw."""


class LeaseExpiredError(NemoCkptError):
    """An operation's lease lapsed before it committed (its renewals stopped: the driver
    or the coordinator stalled, died, or could not be reached), so the holders resumed
    by themselves and it cannot commit. Nothing RL holds changed: retry."""

    retriable = True


class OperationAbortedError(NemoCkptError):
    """The operation was aborted (by its driver, or because a phase failed) before the
    call could complete; nothing of it stays. Retry the operation."""

    retriable = True


class SnapshotInProgressError(NemoCkptError):
    """A call that needs no open snapshot (a second snapshot, retire, forget, restore)
    came while one is open."""


class CheckpointPathBusyError(NemoCkptError):
    """Another job's snapshot is in progress in the same checkpoint path. Two jobs must
    not share a checkpoint path: give each its own."""


class SessionError(NemoCkptError):
    """Base class of refusals of an environment worker's session call."""


class SessionNotFoundError(SessionError):
    """No live session has that capture key on that holder."""


class SessionExistsError(SessionError):
    """A session for that rollout, or with that capture key, is already live."""


class CaptureKeyCollisionError(SessionExistsError):
    """Two different episodes would share a capture key (``r-a1`` at attempt 0 and
    ``r`` at attempt 1)."""


class RetiredAttemptError(SessionError):
    """A turn or session for an attempt that RL retired."""


class RolloutFinishedError(SessionError):
    """A turn on a session whose rollout was handed in as finished, or a second finish
    of it with another result."""


class JobStoppedError(SessionError):
    """A session call on a holder that a stop snapshot parked (a job told to stop,
    ``RayEnvironmentCheckpoint.snapshot(..., stop=True)``): its sessions were dropped
    and their sandboxes freed once the snapshot was durable; a restore brings them back."""


class TurnInProgressError(SessionError):
    """A session already has a turn in flight, or a turn token is unknown."""


class TurnAbortedError(TurnInProgressError):
    """The turn was aborted by its own caller (cancelled, gone) before it began here."""


class TurnTimedOutError(TurnInProgressError):
    """The turn ran longer than ``turn_timeout_s`` (not counting the time its holder was
    paused), so its holder aborted it; its commit records nothing."""


class TurnOutcomeUnknownError(SessionError):
    """A turn's commit got no answer and its holder could not be asked within
    ``SessionClient.resolve_s`` whether it committed: the turn may have been recorded.
    Not retriable: running the turn again could record it twice."""


class StateTooLargeError(SessionError):
    """A session's state or turn record exceeds the configured limit."""


class EnvironmentAdapterError(SessionError):
    """A rollout run through ``nemo_ckpt.adapters`` used out of order (a step after its
    episode was done, a rollout resumed without its prompt), or a session whose turn
    records the adapter did not write."""


class RestoreConflictError(NemoCkptError):
    """A restored rollout is already live on the holder it would be restored to."""


class ConfigMismatchError(NemoCkptError):
    """The job's running actors were made with another ``CheckpointConfig`` than the
    caller's, in a field they cannot change while they run."""


class StartupCheckError(NemoCkptError):
    """The deployment cannot recover as configured; the message lists every reason."""


class TraceFileError(NemoCkptError):
    """``CheckpointConfig.trace_file`` is not a regular file this process can append to:
    a FIFO, a device, a symbolic link, or a path that cannot be opened here."""


# --- RL's side: the NeMo RL integration and the rollout checkpoint manager --------------


class StagingListingError(NemoCkptError):
    """Listing RL's staging partition under the cut failed; the snapshot did not commit."""


class StagingListingTimeoutError(StagingListingError):
    """Listing RL's staging partition missed its deadline; nothing changed."""

    retriable = True


class UnmappedOwnerError(NemoCkptError):
    """RL's ledger gives a live rollout to a Gym owner that ``owners=`` of
    ``NemoRlEnvironmentCheckpoint`` does not map to an instance: a configuration
    mistake, nothing changed."""


class FingerprintMismatchError(NemoCkptError):
    """A snapshot was taken under another job configuration than the restoring job's,
    in fields recovery depends on; ``changed`` maps each field to (saved, now). Nothing
    on disk was modified."""

    changed: Mapping[str, tuple[Any, Any]] = {}


class RolloutCheckpointFailedError(NemoCkptError):
    """Rollout snapshots failed ``max_consecutive_failures`` times in a row: the job
    would otherwise run on without a recoverable snapshot."""


class RlFileNotFoundError(SnapshotReadError):
    """RL's own file (``nemo_ckpt.manager.rl_files``) is not in the checkpoint path."""


class RlFileInvalidError(SnapshotReadError):
    """RL's own file does not read within its reader's bounds: larger than the
    ``max_bytes`` given, or (read as JSON) not UTF-8, not JSON, or nested too deeply."""


# --- sandbox directories ---------------------------------------------------------------


class SandboxError(NemoCkptError):
    """A sandbox directory that cannot be recorded or restored: outside the sandbox root,
    holding a device, FIFO or socket, a file that kept changing while it was read, past
    one of the sandbox limits, or a stored tree whose paths would leave it."""


class ContainerRuntimeError(SandboxError):
    """A session's container that cannot be recorded or restored: the container runtime
    (podman) is missing, refused a command or timed out, the container uses what cannot
    be captured (a bind mount, a storage driver other than overlay), or a stored
    container record or checkpoint archive is malformed."""


class BlobCorruptedError(SnapshotReadError):
    """A sandbox file's stored content (a blob) does not match its digest, or is missing
    from the blob store although a committed manifest references it."""
