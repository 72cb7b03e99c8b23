"""``RestoreHandover``: what ``RolloutCheckpointManager.restore`` hands the job, as plain
data (pure: no I/O, nothing of the manager's). The rollouts that continue (with the
episode a worker takes its next turn on, its owner and instance, the turns restored),
those that start over and why, the staging rows kept, and the newer snapshots the
restore passed over (what it dropped), so that a job never walks RL's ledger to learn
them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.manager.contract import ManagedSnapshot

__all__ = ["RESTART_REASONS", "ContinuedRollout", "RestartReason", "RestartedRollout",
           "RestoreHandover"]

RestartReason = Literal["not_continued_by_rl", "abandoned_by_rl_group", "owner_gone"]

# Each reason a rollout starts over, in words a log line uses.
RESTART_REASONS: dict[RestartReason, str] = {
    "not_continued_by_rl": "captured, but RL's ledger does not continue it on its "
                           "instance (a group RL does not restore turn by turn, a sealed "
                           "or dropped attempt, or its owner now maps to another "
                           "instance)",
    "abandoned_by_rl_group": "captured, but RL's ledger abandons its whole group at the "
                             "restore (PROMPT_GROUP granularity): the group starts over "
                             "and this session was retired",
    "owner_gone": "RL's ledger gives it to an owner this job no longer has (owners=)",
}


@dataclass(frozen=True)
class ContinuedRollout:
    """A rollout the restore continues.

    Attributes:
        rollout_id: Its base id.
        attempt: The attempt its session continues as (the captured one plus one): the
            worker takes its next turn on ``episode``.
        owner: RL's owner id of it (NeMo RL's Gym replica); the instance id where RL
            names no owners.
        instance_id: The instance (holder) that keeps its session now.
        turns: The turns it had committed when it was captured: restored.
    """

    rollout_id: str
    attempt: int
    owner: str
    instance_id: str
    turns: int

    @property
    def episode(self) -> EnvironmentEpisode:
        """The attempt to take the next turn on."""
        return EnvironmentEpisode(self.rollout_id, self.attempt)


@dataclass(frozen=True)
class RestartedRollout:
    """A rollout the snapshot names that does not continue: RL starts it over.

    Attributes:
        rollout_id: Its base id.
        attempt: The attempt the snapshot held (captured, or in RL's ledger).
        where: The instance that captured it, or RL's owner id for ``owner_gone``.
        reason: Why (``RESTART_REASONS``).
    """

    rollout_id: str
    attempt: int
    where: str
    reason: RestartReason

    @property
    def why(self) -> str:
        return RESTART_REASONS[self.reason]


@dataclass(frozen=True)
class RestoreHandover:
    """What a restore handed over.

    Attributes:
        snapshot: The snapshot restored.
        continued: The rollouts that continue, by rollout id.
        restarted: The rollouts that start over, with why, by rollout id.
        kept_staging_keys: The staging rows RL keeps (every other row is RL's to clear).
        passed_over: The managed snapshots newer than ``snapshot`` that were not
            restored, newest first: what they held since is dropped (under
            ``restore_mode="trainer_checkpoint"``, the rollouts after the trainer step).
        dropped: One line naming them (None when none was passed over).
    """

    snapshot: ManagedSnapshot
    continued: tuple[ContinuedRollout, ...] = ()
    restarted: tuple[RestartedRollout, ...] = ()
    kept_staging_keys: frozenset[str] = frozenset()
    passed_over: tuple[ManagedSnapshot, ...] = ()
    dropped: str | None = None

    @property
    def path(self) -> str:
        """The restored snapshot's path."""
        return self.snapshot.path

    @property
    def anchor_step(self) -> int | None:
        """The trainer step the restored snapshot anchors to (None: not anchored)."""
        return self.snapshot.anchor_step

    def continued_by_id(self) -> dict[str, ContinuedRollout]:
        """``continued`` by rollout id."""
        return {c.rollout_id: c for c in self.continued}
