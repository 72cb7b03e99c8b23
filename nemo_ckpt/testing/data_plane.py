"""A reference data plane for tests, examples and users' own integration tests.

``ReferenceDataPlane`` stands in for RL's data plane. It holds:

- a recovery ledger: per rollout, the instance it was dispatched to, its current
  attempt and that attempt's status (``dispatched``, ``finished``, ``abandoned``), and
  the attempts before it;
- token-capture staging rows, keyed by staging key;
- finished trajectories.

It is a plain asyncio class, so its rules are tested without Ray; ``DataPlaneActor``
is the same class as a Ray actor (made on first use: importing this module imports no
Ray). ``DataPlaneBarrier`` is the driver's side of the
barrier::

    async with env_checkpoint.snapshot(path) as snapshot:
        async with barrier.checkpoint() as cut:      # mutations drained, then held back
            if snapshot is not None:
                await snapshot.check_against_cut(cut)
            await barrier.save(cut, path)             # <path>/data_plane.json
    ...
    async with env_checkpoint.restored(path) as restored:
        report = await barrier.restore(path, restored, env_checkpoint.restored_results)

The rule both sides keep (DESIGN.md): RL records a dispatch in the ledger before the
environment opens the session, and every staging row is written inside a turn, before
the turn commits. A finished rollout's rows move into its trajectory. A finished
rollout's result, as its worker hands it to the backend (``nemo_ckpt.receipts``), is
``trajectory_result(records, staging_keys)``; a restore records the results the
backend hands back that the saved ledger has not recorded yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from nemo_ckpt.errors import (
    NemoCkptError,
    SnapshotInProgressError,
    SnapshotReadError,
    SnapshotWriteError,
    StaleCutError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode, RestoredEnvironmentRollouts
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.location import as_path_or_url
from nemo_ckpt.storage.stored_json import StoredJsonError, load_stored_json, validate_stored_json

__all__ = [
    "trajectory_result",
    "read_trajectory_result",
    "StaticCut",
    "LiveCut",
    "RolloutStatus",
    "LedgerRow",
    "Trajectory",
    "DataPlaneStats",
    "DataPlaneRestoreReport",
    "ReferenceDataPlane",
    "data_plane_actor_class",
    "DataPlaneBarrier",
    "start_data_plane",
    "read_data_plane_file",
    "DataPlaneFile",
    "DATA_PLANE_FILE",
    "CutInProgressError",
    "DataPlaneBusyError",
    "LedgerError",
    "DataPlaneFileError",
    "DataPlaneRestoreError",
]

DATA_PLANE_FILE = "data_plane.json"
_FORMAT: Literal["nemo-ckpt-reference-data-plane"] = "nemo-ckpt-reference-data-plane"
_VERSION: Literal[1] = 1
# The most the data-plane file (or a finished result) is read as: a test job's ledger.
_MAX_FILE_BYTES = 256 << 20


# --- errors -------------------------------------------------------------------------------


class CutInProgressError(SnapshotInProgressError):
    """A second cut (or a restore) was asked for while a cut is open: one cut at a time."""


class DataPlaneBusyError(NemoCkptError):
    """Mutations in flight did not drain before the barrier's deadline; no cut was taken."""


class LedgerError(NemoCkptError):
    """A mutation that does not fit the ledger (finishing a stale attempt, dispatching a
    finished rollout, finishing with staging rows the data plane does not hold)."""


class DataPlaneFileError(SnapshotReadError):
    """``data_plane.json`` is missing, does not parse, or does not validate."""


class DataPlaneRestoreError(NemoCkptError):
    """The environment's restore does not match the saved data plane; nothing changed."""


# --- cuts ---------------------------------------------------------------------------------


