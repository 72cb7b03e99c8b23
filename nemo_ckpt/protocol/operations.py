"""Operation ids, their outcomes, and the bounded history that fences late calls.

Every snapshot or restore is one operation with one id and one outcome. The driver
makes the id, so it can abort an operation whose first call never returned::

    snap-20261201T060000-1a2b3c4d-000007
    kind  wall-clock time  driver   its sequence number

A driver runs one operation at a time, so once a participant (the coordinator, a
holder) has seen operation N of a driver, any call for an earlier operation of that
driver is late: its operation ended before N began. ``OperationHistory`` keeps the
outcome of the last finished operations (to answer a late or repeated call with it)
and, per driver, the newest sequence number seen (to refuse any older one, however long
ago it ended). Both are bounded; a driver evicted from the second bound is one that has
sent nothing for many other drivers' operations.
"""

from __future__ import annotations

import enum
import re
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Generic, TypeVar

from nemo_ckpt.errors import LeaseExpiredError, OperationAbortedError, StaleSnapshotError

__all__ = [
    "HISTORY_SIZE",
    "LifecycleTable",
    "OperationHistory",
    "Outcome",
    "new_operation_id",
    "parse_operation_id",
]

# NeMo Gym remembers the last 64 ids; one operation a minute is an hour of history.
HISTORY_SIZE = 64
_ID = re.compile(r"^(?P<kind>[a-z]+)-\d{8}T\d{6}-(?P<driver>[0-9a-f]{8})-(?P<seq>\d{6,})$")


class Outcome(str, enum.Enum):
    """How an operation ended, as one participant saw it."""

    COMMITTED = "committed"
    ABORTED = "aborted"  # by its driver, or because a phase failed
    LAPSED = "lapsed"  # its lease ran out: nobody renewed it


def new_operation_id(kind: str, wall: float, driver: str, seq: int) -> str:
    """The id of a driver's ``seq``-th operation, started at ``wall`` (epoch seconds)."""
    when = datetime.fromtimestamp(wall, timezone.utc)
    return f"{kind}-{when:%Y%m%dT%H%M%S}-{driver[:8]}-{seq:06d}"


def parse_operation_id(operation_id: str) -> tuple[str, int] | None:
    """``(driver, sequence number)`` of an id ``new_operation_id`` made, else None."""
    match = _ID.match(operation_id)
    return None if match is None else (match["driver"], int(match["seq"]))


class OperationHistory:
    """Outcomes of the last ``size`` finished operations, and each driver's newest id."""

    def __init__(self, size: int = HISTORY_SIZE, drivers: int = HISTORY_SIZE) -> None:
        self._size = size
        self._drivers = drivers
        self._outcomes: OrderedDict[str, Outcome] = OrderedDict()
        self._newest: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._outcomes)

    @property
    def drivers(self) -> int:
        """How many drivers' newest ids are remembered."""
        return len(self._newest)

    def outcome(self, operation_id: str) -> Outcome | None:
        """How ``operation_id`` ended, if it is among the last ones that did."""
        return self._outcomes.get(operation_id)

    def is_late(self, operation_id: str) -> bool:
        """Whether its driver has since started a newer operation (so it has ended)."""
        parsed = parse_operation_id(operation_id)
        if parsed is None:
            return False
        newest = self._newest.get(parsed[0])
        return newest is not None and parsed[1] < newest

    def note(self, operation_id: str) -> None:
        """Remember that ``operation_id`` has started here."""
        parsed = parse_operation_id(operation_id)
        if parsed is None:
            return
        driver, seq = parsed
        self._newest[driver] = max(seq, self._newest.get(driver, seq))
        self._newest.move_to_end(driver)
        while len(self._newest) > self._drivers:
            self._newest.popitem(last=False)

    def record(self, operation_id: str, outcome: Outcome, replace: bool = False) -> Outcome:
        """Record how ``operation_id`` ended and return its outcome: the first one
        recorded, unless ``replace`` (a committed restore undone by its abort)."""
        known = self._outcomes.get(operation_id)
        if known is not None and not replace:
            return known
        self._outcomes[operation_id] = outcome
        self._outcomes.move_to_end(operation_id)
        while len(self._outcomes) > self._size:
            self._outcomes.popitem(last=False)
        self.note(operation_id)
        return outcome


S = TypeVar("S")


class LifecycleTable(ABC, Generic[S]):
    """Open operations by id, each in a state ``S``, and the bounded history of the ended
    ones: what the holder's and the coordinator's tables share
    (``actors.holder.states.HolderOperationTable``,
    ``actors.coordinator.operation_table.OperationTable``).
    Each keeps its own moves between states; both close an operation only through
    ``_close``, the one place an outcome is recorded, and refuse a call for an operation
    that is not open in the same order (``refusal``), in their own words."""

    def __init__(self) -> None:
        self._open: dict[str, S] = {}
        self.history = OperationHistory()

    def __bool__(self) -> bool:
        return bool(self._open)

    def __iter__(self) -> Iterator[tuple[str, S]]:
        return iter(list(self._open.items()))

    def get(self, op_id: str) -> S | None:
        """``op_id``'s state (or record) while it is open, else None."""
        return self._open.get(op_id)

    def outcome(self, op_id: str) -> Outcome | None:
        """How ``op_id`` ended, if it is among the last ones that did."""
        return self.history.outcome(op_id)

    def refuse_ended(self, op_id: str, now: float = 0.0) -> None:
        """Refuse a first call for an operation that ended here or is late (its driver
        has started a newer one since). The caller notes it as started
        (``history.note``) once nothing else refuses it."""
        if self.outcome(op_id) is not None or self.history.is_late(op_id):
            raise self.refusal(op_id, now)

    def _close(self, op_id: str, outcome: Outcome, replace: bool = False) -> None:
        """End ``op_id`` with ``outcome``: the one place an outcome is recorded (the
        first one stands unless ``replace``)."""
        self._open.pop(op_id, None)
        self.history.record(op_id, outcome, replace=replace)

    def refusal(self, op_id: str, now: float = 0.0) -> Exception:
        """Why a call for ``op_id``, which is not open in the state the call needs, is
        refused: its recorded outcome, or that it is late, or what else is going on."""
        outcome = self.outcome(op_id)
        if outcome is Outcome.LAPSED:
            return LeaseExpiredError(self._lapsed(op_id))
        if outcome is Outcome.ABORTED:
            return OperationAbortedError(self._aborted(op_id))
        if outcome is Outcome.COMMITTED:
            return StaleSnapshotError(f"{self._who}{op_id} already committed")
        if self.history.is_late(op_id):
            return StaleSnapshotError(
                f"{self._who}{op_id} is late: its driver has started a newer operation "
                f"since{self._late_advice}")
        return self._unknown(op_id, now)

    # --- each side's words ---------------------------------------------------------------

    _who = ""  # how a refusal names the participant, e.g. "holder-0: "
    _late_advice = ""

    @abstractmethod
    def _lapsed(self, op_id: str) -> str:
        """The words of a lapsed operation's refusal."""

    @abstractmethod
    def _aborted(self, op_id: str) -> str:
        """The words of an aborted operation's refusal."""

    @abstractmethod
    def _unknown(self, op_id: str, now: float) -> Exception:
        """The refusal of an operation this table has no outcome of."""
