"""Turn-level recovery for environments written for another framework, with no change
to their code: an adapter runs an environment's ``init`` and each ``step`` as turns of a
session and records the action and what the step returned; after a restore it rebuilds
a continued rollout's environment by constructing it afresh and replaying the recorded
actions (checked step by step), or, for an environment that offers the state export,
from its exported state.

The framework-neutral part: ``nemo_ckpt.adapters.framework`` (what an adapter for a
framework provides), ``nemo_ckpt.adapters.step_output`` (a step's output as pure data),
``nemo_ckpt.adapters.turn_records`` (the turn record), ``nemo_ckpt.adapters.replay``
(replay with equality checks),
``nemo_ckpt.adapters.state_export`` (the state-export protocol) and
``nemo_ckpt.adapters.rollout`` (``AdaptedRollout``, a rollout driven through
``SessionClient``). One module per framework: ``nemo_ckpt.adapters.skyrl_gym``, which
imports SkyRL-gym only when used (``pip install nemo-ckpt[skyrl]``).
"""

from __future__ import annotations

from nemo_ckpt.adapters.framework import Framework
from nemo_ckpt.adapters.replay import Divergence
from nemo_ckpt.adapters.rollout import AdaptedRollout, Staging, trajectory_of
from nemo_ckpt.adapters.state_export import StateExport, offers_state_export
from nemo_ckpt.adapters.step_output import StepOutput
from nemo_ckpt.adapters.turn_records import TurnRecord

__all__ = ["AdaptedRollout", "Divergence", "Framework", "Staging", "StateExport",
           "StepOutput", "TurnRecord", "offers_state_export", "trajectory_of"]