class StaticCut:
    """A data-plane cut over a fixed ledger and set of staging rows.

    It is live until ``expire()``, as a real cut is live until its barrier section
    exits; afterwards every read raises ``StaleCutError``.
    """

    def __init__(
        self,
        expected: Mapping[str, Iterable[EnvironmentEpisode]],
        staging_keys: Iterable[str] = (),
        name: str = "cut",
    ) -> None:
        self._expected = MappingProxyType({i: frozenset(e) for i, e in expected.items()})
        self._staging_keys = frozenset(staging_keys)
        self._name = name
        self._live = True

    def expire(self) -> None:
        """End the cut, as the barrier section's exit does."""
        self._live = False

    def require_live(self) -> None:
        """Raise ``StaleCutError`` once the cut has expired."""
        if not self._live:
            raise StaleCutError(
                f"data-plane {self._name} is stale: its barrier section has exited, so "
                f"the data plane may have changed since; take the check inside "
                f"`async with barrier.checkpoint() as cut:`"
            )

    def expected_episodes(self) -> Mapping[str, frozenset[EnvironmentEpisode]]:
        """RL's ledger at the cut, per instance."""
        self.require_live()
        return self._expected

    def staging_keys(self) -> frozenset[str]:
        """The staging rows at the cut."""
        self.require_live()
        return self._staging_keys


class LiveCut(StaticCut):
    """The cut ``DataPlaneBarrier.checkpoint()`` yields: live only inside its section.

    Attributes:
        cut_id: The data plane's id of this cut; ``save`` refuses any other.
        rows_written: Staging rows ever written, at the cut (a turn counter).
    """

    def __init__(self, cut_id: str, expected: Mapping[str, Iterable[EnvironmentEpisode]],
                 staging_keys: Iterable[str], rows_written: int) -> None:
        super().__init__(expected, staging_keys, name=f"cut {cut_id}")
        self.cut_id = cut_id
        self.rows_written = rows_written


# --- public records -----------------------------------------------------------------------


class RolloutStatus(str, enum.Enum):
    """The status of a rollout's current attempt in the ledger."""

    DISPATCHED = "dispatched"  # sent to an instance and not finished: expected at a cut
    FINISHED = "finished"      # its trajectory is in the data plane
    ABANDONED = "abandoned"    # given up; the next dispatch starts it over


@dataclass(frozen=True)
class LedgerRow:
    """One rollout in the ledger.

    Attributes:
        earlier_attempts: ``(attempt, instance_id, outcome)`` of each attempt before the
            current one, where outcome is ``continued`` (restored as the next attempt)
            or ``abandoned`` (started over).
    """

    rollout_id: str
    instance_id: str
    attempt: int
    status: RolloutStatus
    earlier_attempts: tuple[tuple[int, str, str], ...] = ()

    @property
    def episode(self) -> EnvironmentEpisode:
        """The current attempt."""
        return EnvironmentEpisode(self.rollout_id, self.attempt)


@dataclass(frozen=True)
class Trajectory:
    """A finished rollout: its turn records and, in the same order, its staging rows.

    ``steps`` is what two runs compare; the attempt and instance say where it finished.
    """

    rollout_id: str
    instance_id: str
    attempt: int
    records: tuple[Any, ...]
    rows: tuple[Any, ...]

    @property
    def steps(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The content two runs of the same rollout must agree on, turn by turn."""
        return (self.records, self.rows)


@dataclass(frozen=True)
class DataPlaneStats:
    """Counts of the data plane's contents, for progress and metrics."""

    rollouts: int
    dispatched: int
    finished: int
    abandoned: int
    staging_rows: int
    rows_written: int  # every staging write ever, carried across save and restore
    finished_turns: int
    cut_open: bool
    mutations_in_flight: int


@dataclass(frozen=True)
class DataPlaneRestoreReport:
    """What a restore did to the ledger.

    Attributes:
        continued: ``(instance_id, episode)`` per continued rollout, with the episode
            already bumped to the attempt the environment restored.
        restarted: Rollouts that were unfinished at the cut and not continued; their
            attempt is now abandoned and the next ``dispatch`` starts them over.
        finished: Rollouts finished at the cut.
        recorded: Rollouts finished from the results the environment handed back
            (finished, not yet recorded at the cut): recorded now, not run again.
        orphans_cleared: Staging rows dropped because no restored session references them.
        cut_id: The cut the file was saved at.
        rows_written_at_cut: Staging rows ever written, at that cut.
    """

    continued: tuple[tuple[str, EnvironmentEpisode], ...]
    restarted: tuple[str, ...]
    finished: tuple[str, ...]
    orphans_cleared: int
    cut_id: str
    rows_written_at_cut: int
    recorded: tuple[str, ...] = ()


def trajectory_result(records: Sequence[Any], staging_keys: Sequence[str]) -> bytes:
    """A finished rollout's result for ``SessionClient.finish``: what ``finish`` records."""
    return json.dumps({"records": list(records), "staging_keys": list(staging_keys)},
                      allow_nan=False).encode()


def read_trajectory_result(result: bytes) -> tuple[list[Any], list[str]]:
    """``(records, staging_keys)`` of a ``trajectory_result``; ValueError otherwise."""
    try:
        data = load_stored_json(result, "a finished result", _MAX_FILE_BYTES)
        records, keys = data["records"], data["staging_keys"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"a finished result is not a trajectory_result ({exc})") from None
    if not isinstance(records, list) or not isinstance(keys, list) \
            or not all(isinstance(k, str) for k in keys):
        raise ValueError("a finished result is not a trajectory_result")
    return records, keys


@dataclass(frozen=True)
class _CutView:
    """What ``begin_cut`` ships to the driver: plain tuples, cheap to serialize."""

    cut_id: str
    expected: tuple[tuple[str, str, int], ...]  # (instance_id, rollout_id, attempt)
    staging_keys: tuple[str, ...]
    rows_written: int


# --- the file -----------------------------------------------------------------------------


class _AttemptModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attempt: int = Field(ge=0)
    instance_id: str = Field(min_length=1)
    outcome: Literal["continued", "abandoned"]


class _RolloutModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout_id: str = Field(min_length=1)
    instance_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)
    status: RolloutStatus
    earlier_attempts: list[_AttemptModel] = Field(default_factory=list)


