"""nemo-ckpt: turn-level recovery for asynchronous multi-turn RL on Ray.

The driver constructs ``RayEnvironmentCheckpoint`` and uses it through the
``EnvironmentCheckpoint`` contract; environment workers use ``SessionClient``.
"""

from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.cut import DataPlaneMutationCut
from nemo_ckpt.interfaces import (
    EnvironmentCheckpoint,
    EnvironmentEpisode,
    EnvironmentSnapshot,
    NoEnvironmentCheckpoint,
    RestoredEnvironmentRollouts,
)
from nemo_ckpt.ray_checkpoint import RayEnvironmentCheckpoint, RaySnapshot
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.sessions import SessionClient, Turn

__all__ = [
    "CheckpointConfig",
    "DataPlaneMutationCut",
    "EnvironmentCheckpoint",
    "EnvironmentEpisode",
    "EnvironmentSnapshot",
    "NoEnvironmentCheckpoint",
    "RayEnvironmentCheckpoint",
    "RaySnapshot",
    "RestoredEnvironmentRollouts",
    "SessionClient",
    "SessionRecord",
    "Turn",
]
