"""A stop's trainer checkpoint: the job's ``save_trainer_checkpoint`` hook, run by the
manager's final snapshot inside its barrier section (RL's data plane frozen, the
environment paused), held to its share of the stop's deadline, so that the final
snapshot is anchored to the trainer step it saved and ``restore_mode=
"trainer_checkpoint"`` restores trainer and rollouts in step.

Where no trainer checkpoint is saved in time (no hook, a hook that raises, returns
something else than a step, or runs past its budget) the final snapshot commits all the
same, anchored to nothing, its record saying why: never anchored to a step whose trainer
checkpoint may be missing or torn (fail closed). A restore by trainer step then takes
the snapshot anchored to the newest trainer checkpoint saved, and says what it drops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["SaveTrainerCheckpoint", "StopAnchor", "StopPlan", "TrainerCheckpoint",
           "anchor_at_stop", "hook_budget_s"]

log = logging.getLogger("nemo_ckpt")

# Of a final snapshot's seconds, the share by whose end the hook must have returned:
# the rest is the record's write and the environment's stop commit.
_HOOK_SHARE = 0.75


@dataclass(frozen=True)
class TrainerCheckpoint:
    """What ``save_trainer_checkpoint`` returns: the trainer step it saved (durable when
    it returns), and where (for people and logs; optional)."""

    step: int
    path: str | None = None


# Given the seconds it may use, saves the trainer's checkpoint and returns its step (an
# int, or a TrainerCheckpoint naming where too). It runs inside RL's barrier section:
# it must not wait for a mutation of RL's data plane.
SaveTrainerCheckpoint = Callable[[float], Awaitable["TrainerCheckpoint | int"]]


@dataclass(frozen=True)
class StopAnchor:
    """What a stop's hook gave: the step and path to anchor to, or why there is none."""

    step: int | None
    path: str | None
    unanchored_why: str | None


def hook_budget_s(within_s: float, started: float, now: float) -> float:
    """The seconds left to the hook of a final snapshot given ``within_s`` from
    ``started`` (both on one monotonic clock), at ``now``."""
    return started + within_s * _HOOK_SHARE - now


async def anchor_at_stop(hook: SaveTrainerCheckpoint | None, budget_s: float
                         ) -> StopAnchor:
    """Run ``hook`` within ``budget_s``; what to anchor the final snapshot to. Never
    raises for the hook's sake: every way it fails is an unanchored ``StopAnchor`` and
    one error line saying what the restore will do."""
    if hook is None:
        return StopAnchor(None, None, "no save_trainer_checkpoint was given to the manager")
    if budget_s <= 0:
        why = (f"save_trainer_checkpoint was not called: the final snapshot's share for it "
               f"had passed ({-budget_s:.3g}s ago) before RL's half was saved")
        return _unanchored(why)
    try:
        saved = await asyncio.wait_for(hook(budget_s), timeout=budget_s)
    except asyncio.TimeoutError:
        return _unanchored(f"save_trainer_checkpoint did not return within its "
                           f"{budget_s:.3g}s (cancelled; a checkpoint it began is not "
                           f"anchored)")
    except Exception as exc:  # the job's code: any failure is the same refusal
        first = str(exc).splitlines()[0] if str(exc) else ""
        return _unanchored(f"save_trainer_checkpoint raised {type(exc).__name__}: {first}")
    if isinstance(saved, int) and not isinstance(saved, bool):
        saved = TrainerCheckpoint(saved)
    if not isinstance(saved, TrainerCheckpoint) or isinstance(saved.step, bool) \
            or not isinstance(saved.step, int) or saved.step < 0:
        return _unanchored(f"save_trainer_checkpoint returned {saved!r:.200}, not the "
                           f"trainer step it saved (an int >= 0, or a TrainerCheckpoint)")
    # The record bounds what it keeps (4096 characters): a path is for people.
    return StopAnchor(saved.step, None if saved.path is None else str(saved.path)[:4096],
                      None)


def _unanchored(why: str) -> StopAnchor:
    why = why[:2000]  # an exception's first line may be long; the record keeps 4096
    log.error("final snapshot: no trainer checkpoint anchors it: %s. It commits all the "
              "same; restore_mode='trainer_checkpoint' restores the snapshot anchored to "
              "the newest trainer checkpoint saved, and drops this one's rollouts", why)
    return StopAnchor(None, None, why)


@dataclass(frozen=True)
class StopPlan:
    """A final snapshot's terms: the drain's seconds, its own ``within_s`` from
    ``started`` (the loop's clock), and the hook that saves the trainer's checkpoint."""

    drain_s: float
    within_s: float
    started: float
    hook: SaveTrainerCheckpoint | None