class _TrajectoryModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout_id: str = Field(min_length=1)
    instance_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)
    records: list[JsonValue]
    rows: list[JsonValue]


class DataPlaneFile(BaseModel):
    """``<checkpoint_path>/data_plane.json``: the whole data plane at one cut."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["nemo-ckpt-reference-data-plane"] = _FORMAT
    version: Literal[1] = _VERSION
    cut_id: str
    saved_at: datetime
    rows_written: int = Field(ge=0)
    rollouts: list[_RolloutModel]
    staging: dict[str, JsonValue]
    finished: list[_TrajectoryModel]


def read_data_plane_file(checkpoint_path: Path | str) -> DataPlaneFile:
    """Read and validate ``<checkpoint_path>/data_plane.json`` (a folder or a URL).

    Raises ``DataPlaneFileError`` when it is missing, does not parse, or does not validate.
    """
    folder = folder_at(checkpoint_path)
    path = folder.describe(DATA_PLANE_FILE)
    try:
        raw = folder.read(DATA_PLANE_FILE, _MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise DataPlaneFileError(
            path, f"no data-plane state at {path}: the snapshot at {checkpoint_path} was "
                  f"not saved by this data plane, or was not committed") from None
    except OSError as exc:
        raise DataPlaneFileError(path, f"cannot read {path}: {exc}") from None
    try:
        return validate_stored_json(DataPlaneFile, raw, path, _MAX_FILE_BYTES)
    except StoredJsonError as exc:
        raise DataPlaneFileError(path, str(exc)) from None
    except ValidationError as exc:
        raise DataPlaneFileError(
            path, f"{path} is not a valid data-plane file (format {_FORMAT!r} version "
                  f"{_VERSION}): {exc.error_count()} error(s): {exc.errors()[:3]}") from None


def _write_data_plane_file(checkpoint_path: str, data: bytes) -> str:
    """Write ``data`` as ``<checkpoint_path>/data_plane.json``, whole and durable or not
    at all (a folder's temp file, fsync and rename; a bucket's single put); returns where."""
    folder = folder_at(checkpoint_path)
    path = folder.describe(DATA_PLANE_FILE)
    try:
        folder.prepare()
        folder.write_bytes(DATA_PLANE_FILE, data)
    except SnapshotWriteError as exc:
        raise SnapshotWriteError(
            path, f"{exc}; the data-plane state is not saved, so the snapshot is not "
                  f"committed") from None
    return path


# --- the data plane -----------------------------------------------------------------------


@dataclass
class _Rollout:
    rollout_id: str
    instance_id: str
    attempt: int
    status: RolloutStatus
    earlier: list[tuple[int, str, str]] = field(default_factory=list)

    def row(self) -> LedgerRow:
        return LedgerRow(self.rollout_id, self.instance_id, self.attempt, self.status,
                         tuple(self.earlier))


class ReferenceDataPlane:
    """RL's data plane, reduced to what turn-level recovery needs. See the module doc.

    Every mutation (``dispatch``, ``write_staging``, ``finish``, ``abandon``) waits while
    a cut is open; ``begin_cut`` waits for the mutations in flight before it returns.

    Args:
        mutation_latency_s: Simulated write latency of each mutation (after it passed
            the barrier, before it lands), so tests can hold a mutation in flight.
    """

    def __init__(self, mutation_latency_s: float = 0.0) -> None:
        self._latency = mutation_latency_s
        self._ledger: dict[str, _Rollout] = {}
        self._staging: dict[str, Any] = {}
        self._finished: dict[str, Trajectory] = {}
        self._rows_written = 0
        self._cut_id: str | None = None
        self._in_flight = 0
        self._changed = asyncio.Condition()

    # --- mutations (from RL's driver and from environment workers) -----------------------

    async def dispatch(self, rollout_id: str, instance_id: str) -> EnvironmentEpisode:
        """Record that ``rollout_id`` is sent to ``instance_id``; returns the attempt to run.

        A new rollout runs attempt 0; an abandoned one starts over as the next attempt.
        Call it before the environment opens the session.
        """
        if not rollout_id or not instance_id:
            raise ValueError("dispatch needs a rollout id and an instance id")
        async with self._mutation():
            entry = self._ledger.get(rollout_id)
            if entry is None:
                self._ledger[rollout_id] = _Rollout(rollout_id, instance_id, 0,
                                                    RolloutStatus.DISPATCHED)
                return EnvironmentEpisode(rollout_id, 0)
            if entry.status is not RolloutStatus.ABANDONED:
                raise LedgerError(
                    f"cannot dispatch {rollout_id!r}: its attempt {entry.attempt} is "
                    f"{entry.status.value} on {entry.instance_id}; only an abandoned "
                    f"rollout is dispatched again")
            entry.earlier.append((entry.attempt, entry.instance_id, "abandoned"))
            entry.attempt += 1
            entry.instance_id = instance_id
            entry.status = RolloutStatus.DISPATCHED
            return EnvironmentEpisode(rollout_id, entry.attempt)

    async def write_staging(self, key: str, row: Any) -> None:
        """Store one token-capture staging row (JSON-compatible). Call it inside a turn."""
        if not isinstance(key, str) or not key:
            raise ValueError("a staging key must be a non-empty string")
        try:
            json.dumps(row, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"staging row {key!r} is not JSON-compatible: {exc}") from None
        async with self._mutation():
            self._staging[key] = row
            self._rows_written += 1

    async def finish(self, episode: EnvironmentEpisode, records: Sequence[Any],
                     staging_keys: Sequence[str]) -> Trajectory:
        """Record ``episode``'s trajectory: its turn records and its rows, in turn order.

        The rows move out of staging into the trajectory. Refused unless ``episode`` is
        the rollout's dispatched attempt and every row is present.
        """
        records = list(records)
        try:
            json.dumps(records, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"records of {episode.capture_key} are not JSON-compatible: "
                             f"{exc}") from None
        async with self._mutation():
            entry = self._current(episode, "finish")
            missing = [k for k in staging_keys if k not in self._staging]
            if missing:
                raise LedgerError(
                    f"cannot finish {episode.capture_key}: staging rows {missing[:10]} are "
                    f"not in the data plane (cleared as orphans, or never written inside "
                    f"a turn)")
            rows = tuple(self._staging.pop(k) for k in staging_keys)
            trajectory = Trajectory(episode.rollout_id, entry.instance_id, episode.attempt,
                                    tuple(records), rows)
            self._finished[episode.rollout_id] = trajectory
            entry.status = RolloutStatus.FINISHED
            return trajectory

    async def abandon(self, episode: EnvironmentEpisode) -> None:
        """Give up ``episode`` (its worker failed); the next dispatch starts it over."""
        async with self._mutation():
            self._current(episode, "abandon").status = RolloutStatus.ABANDONED

    # --- the barrier -------------------------------------------------------------------------

    async def begin_cut(self, timeout_s: float = 30.0) -> _CutView:
        """Hold new mutations back, wait for those in flight, and return the cut.

        Raises ``CutInProgressError`` while another cut is open, and
        ``DataPlaneBusyError`` (holding nothing back) if mutations do not drain in time.
        """
        cut_id = f"cut-{uuid.uuid4().hex[:12]}"
        self._take_cut(cut_id)
        try:
            async with self._changed:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._in_flight == 0), timeout_s)
        except asyncio.TimeoutError:
            await self._release_cut(cut_id)
            raise DataPlaneBusyError(
                f"{self._in_flight} data-plane mutation(s) still in flight after "
                f"{timeout_s:.1f}s; no cut was taken; retry the snapshot") from None
        except BaseException:
            await self._release_cut(cut_id)
            raise
        expected = tuple(sorted(
            (e.instance_id, e.rollout_id, e.attempt) for e in self._ledger.values()
            if e.status is RolloutStatus.DISPATCHED))
        return _CutView(cut_id, expected, tuple(sorted(self._staging)), self._rows_written)

    async def end_cut(self, cut_id: str) -> None:
        """Let mutations through again. Ending a cut that already ended is a no-op."""
        if self._cut_id == cut_id:
            await self._release_cut(cut_id)

    async def save(self, cut_id: str, checkpoint_path: str) -> str:
        """Write the data plane, as of the open cut ``cut_id``, to
        ``<checkpoint_path>/data_plane.json``; returns the file's path.

        Refused (``StaleCutError``) outside that cut: a save is consistent only while
        mutations are held back.
        """
        if self._cut_id != cut_id:
            raise StaleCutError(
                f"cannot save the data plane at {cut_id}: that cut is not open (the open "
                f"one is {self._cut_id}); save inside `async with barrier.checkpoint()`")
        data = self._to_file(cut_id).model_dump_json(indent=1).encode()
        return await asyncio.to_thread(_write_data_plane_file, checkpoint_path, data)

    async def restore(self, checkpoint_path: str, restored: RestoredEnvironmentRollouts,
                      results: Sequence[FinishedRollout] = ()) -> DataPlaneRestoreReport:
        """Replace the state with the one saved at ``checkpoint_path``, matched to the
        environment's restore.

        Continues exactly ``restored.continued_attempts`` (each as its next attempt, on
        its instance), records the finished ``results`` the environment handed back
        (``RayEnvironmentCheckpoint.restored_results``) that the saved ledger has not
        recorded yet, abandons every other unfinished attempt (the next ``dispatch``
        starts it over from turn 0), keeps ``restored.staging_keys`` and clears every
        other staging row as an orphan. Refused, changing nothing, when the two halves
        disagree (``DataPlaneRestoreError``) or the file is bad (``DataPlaneFileError``).
        """
        restore_id = f"restore-{uuid.uuid4().hex[:12]}"
        self._take_cut(restore_id)  # mutations wait until the new state is in place
        try:
            async with self._changed:
                await self._changed.wait_for(lambda: self._in_flight == 0)
            saved = await asyncio.to_thread(read_data_plane_file, checkpoint_path)
            ledger, report, recorded = _apply_restore(saved, restored, results)
            staging = {k: v for k, v in saved.staging.items()
                       if k in restored.staging_keys}
            finished = {
                t.rollout_id: Trajectory(t.rollout_id, t.instance_id, t.attempt,
                                         tuple(t.records), tuple(t.rows))
                for t in saved.finished}
            for result, (records, keys) in recorded:  # their rows leave staging
                finished[result.episode.rollout_id] = Trajectory(
                    result.episode.rollout_id, result.instance_id, result.episode.attempt,
                    tuple(records), tuple(staging.pop(k) for k in keys))
            self._ledger = ledger
            self._staging = staging
            self._finished = finished
            self._rows_written = saved.rows_written
            return report
        finally:
            await self._release_cut(restore_id)

    # --- reads ---------------------------------------------------------------------------------

    async def ledger(self) -> list[LedgerRow]:
        """Every rollout in the ledger, sorted by rollout id."""
        return [self._ledger[k].row() for k in sorted(self._ledger)]

    async def trajectories(self) -> dict[str, Trajectory]:
        """Every finished rollout's trajectory."""
        return dict(self._finished)

    async def staging_rows(self) -> dict[str, Any]:
        """Every staging row, by key."""
        return dict(self._staging)

    async def stats(self) -> DataPlaneStats:
        """Counts for progress lines and metrics."""
        statuses = [e.status for e in self._ledger.values()]
        return DataPlaneStats(
            rollouts=len(statuses),
            dispatched=statuses.count(RolloutStatus.DISPATCHED),
            finished=statuses.count(RolloutStatus.FINISHED),
            abandoned=statuses.count(RolloutStatus.ABANDONED),
            staging_rows=len(self._staging),
            rows_written=self._rows_written,
            finished_turns=sum(len(t.records) for t in self._finished.values()),
            cut_open=self._cut_id is not None,
            mutations_in_flight=self._in_flight,
        )

    # --- internals -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _mutation(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: self._cut_id is None)
            self._in_flight += 1
        try:
            if self._latency:
                await asyncio.sleep(self._latency)
            yield
        finally:
            async with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    def _take_cut(self, cut_id: str) -> None:
        if self._cut_id is not None:
            raise CutInProgressError(
                f"the data plane already has {self._cut_id} open; one cut at a time: "
                f"finish that `async with barrier.checkpoint()` block first")
        self._cut_id = cut_id  # from here on new mutations wait

    async def _release_cut(self, cut_id: str) -> None:
        async with self._changed:
            if self._cut_id == cut_id:
                self._cut_id = None
            self._changed.notify_all()

    def _current(self, episode: EnvironmentEpisode, what: str) -> _Rollout:
        entry = self._ledger.get(episode.rollout_id)
        if entry is None:
            raise LedgerError(f"cannot {what} {episode.capture_key}: the ledger never "
                              f"dispatched rollout {episode.rollout_id!r}")
        if entry.attempt != episode.attempt or entry.status is not RolloutStatus.DISPATCHED:
            raise LedgerError(
                f"cannot {what} {episode.capture_key}: the ledger's attempt of "
                f"{episode.rollout_id!r} is {entry.attempt} ({entry.status.value}); a "
                f"stale attempt's result is refused")
        return entry

    def _to_file(self, cut_id: str) -> DataPlaneFile:
        return DataPlaneFile(
            cut_id=cut_id,
            saved_at=datetime.now(timezone.utc),
            rows_written=self._rows_written,
            rollouts=[
                _RolloutModel(
                    rollout_id=e.rollout_id, instance_id=e.instance_id, attempt=e.attempt,
                    status=e.status,
                    earlier_attempts=[_AttemptModel(attempt=a, instance_id=i, outcome=o)
                                      for a, i, o in e.earlier])
                for _, e in sorted(self._ledger.items())],
            staging=dict(sorted(self._staging.items())),
            finished=[
                _TrajectoryModel(rollout_id=t.rollout_id, instance_id=t.instance_id,
                                 attempt=t.attempt, records=list(t.records),
                                 rows=list(t.rows))
                for _, t in sorted(self._finished.items())],
        )


