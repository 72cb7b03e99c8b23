"""The manager's contract with RL: ``RlHalf``, what RL's half of each snapshot
implements (the call order: ``nemo_ckpt.interfaces``; ``save`` runs inside its barrier
section; ``restore`` may return what RL's ledger made of the hand-over, ``RlPlan``), and
``ManagedSnapshot``, what the manager says of a snapshot it took."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from nemo_ckpt.interfaces import RestoredEnvironmentRollouts

__all__ = ["ManagedSnapshot", "RlHalf", "RlPlan"]


@dataclass(frozen=True)
class ManagedSnapshot:
    """One committed snapshot the manager took.

    Attributes:
        number: Its commit number under the root (newer is higher).
        path: Its checkpoint path.
        anchor_step: The trainer step it anchors to; None for a periodic one.
        created_at: When it committed (the committing host's clock: for people).
        final: Taken at a stop (``final_snapshot``, a preemption's).
        trainer_checkpoint: A final snapshot's trainer checkpoint, as the job's
            ``save_trainer_checkpoint`` named it (for people); None otherwise.
        unanchored_why: Why a final snapshot is not anchored to a trainer step (no
            ``save_trainer_checkpoint``, it raised, or it ran past its budget); None
            for an anchored one and for every periodic one.
    """

    number: int | None
    path: str
    anchor_step: int | None
    created_at: datetime | None
    final: bool = False
    trainer_checkpoint: str | None = None
    unanchored_why: str | None = None


class RlPlan(Protocol):
    """What RL's ledger made of a restore's hand-over, as ``RlHalf.restore`` may return
    it (``nemo_ckpt.integrations.nemo_rl.RestartPlan`` is one); the manager's
    ``RestoreHandover`` is made from it. ``dropped`` (``(instance_id, rollout_id,
    attempt)``), ``vanished`` and ``abandoned`` (``(owner_id, rollout_id, attempt)``) are
    read when the plan has them."""

    @property
    def restored_gym_episodes(self) -> frozenset[tuple[str, str, int]]:
        """``(owner_id, rollout_id, attempt)`` RL's ledger continues (the captured
        attempt; the session continues as the next)."""
        ...

    @property
    def keep_staging_keys(self) -> frozenset[str]:
        """The staging rows RL keeps."""
        ...


class RlHalf(Protocol):
    """RL's half of each rollout snapshot, as the manager drives it."""

    async def save(self, cut: Any, path: str) -> None:
        """Save RL's data plane at ``cut`` under ``path`` (inside the barrier section)."""
        ...

    async def restore(self, path: str, restored: RestoredEnvironmentRollouts
                      ) -> RlPlan | None:
        """Restore RL's data plane from ``path`` (inside ``restored()``'s block). Return
        the plan RL's ledger made of ``restored`` (under NeMo RL, what
        ``prepare_for_restart`` returned), or None when RL continues ``restored`` as
        given: the manager's ``RestoreHandover`` is made from it."""
        ...

    async def remove(self, path: str) -> None:
        """Remove RL's half under ``path`` (retention); nothing there is no error."""
        ...
