"""The lifecycles of a holder's snapshots and restores, as state values.

Each operation the holder takes part in is, at any moment, in one of these states:

    SnapshotPaused(work, lease)      the gate is closed for it: drain, capture, maybe write
    SnapshotReleased(work, lease)    the gate opened again while its shard is written; it
                                     awaits its commit or abort under its lease
    RestoreLoading(work, lease)      the gate is closed for it: shards read and verified,
                                     nothing live yet
    RestoreLive(rollouts, dirs)      committed here and live, yet undone by its abort until
                                     a turn uses it or another restore starts
    Ended(outcome)                   terminal: committed, aborted or lapsed

and it moves only through ``HolderOperationTable.enter``, which alone records an outcome, and only
when an operation enters ``Ended``: once, whatever comes later, so a late or repeated
call gets that outcome or a clear refusal. A restore found committed here after its
abort elsewhere is the named transition RestoreLive -> Ended(aborted) ("undone"); one
used by a turn is RestoreLive -> Ended(committed) ("settled").

At most one operation closes the gate at a time (``current``); any number of released
snapshots and at most one live restore run beside it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from actors.holder.sandbox_restores import RestoredSandbox
from actors.holder.sandboxes import SandboxCapture
from actors.holder.session_table import Held
from nemo_ckpt.errors import HolderBusyError, HolderStateError, StaleSnapshotError
from nemo_ckpt.phases import CaptureReport, HolderState, PauseReport, PersistReport
from nemo_ckpt.phases import RestorePrepared as PreparedReport
from nemo_ckpt.protocol.operations import LifecycleTable, Outcome
from nemo_ckpt.sandbox_backend import SandboxLocation
from nemo_ckpt.storage.folder import Folder

__all__ = [
    "Capture",
    "Ended",
    "HolderOperationTable",
    "OperationState",
    "RestoreLive",
    "RestoreLoading",
    "RestoreWork",
    "SnapshotPaused",
    "SnapshotReleased",
    "SnapshotWork",
]


@dataclass(frozen=True)
class Capture:
    """A snapshot's in-memory copy: the idle sessions as held, their report, and the
    sandbox trees they had."""

    held: list[Held]
    report: CaptureReport
    sandboxes: SandboxCapture | None


@dataclass(eq=False)
class SnapshotWork:
    """What one snapshot has done so far, carried from its paused to its released state:
    each step's result, set once."""

    id: str
    directory: Folder
    pause: PauseReport | None = None
    capture: Capture | None = None
    persist: asyncio.Task[PersistReport] | None = None
    trace: str = ""  # the coordinator's span it runs under (``nemo_ckpt.tracing``)
    # A stop snapshot's sessions captured mid-turn (capture keys): their turns in flight
    # commit only if it ends without parking them (``HolderParts.after_stop_capture``).
    held_mid_turn: frozenset[str] = frozenset()


@dataclass(eq=False)
class RestoreWork:
    """What one restore has read so far; its sessions go live only on commit."""

    id: str
    prepared: asyncio.Future[PreparedReport] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    pending: list[Held] = field(default_factory=list)
    sandboxes: list[RestoredSandbox] = field(default_factory=list)
    trace: str = ""  # the coordinator's span it runs under (``nemo_ckpt.tracing``)


@dataclass(eq=False)
class SnapshotPaused:
    """Paused for one snapshot, under a lease; new turns wait at the gate."""

    work: SnapshotWork
    lease_deadline: float
    value = HolderState.PAUSED
    gate_open = False


@dataclass(eq=False)
class SnapshotReleased:
    """The driver's block exited: turns run again while the shard is written."""

    work: SnapshotWork
    lease_deadline: float
    value = HolderState.RUNNING
    gate_open = True


@dataclass(eq=False)
class RestoreLoading:
    """Loading one restore, under a lease; new turns wait at the gate."""

    work: RestoreWork
    lease_deadline: float
    value = HolderState.RESTORING
    gate_open = False


@dataclass(eq=False)
class RestoreLive:
    """A restore committed here whose sessions no turn has used yet: its abort (another
    holder failed its commit) drops them again, so a restore is all or nothing."""

    rollouts: tuple[str, ...]
    directories: tuple[SandboxLocation, ...]  # and containers
    value = HolderState.RUNNING
    gate_open = True


@dataclass(frozen=True)
class Ended:
    """Terminal: how the operation ended here."""

    outcome: Outcome


Leased = SnapshotPaused | SnapshotReleased | RestoreLoading
OperationState = SnapshotPaused | SnapshotReleased | RestoreLoading | RestoreLive | Ended