_Recorded = tuple[FinishedRollout, tuple[list[Any], list[str]]]
"""A handed-back result to record, with its trajectory's records and staging keys."""


def _apply_restore(saved: DataPlaneFile, restored: RestoredEnvironmentRollouts,
                   results: Sequence[FinishedRollout] = ()
                   ) -> tuple[dict[str, _Rollout], DataPlaneRestoreReport, list[_Recorded]]:
    """The restored ledger, its report, and the handed-back results to record (with
    their records and staging keys); raises before anything changes."""
    ledger = {
        r.rollout_id: _Rollout(r.rollout_id, r.instance_id, r.attempt, r.status,
                               [(a.attempt, a.instance_id, a.outcome)
                                for a in r.earlier_attempts])
        for r in saved.rollouts}
    problems: list[str] = []
    continued_ids = _continued_ids(ledger, restored, problems)
    recorded, excused = _results_to_record(ledger, saved, restored, results,
                                           continued_ids, problems)
    missing = sorted(restored.staging_keys - saved.staging.keys() - excused)
    if missing:
        problems.append(f"staging rows the restored sessions reference are not in the "
                        f"saved data plane: {missing[:10]}")
    if problems:
        raise DataPlaneRestoreError(
            f"the environment restore does not match the data plane saved at cut "
            f"{saved.cut_id} ({len(problems)} problem(s)); restore both halves from the "
            f"same checkpoint path:\n" + "\n".join(f"  - {p}" for p in problems))
    continued, restarted = _advance_ledger(ledger, recorded, continued_ids)
    kept = restored.staging_keys & saved.staging.keys()
    report = DataPlaneRestoreReport(
        continued=tuple(continued),
        restarted=tuple(restarted),
        finished=tuple(sorted(t.rollout_id for t in saved.finished)),
        orphans_cleared=len(saved.staging) - len(kept),
        cut_id=saved.cut_id,
        rows_written_at_cut=saved.rows_written,
        recorded=tuple(sorted(r.episode.rollout_id for r, _ in recorded)),
    )
    return ledger, report, recorded


