"""``RolloutCheckpointConfig``: what NeMo RL's ``RolloutCheckpointConfig`` sets, for
``RolloutCheckpointManager``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DEFAULT_ALLOWED_CHANGES", "RolloutCheckpointConfig"]

# A restore onto another cluster shape is a feature (the restore plan places sessions),
# so the instance ids, and the owners mapped to them, may change unless the caller says
# otherwise (a rollout whose owner no longer maps to its instance starts over).
DEFAULT_ALLOWED_CHANGES = frozenset({"instance_ids", "owners"})


class RolloutCheckpointConfig(BaseModel):
    """How a ``RolloutCheckpointManager`` snapshots, keeps and restores.

    Attributes:
        root: The checkpoint root (``CheckpointConfig.checkpoint_root``): each snapshot
            is a folder below it, named by the manager.
        snapshot_attempt_interval_s: Seconds between two periodic snapshots
            (``maybe_snapshot``), on the driver's monotonic clock.
        keep_latest_k: Committed snapshots kept, newest first by commit number; the one
            the newest trainer checkpoint anchors is kept besides.
        restore_mode: ``latest`` restores the newest snapshot that verifies;
            ``trainer_checkpoint`` the one anchored to the trainer step being restored.
        max_consecutive_failures: Transient failures in a row after which a snapshot
            raises ``RolloutCheckpointFailedError`` (each is retried at the next interval).
        allow_changed: Fingerprint fields that may differ at a restore.
        snapshot_timeout_s: The caller's deadline of each snapshot's pause, passed to a
            checkpoint that takes one (``NemoRlEnvironmentCheckpoint``); None for none.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str = Field(min_length=1)
    snapshot_attempt_interval_s: float = Field(gt=0)
    keep_latest_k: int = Field(ge=1)
    restore_mode: Literal["latest", "trainer_checkpoint"] = "latest"
    max_consecutive_failures: int = Field(default=3, ge=1)
    allow_changed: frozenset[str] = DEFAULT_ALLOWED_CHANGES
    snapshot_timeout_s: float | None = Field(default=None, gt=0)
