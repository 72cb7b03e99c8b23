"""The manager's contract with RL: ``RlHalf``, what RL's half of each snapshot
implements (the call order: ``nemo_ckpt.interfaces``; ``save`` runs inside its barrier
section), and ``ManagedSnapshot``, what the manager says of a snapshot it took."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from nemo_ckpt.interfaces import RestoredEnvironmentRollouts

__all__ = ["ManagedSnapshot", "RlHalf"]


@dataclass(frozen=True)
class ManagedSnapshot:
    """One committed snapshot the manager took.

    Attributes:
        number: Its commit number under the root (newer is higher).
        path: Its checkpoint path.
        anchor_step: The trainer step it anchors to; None for a periodic one.
        created_at: When it committed (the committing host's clock: for people).
    """

    number: int | None
    path: str
    anchor_step: int | None
    created_at: datetime | None


class RlHalf(Protocol):
    """RL's half of each rollout snapshot, as the manager drives it."""

    async def save(self, cut: Any, path: str) -> None:
        """Save RL's data plane at ``cut`` under ``path`` (inside the barrier section)."""
        ...

    async def restore(self, path: str, restored: RestoredEnvironmentRollouts) -> None:
        """Restore RL's data plane from ``path`` (inside ``restored()``'s block)."""
        ...

    async def remove(self, path: str) -> None:
        """Remove RL's half under ``path`` (retention); nothing there is no error."""
        ...