def _continued_ids(ledger: dict[str, _Rollout], restored: RestoredEnvironmentRollouts,
                   problems: list[str]) -> set[str]:
    """The rollouts whose dispatched attempt the environment continued; a continued
    attempt the ledger does not have dispatched, as it says, adds to ``problems``."""
    continued_ids: set[str] = set()
    for instance_id, rollout_id, attempt in sorted(restored.continued_attempts):
        entry = ledger.get(rollout_id)
        if entry is None:
            problems.append(f"{instance_id}/{rollout_id} attempt {attempt}: not in the ledger")
        elif (entry.status is not RolloutStatus.DISPATCHED or entry.attempt != attempt
              or entry.instance_id != instance_id):
            problems.append(
                f"{instance_id}/{rollout_id} attempt {attempt}: the ledger has attempt "
                f"{entry.attempt} {entry.status.value} on {entry.instance_id}")
        elif rollout_id in continued_ids:
            problems.append(f"{rollout_id}: continued twice")
        else:
            continued_ids.add(rollout_id)
    return continued_ids


def _results_to_record(ledger: dict[str, _Rollout], saved: DataPlaneFile,
                       restored: RestoredEnvironmentRollouts,
                       results: Sequence[FinishedRollout], continued_ids: set[str],
                       problems: list[str]) -> tuple[list[_Recorded], set[str]]:
    """The handed-back results to record, and the staging keys of those recorded before
    the cut (moved out of staging already); a result the ledger cannot take adds to
    ``problems``."""
    recorded: list[_Recorded] = []
    excused: set[str] = set()  # rows of results recorded before the cut: moved out already
    for result in sorted(results, key=lambda r: (r.instance_id, r.episode)):
        rollout_id, where = result.episode.rollout_id, \
            f"{result.instance_id}/{result.episode.capture_key}"
        entry = ledger.get(rollout_id)
        if entry is None:
            problems.append(f"{where}: a finished result of a rollout not in the ledger")
        elif entry.status is RolloutStatus.FINISHED:
            # Recorded before the cut; the result is only acknowledged.
            with contextlib.suppress(ValueError):
                excused.update(read_trajectory_result(result.result)[1])
        elif (entry.status is not RolloutStatus.DISPATCHED
              or entry.attempt != result.episode.attempt
              or entry.instance_id != result.instance_id
              or rollout_id in continued_ids):
            problems.append(f"{where}: a finished result, but the ledger has attempt "
                            f"{entry.attempt} {entry.status.value} on {entry.instance_id}")
        else:
            try:
                parts = read_trajectory_result(result.result)
            except ValueError as exc:
                problems.append(f"{where}: {exc}")
                continue
            absent = [k for k in parts[1] if k not in restored.staging_keys
                      or k not in saved.staging]
            if absent:
                problems.append(f"{where}: its finished result names staging rows the "
                                f"restore does not keep: {absent[:10]}")
            recorded.append((result, parts))
    return recorded, excused