# The transitions allowed, by the state left; an operation never seen here may enter
# SnapshotPaused, RestoreLoading or Ended (an abort that overtook its first call).
_NEXT: dict[type, tuple[type, ...]] = {
    type(None): (SnapshotPaused, RestoreLoading, Ended),
    SnapshotPaused: (SnapshotReleased, Ended),
    SnapshotReleased: (Ended,),
    RestoreLoading: (RestoreLive, Ended),
    RestoreLive: (Ended,),
    Ended: (),
}


class HolderOperationTable(LifecycleTable[OperationState]):
    """The open operations' states, and the bounded history of the ended ones, of the
    holder of ``instance_id`` (the base: ``nemo_ckpt.protocol.operations.LifecycleTable``)."""

    def __init__(self, instance_id: str) -> None:
        super().__init__()
        self.instance_id = instance_id
        self._who = f"{instance_id}: "

    def enter(self, op_id: str, new: OperationState) -> OperationState | None:
        """Move ``op_id`` to ``new`` and return the state it left (None if not open).
        The only place an outcome is recorded: entering ``Ended`` of an operation that
        already ended keeps the first outcome."""
        old = self._open.get(op_id)
        if old is None and self.history.outcome(op_id) is not None:
            if isinstance(new, Ended):
                return None  # already ended: its outcome stands
            raise HolderStateError(f"{op_id} already ended here; it cannot start again")
        if not isinstance(new, _NEXT[type(old)]):
            raise HolderStateError(
                f"{op_id}: no transition from {type(old).__name__} to {type(new).__name__}")
        if isinstance(new, Ended):
            self._close(op_id, new.outcome)
        else:
            if not new.gate_open:
                current = self.current
                if current is not None and current is not old:
                    raise HolderStateError(f"{op_id}: the gate is closed for another one")
            self._open[op_id] = new
        return old

    def outcome(self, op_id: str) -> Outcome | None:
        """How ``op_id`` ended, or committed for a live restore (its commit stands unless
        it is undone)."""
        if isinstance(self._open.get(op_id), RestoreLive):
            return Outcome.COMMITTED
        return self.history.outcome(op_id)

    @property
    def current(self) -> SnapshotPaused | RestoreLoading | None:
        """The one operation the gate is closed for, if any."""
        for state in self._open.values():
            if isinstance(state, (SnapshotPaused, RestoreLoading)):
                return state
        return None

    def current_id(self) -> str | None:
        """The id of ``current``."""
        for op_id, state in self._open.items():
            if isinstance(state, (SnapshotPaused, RestoreLoading)):
                return op_id
        return None

    def released(self) -> list[SnapshotReleased]:
        """The released snapshots still open."""
        return [s for s in self._open.values() if isinstance(s, SnapshotReleased)]

    def live_restore(self) -> tuple[str, RestoreLive] | None:
        """The restore live here that its abort may still undo."""
        for op_id, state in self._open.items():
            if isinstance(state, RestoreLive):
                return op_id, state
        return None

    def snapshot(self, op_id: str) -> SnapshotWork | None:
        """The work of snapshot ``op_id`` while it is open, paused or released."""
        state = self._open.get(op_id)
        if isinstance(state, (SnapshotPaused, SnapshotReleased)):
            return state.work
        return None

    def lapsed(self, now: float) -> list[str]:
        """The open operations whose lease ran out by ``now``, gate-closing one first."""
        leased = sorted(((op_id, s) for op_id, s in self._open.items()
                         if isinstance(s, Leased)), key=lambda item: item[1].gate_open)
        return [op_id for op_id, s in leased if now > s.lease_deadline]

    def lease_left(self, now: float) -> float:
        """Seconds until the lease of ``current`` lapses (0 without one)."""
        state = self.current
        return 0.0 if state is None else max(0.0, state.lease_deadline - now)

    def busy(self, what: str, now: float) -> HolderBusyError:
        """The refusal of ``what`` while the gate is closed for ``current``."""
        state = self.current
        assert state is not None
        return HolderBusyError(
            f"{self.instance_id} refuses {what}: it is {state.value.value} for "
            f"{self.current_id()}; wait until that operation finishes (its lease lapses in "
            f"at most {self.lease_left(now):.1f}s if its driver died)")

    # --- the holder's words for a refusal (``LifecycleTable.refusal``) -------------------

    _late_advice = ", so it ended; refused without pausing anything"

    def _lapsed(self, op_id: str) -> str:
        return (f"{self.instance_id}: the lease of {op_id} lapsed, so the holder resumed by "
                f"itself and {op_id} cannot commit; retry (renewals stopped: was the driver "
                f"or coordinator stalled or gone?)")

    def _aborted(self, op_id: str) -> str:
        return f"{self.instance_id}: {op_id} was aborted; a late call for it changes nothing here"

    def _unknown(self, op_id: str, now: float) -> Exception:
        if self.current is not None:
            return self.busy(f"a call for {op_id}", now)
        return StaleSnapshotError(
            f"{self.instance_id}: no operation {op_id} here (the holder is running)")
