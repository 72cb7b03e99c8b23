"""Test doubles that behave like the real thing, for tests, examples and users' own
integration tests. Importing this package imports no Ray: the Ray actor classes
(``DataPlaneActor``, ``ToyEnvWorkerActor``) are made on first use.

- a reference data plane (``ReferenceDataPlane``, as a Ray actor ``DataPlaneActor``)
  with a barrier (``DataPlaneBarrier.checkpoint()`` yields a live ``LiveCut``), its
  own save and restore, and ``StaticCut`` for a fixed cut;
- NeMo RL's recovery ledger, barrier, cut and staging partition, with NeMo RL's names
  (``nemo_ckpt.testing.nemo_rl``; imported from there, so its names stay apart from the
  reference data plane's), and ``NemoRlState``, RL's half for the rollout manager;
- a deterministic toy multi-turn environment (``toy_env``) and its worker actor;
- virtual time (``virtual_time``: an event loop whose clock jumps to the next timer), on
  which the simulation's in-process world (``actors.sim``) and unit tests run.

The end-to-end recovery run behind ``make demo`` is ``examples/recovery_demo.py``; the
local S3-compatible server for object-store tests is ``tests/s3_server.py``.
"""

from typing import Any

from nemo_ckpt.testing.data_plane import (
    DATA_PLANE_FILE,
    CutInProgressError,
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
    data_plane_actor_class,
    read_data_plane_file,
    read_trajectory_result,
    start_data_plane,
    trajectory_result,
)
from nemo_ckpt.testing.toy_env import (
    RolloutOutcome,
    RolloutTask,
    ToyEnvWorker,
    ToyState,
    initial_state,
    ordered_staging_keys,
    reference_trajectory,
    staging_key,
    start_env_workers,
    step,
    toy_env_worker_actor_class,
)

__all__ = [
    "DATA_PLANE_FILE",
    "CutInProgressError",
    "DataPlaneBarrier",
    "DataPlaneBusyError",
    "DataPlaneFile",
    "DataPlaneFileError",
    "DataPlaneRestoreError",
    "DataPlaneRestoreReport",
    "DataPlaneStats",
    "LedgerError",
    "LedgerRow",
    "LiveCut",
    "ReferenceDataPlane",
    "RolloutOutcome",
    "RolloutStatus",
    "RolloutTask",
    "StaticCut",
    "ToyEnvWorker",
    "ToyState",
    "Trajectory",
    "initial_state",
    "ordered_staging_keys",
    "data_plane_actor_class",
    "read_data_plane_file",
    "read_trajectory_result",
    "reference_trajectory",
    "staging_key",
    "start_data_plane",
    "start_env_workers",
    "step",
    "toy_env_worker_actor_class",
    "trajectory_result",
]


def __getattr__(name: str) -> Any:
    # The Ray actor classes, made (and Ray imported) only when asked for.
    if name == "DataPlaneActor":
        return data_plane_actor_class()
    if name == "ToyEnvWorkerActor":
        return toy_env_worker_actor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
