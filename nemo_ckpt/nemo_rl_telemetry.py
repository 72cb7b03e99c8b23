"""NeMo RL's names for the figures of a snapshot and a restore, beside ours.

NeMo RL's controller logs its checkpoint telemetry through its experiment logger (W&B,
TensorBoard, MLflow), not as metrics a process exports: ``Logger.log_metrics(figures,
step, prefix)`` names each ``<prefix>/<name>``, on the wall-time axis
``telemetry/wall_time_seconds`` (NVIDIA-NeMo/RL, ``nemo_rl/algorithms/single_controller.py``
and ``nemo_rl/utils/logger.py``; docs/METRICS.md, "NeMo RL's names", says which stored
revision). So these names belong with the driver's figures, not with the actors'
Prometheus metrics: ``nemo_rl_snapshot_figures(snap.metrics(...))`` and
``nemo_rl_restore_figures(ckpt.last_restore_metrics)`` return the figures as they were,
and beside them, under NeMo RL's full names, those of ours that mean what NeMo RL's do;
log the result with NeMo RL's ``Logger`` (no prefix: the names carry theirs).

Our side of a snapshot is the environment's: the holders' turn gate is its barrier (new
turns wait, turns in flight drain), as NeMo RL's data-plane barrier holds mutations back.
NeMo RL's controller logs these names for its own data-plane cut; a job whose controller
is NeMo RL's own reads ours under our names, a job with a driver of its own (the
examples) fills a NeMo RL dashboard's panels with these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["NemoRlName", "SNAPSHOT_NAMES", "RESTORE_NAMES", "WALL_TIME_AXIS",
           "nemo_rl_snapshot_figures", "nemo_rl_restore_figures"]

Figures = Mapping[str, float | int]

# The step metric of NeMo RL's telemetry panels (its Logger leaves it unprefixed).
WALL_TIME_AXIS = "telemetry/wall_time_seconds"


@dataclass(frozen=True)
class NemoRlName:
    """One NeMo RL name, and how our figures give it.

    Attributes:
        name: As a NeMo RL dashboard finds it (``<prefix>/<name>``).
        ours: Our figure it is made from, as docs/METRICS.md's table says.
        value: The value from our figures; None while they do not tell it yet.
    """

    name: str
    ours: str
    value: Callable[[Figures], float | None]


def _figure(key: str) -> Callable[[Figures], float | None]:
    return lambda figures: None if key not in figures else float(figures[key])


def _exclusive_hold(figures: Figures) -> float | None:
    # The pause after the drain: the gate held new turns back with none in flight.
    if "holders_paused_seconds" not in figures:
        return None  # known once the snapshot's block has exited
    paused = float(figures["holders_paused_seconds"])
    return max(0.0, paused - float(figures.get("drain_seconds", 0.0)))


SNAPSHOT_NAMES = (
    NemoRlName("timing/rollout_checkpoint/barrier_wait_seconds", "drain_seconds",
               _figure("drain_seconds")),
    NemoRlName("timing/rollout_checkpoint/exclusive_hold_seconds",
               "holders_paused_seconds - drain_seconds", _exclusive_hold),
    NemoRlName("timing/rollout_checkpoint/total_save_seconds", "snapshot_seconds",
               _figure("snapshot_seconds")),
)
RESTORE_NAMES = (
    NemoRlName("timing/rollout_recovery/recovery_prepare_seconds", "restore_seconds",
               _figure("restore_seconds")),
)


def _beside(figures: Figures, names: tuple[NemoRlName, ...]) -> dict[str, float | int]:
    out: dict[str, float | int] = dict(figures)
    for alias in names:
        value = alias.value(figures)
        if value is not None:
            out[alias.name] = value
    return out


def nemo_rl_snapshot_figures(figures: Figures) -> dict[str, float | int]:
    """A snapshot's ``metrics(...)``, with NeMo RL's names beside ours (a name whose
    figure is not known yet, inside the snapshot's block, is left out)."""
    return _beside(figures, SNAPSHOT_NAMES)


def nemo_rl_restore_figures(figures: Figures | None) -> dict[str, float | int]:
    """``last_restore_metrics``, with NeMo RL's names beside ours (empty for None: no
    restore went live)."""
    return {} if figures is None else _beside(figures, RESTORE_NAMES)