def _advance_ledger(ledger: dict[str, _Rollout], recorded: list[_Recorded],
                    continued_ids: set[str]
                    ) -> tuple[list[tuple[str, EnvironmentEpisode]], list[str]]:
    """Apply the checked restore to ``ledger``: recorded results finish their rollouts,
    a continued attempt moves to its next attempt, every other dispatched one is
    abandoned. The continued episodes and the restarted rollouts."""
    continued: list[tuple[str, EnvironmentEpisode]] = []
    restarted: list[str] = []
    for result, _ in recorded:
        ledger[result.episode.rollout_id].status = RolloutStatus.FINISHED
    for rollout_id, entry in sorted(ledger.items()):
        if entry.status is not RolloutStatus.DISPATCHED:
            continue
        if rollout_id in continued_ids:
            # The environment restored the captured attempt as next_attempt(): match it.
            entry.earlier.append((entry.attempt, entry.instance_id, "continued"))
            entry.attempt += 1
            continued.append((entry.instance_id, EnvironmentEpisode(rollout_id, entry.attempt)))
        else:
            entry.status = RolloutStatus.ABANDONED
            restarted.append(rollout_id)
    return continued, restarted


def _actor_options() -> dict[str, Any]:
    # No CPU reserved: it must fit beside the driver on any head node.
    return {"num_cpus": 0, "max_concurrency": 10_000, "max_restarts": 0}


