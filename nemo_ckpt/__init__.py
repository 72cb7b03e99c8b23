"""nemo-ckpt: turn-level recovery for asynchronous multi-turn RL on Ray.

The driver constructs ``RayEnvironmentCheckpoint`` and uses it through the
``EnvironmentCheckpoint`` contract; environment workers use ``SessionClient``.
Snapshots on disk are listed, found, kept and removed with ``list_snapshots``,
``latest_snapshot``, ``keep_last`` and ``remove_snapshot``, and looked into with
``inspect_snapshot``, ``verify_snapshot`` and ``diff_snapshots`` (no Ray needed; the
``nemo-ckpt`` command line renders the same results). On an event loop, their
``_async`` forms (``list_snapshots_async``, ...) run the same work in a worker thread;
the long ones report ``CatalogProgress`` to a ``progress`` callback.
``RolloutCheckpointManager`` takes snapshots on an interval and at trainer checkpoints,
keeps the newest, and restores one under a checked configuration fingerprint, returning
a ``RestoreHandover``; its ``preemption()`` (a ``Preemption``) turns SIGTERM, SIGINT or a
node's drain into a final snapshot within the grace period (anchored to the trainer
checkpoint ``save_trainer_checkpoint`` saves, a ``TrainerCheckpoint``) and an exit.
``RlFiles`` writes and reads RL's own files in a checkpoint path, folder or bucket.
"""

from nemo_ckpt.catalog.async_catalog import (
    keep_last_async,
    latest_snapshot_async,
    list_snapshots_async,
    remove_snapshot_async,
    verify_snapshot_async,
)
from nemo_ckpt.catalog.listing import (
    LatestSnapshot,
    RemovalReport,
    RetentionReport,
    SkippedSnapshot,
    SnapshotInfo,
    keep_last,
    latest_snapshot,
    list_snapshots,
    remove_snapshot,
)
from nemo_ckpt.catalog.snapshot_diff import SnapshotDiff, diff_snapshots
from nemo_ckpt.catalog.summary import SnapshotSummary, inspect_snapshot
from nemo_ckpt.catalog.verification import VerifyReport, verify_snapshot
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.cut import DataPlaneMutationCut
from nemo_ckpt.driver import RayEnvironmentCheckpoint, RaySnapshot
from nemo_ckpt.driver.preemption import Preemption
from nemo_ckpt.interfaces import (
    EnvironmentCheckpoint,
    EnvironmentEpisode,
    EnvironmentSnapshot,
    NoEnvironmentCheckpoint,
    RestoredEnvironmentRollouts,
)
from nemo_ckpt.manager.config import RolloutCheckpointConfig
from nemo_ckpt.manager.contract import ManagedSnapshot, RlHalf
from nemo_ckpt.manager.handover import ContinuedRollout, RestartedRollout, RestoreHandover
from nemo_ckpt.manager.rl_files import RlFiles
from nemo_ckpt.manager.rollout_manager import RolloutCheckpointManager
from nemo_ckpt.manager.stop_anchor import TrainerCheckpoint
from nemo_ckpt.progress import CatalogProgress, ProgressCallback
from nemo_ckpt.sandbox_backend import ContainerRef
from nemo_ckpt.session_record import EnvironmentClass, SessionHead, SessionRecord
from nemo_ckpt.sessions import SessionClient, Turn
from nemo_ckpt.trees.collection import CollectionReport, collect_blobs

__all__ = [
    "CatalogProgress",
    "CheckpointConfig",
    "CollectionReport",
    "ContainerRef",
    "ContinuedRollout",
    "DataPlaneMutationCut",
    "EnvironmentCheckpoint",
    "EnvironmentClass",
    "EnvironmentEpisode",
    "EnvironmentSnapshot",
    "LatestSnapshot",
    "ManagedSnapshot",
    "NoEnvironmentCheckpoint",
    "ProgressCallback",
    "RayEnvironmentCheckpoint",
    "RaySnapshot",
    "RemovalReport",
    "RestartedRollout",
    "RestoredEnvironmentRollouts",
    "RestoreHandover",
    "RetentionReport",
    "RlFiles",
    "RlHalf",
    "RolloutCheckpointConfig",
    "RolloutCheckpointManager",
    "Preemption",
    "SessionClient",
    "SessionHead",
    "SessionRecord",
    "SkippedSnapshot",
    "SnapshotDiff",
    "SnapshotInfo",
    "SnapshotSummary",
    "TrainerCheckpoint",
    "Turn",
    "VerifyReport",
    "collect_blobs",
    "diff_snapshots",
    "inspect_snapshot",
    "keep_last",
    "keep_last_async",
    "latest_snapshot",
    "latest_snapshot_async",
    "list_snapshots",
    "list_snapshots_async",
    "remove_snapshot",
    "remove_snapshot_async",
    "verify_snapshot",
    "verify_snapshot_async",
]
