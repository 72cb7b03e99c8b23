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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Where each public name lives. They load at first use (``__getattr__``, PEP 562): an
# actor's process, which imports a few submodules, then loads none of the driver's,
# the manager's or the catalog's modules it never runs.
_WHERE = {
    'CatalogProgress': 'nemo_ckpt.progress',
    'CheckpointConfig': 'nemo_ckpt.config',
    'collect_blobs': 'nemo_ckpt.trees.collection',
    'CollectionReport': 'nemo_ckpt.trees.collection',
    'ContainerRef': 'nemo_ckpt.sandbox_backend',
    'ContinuedRollout': 'nemo_ckpt.manager.handover',
    'DataPlaneMutationCut': 'nemo_ckpt.cut',
    'diff_snapshots': 'nemo_ckpt.catalog.snapshot_diff',
    'EnvironmentCheckpoint': 'nemo_ckpt.interfaces',
    'EnvironmentClass': 'nemo_ckpt.session_record',
    'EnvironmentEpisode': 'nemo_ckpt.interfaces',
    'EnvironmentSnapshot': 'nemo_ckpt.interfaces',
    'inspect_snapshot': 'nemo_ckpt.catalog.summary',
    'keep_last': 'nemo_ckpt.catalog.listing',
    'keep_last_async': 'nemo_ckpt.catalog.async_catalog',
    'latest_snapshot': 'nemo_ckpt.catalog.listing',
    'latest_snapshot_async': 'nemo_ckpt.catalog.async_catalog',
    'LatestSnapshot': 'nemo_ckpt.catalog.listing',
    'list_snapshots': 'nemo_ckpt.catalog.listing',
    'list_snapshots_async': 'nemo_ckpt.catalog.async_catalog',
    'ManagedSnapshot': 'nemo_ckpt.manager.contract',
    'NoEnvironmentCheckpoint': 'nemo_ckpt.interfaces',
    'Preemption': 'nemo_ckpt.driver.preemption',
    'ProgressCallback': 'nemo_ckpt.progress',
    'RayEnvironmentCheckpoint': 'nemo_ckpt.driver',
    'RaySnapshot': 'nemo_ckpt.driver',
    'RemovalReport': 'nemo_ckpt.catalog.listing',
    'remove_snapshot': 'nemo_ckpt.catalog.listing',
    'remove_snapshot_async': 'nemo_ckpt.catalog.async_catalog',
    'RestartedRollout': 'nemo_ckpt.manager.handover',
    'RestoredEnvironmentRollouts': 'nemo_ckpt.interfaces',
    'RestoreHandover': 'nemo_ckpt.manager.handover',
    'RetentionReport': 'nemo_ckpt.catalog.listing',
    'RlFiles': 'nemo_ckpt.manager.rl_files',
    'RlHalf': 'nemo_ckpt.manager.contract',
    'RolloutCheckpointConfig': 'nemo_ckpt.manager.config',
    'RolloutCheckpointManager': 'nemo_ckpt.manager.rollout_manager',
    'SessionClient': 'nemo_ckpt.sessions',
    'SessionHead': 'nemo_ckpt.session_record',
    'SessionRecord': 'nemo_ckpt.session_record',
    'SkippedSnapshot': 'nemo_ckpt.catalog.listing',
    'SnapshotDiff': 'nemo_ckpt.catalog.snapshot_diff',
    'SnapshotInfo': 'nemo_ckpt.catalog.listing',
    'SnapshotSummary': 'nemo_ckpt.catalog.summary',
    'TrainerCheckpoint': 'nemo_ckpt.manager.stop_anchor',
    'Turn': 'nemo_ckpt.sessions',
    'verify_snapshot': 'nemo_ckpt.catalog.verification',
    'verify_snapshot_async': 'nemo_ckpt.catalog.async_catalog',
    'VerifyReport': 'nemo_ckpt.catalog.verification',
}

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


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