@functools.cache
def data_plane_actor_class() -> Any:
    """``ReferenceDataPlane`` as a Ray actor class, made on first use."""
    # Not at import, so that importing this module (and nemo_ckpt.testing) imports
    # no Ray: tests of the plain class run without it.
    import ray

    return ray.remote(**_actor_options())(ReferenceDataPlane)


def __getattr__(name: str) -> Any:
    if name == "DataPlaneActor":  # ReferenceDataPlane as a Ray actor class
        return data_plane_actor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start_data_plane(mutation_latency_s: float = 0.0, name: Optional[str] = None,
                     namespace: Optional[str] = None) -> Any:
    """Start a ``DataPlaneActor`` on the driver's node (as RL's data plane sits beside
    its controller) and return its handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {"scheduling_strategy": NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=True)}
    if name is not None:
        options.update(name=name, namespace=namespace)
    return data_plane_actor_class().options(**options).remote(mutation_latency_s)


# --- the driver's side --------------------------------------------------------------------


class DataPlaneBarrier:
    """The driver's handle on a data plane: its barrier, save and restore.

    ``data_plane`` is a ``DataPlaneActor`` handle, or a ``ReferenceDataPlane`` in this
    process (for tests without Ray).
    """

    def __init__(self, data_plane: Any, drain_timeout_s: float = 30.0) -> None:
        self.data_plane = data_plane
        self._drain_timeout_s = drain_timeout_s

    @contextlib.asynccontextmanager
    async def checkpoint(self) -> AsyncIterator[LiveCut]:
        """Freeze the data plane and yield a live cut; the cut dies when the block exits.

        Waits for mutations in flight first; mutations that come while the block runs
        wait until it exits. One cut at a time (``CutInProgressError``).
        """
        view: _CutView = await self._call("begin_cut", self._drain_timeout_s)
        expected: dict[str, set[EnvironmentEpisode]] = {}
        for instance_id, rollout_id, attempt in view.expected:
            expected.setdefault(instance_id, set()).add(EnvironmentEpisode(rollout_id, attempt))
        cut = LiveCut(view.cut_id, expected, view.staging_keys, view.rows_written)
        try:
            yield cut
        finally:
            cut.expire()
            await self._call("end_cut", view.cut_id)

    async def save(self, cut: LiveCut, checkpoint_path: Path | str) -> Path | str:
        """Save the data plane as of ``cut`` (which must be live) under ``checkpoint_path``
        (a folder or a URL); returns the file written, as a path or a URL."""
        cut.require_live()
        return as_path_or_url(await self._call("save", cut.cut_id, str(checkpoint_path)))

    async def restore(self, checkpoint_path: Path | str,
                      restored: RestoredEnvironmentRollouts,
                      results: Sequence[FinishedRollout] = ()) -> DataPlaneRestoreReport:
        """Load the data plane saved under ``checkpoint_path``, matched to ``restored``
        and to the finished ``results`` the environment handed back
        (``RayEnvironmentCheckpoint.restored_results``).

        Call it inside ``async with env_checkpoint.restored(path) as restored:``, so a
        refusal here also drops the environment's restore. Acknowledge every result
        after the block.
        """
        report: DataPlaneRestoreReport = await self._call(
            "restore", str(checkpoint_path), restored, tuple(results))
        return report

    async def _call(self, method: str, *args: Any) -> Any:
        target = getattr(self.data_plane, method)
        if isinstance(self.data_plane, ReferenceDataPlane):
            return await target(*args)
        from ray.exceptions import RayTaskError

        try:
            return await target.remote(*args)
        except RayTaskError as exc:
            # Surface the data plane's own error class, not Ray's wrapper.
            if isinstance(exc.cause, NemoCkptError):
                raise exc.cause from None
            raise
