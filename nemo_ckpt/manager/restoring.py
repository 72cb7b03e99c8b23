"""What a manager's restore takes and hands over: the snapshot chosen by
``restore_mode`` (``choose``), the newer ones it passes over said in one line
(``passed_over_line``), and the ``RestoreHandover`` made from what the environment
restored, RL's plan and the snapshot's index (``hand_over``, pure)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from nemo_ckpt.catalog.verification import verify_snapshot
from nemo_ckpt.errors import SnapshotNotFoundError
from nemo_ckpt.interfaces import RestoredEnvironmentRollouts
from nemo_ckpt.manager.contract import ManagedSnapshot, RlPlan
from nemo_ckpt.manager.handover import (
    ContinuedRollout,
    RestartedRollout,
    RestartReason,
    RestoreHandover,
)
from nemo_ckpt.storage.shards import RolloutIndexEntry

__all__ = ["choose", "hand_over", "passed_over_line"]

log = logging.getLogger("nemo_ckpt")


def choose(found: list[ManagedSnapshot], mode: str, trainer_step: int | None, root: str
           ) -> ManagedSnapshot | None:
    """Of ``found`` (newest first), the snapshot a restore in ``mode`` takes: the newest
    that verifies (``latest``; None when none does), or the newest anchored to
    ``trainer_step`` (``trainer_checkpoint``), which must verify."""
    if mode == "trainer_checkpoint":
        if trainer_step is None:
            raise ValueError("restore_mode='trainer_checkpoint' restores the snapshot "
                             "anchored to the trainer step being restored: pass "
                             "restore(trainer_step=...)")
        anchored = [s for s in found if s.anchor_step == trainer_step]
        if not anchored:
            steps = sorted({s.anchor_step for s in found if s.anchor_step is not None})
            raise SnapshotNotFoundError(
                root, f"no rollout snapshot under {root} is anchored to trainer step "
                      f"{trainer_step} (anchored steps: {steps or 'none'}){_stop_said(found)}"
                      f"; restore another trainer checkpoint, or use restore_mode='latest'")
        report = verify_snapshot(anchored[0].path)
        if not report.ok:
            raise SnapshotNotFoundError(
                anchored[0].path, f"the rollout snapshot anchored to trainer step "
                                  f"{trainer_step}, {anchored[0].path}, does not verify: "
                                  f"{'; '.join(report.problems[:3])}")
        return anchored[0]
    for snap in found:
        report = verify_snapshot(snap.path)
        if report.ok:
            return snap
        log.warning("rollout snapshot %s does not verify (%s); trying an older one",
                    snap.path, "; ".join(report.problems[:3]))
    return None


def _stop_said(found: list[ManagedSnapshot]) -> str:
    """What the newest stop's final snapshot says of its anchor, if it has none."""
    final = next((s for s in found if s.final), None)
    if final is None or final.unanchored_why is None:
        return ""
    return (f"; the stop's final snapshot {Path(final.path).name} is anchored to no "
            f"trainer step: {final.unanchored_why}")


def passed_over_line(chosen: ManagedSnapshot, newer: Iterable[ManagedSnapshot]
                     ) -> str | None:
    """One line naming the newer snapshots a restore of ``chosen`` passes over (what it
    drops), or None when there are none."""
    named = []
    for snap in newer:
        if snap.final:
            kind = "the stop's final snapshot" + (
                f", anchored to no trainer step: {snap.unanchored_why}"
                if snap.unanchored_why else "")
        elif snap.anchor_step is not None:
            kind = f"anchored to trainer step {snap.anchor_step}"
        else:
            kind = "periodic"
        named.append(f"{Path(snap.path).name} ({kind})")
    if not named:
        return None
    anchor = ("" if chosen.anchor_step is None
              else f", anchored to trainer step {chosen.anchor_step}")
    return (f"restoring {chosen.path}{anchor}: {len(named)} newer rollout snapshot(s) are "
            f"not restored, and the rollouts' progress they hold is dropped: "
            f"{'; '.join(named)}")


def hand_over(chosen: ManagedSnapshot, restored: RestoredEnvironmentRollouts,
              plan: RlPlan | None, captured: Iterable[RolloutIndexEntry],
              owners: Mapping[str, str] | None, passed_over: tuple[ManagedSnapshot, ...],
              dropped: str | None) -> RestoreHandover:
    """The hand-over of a restore of ``chosen``: the rollouts RL's ``plan`` continues
    (``restored`` as given when RL returned none), with their turns from the snapshot's
    index (``captured``) and their instance by ``owners``; those the plan drops (its
    ``abandoned``: with their group) or finds without an owner; the rows kept."""
    entries = {(e.rollout_id, e.attempt): e for e in captured}
    if plan is None:
        triples = frozenset(restored.continued_attempts)
        kept = frozenset(restored.staging_keys)
        not_continued: frozenset[tuple[str, str, int]] = frozenset()
        vanished: frozenset[tuple[str, str, int]] = frozenset()
        abandoned: frozenset[tuple[str, int]] = frozenset()
    else:
        triples = frozenset(plan.restored_gym_episodes)
        kept = frozenset(plan.keep_staging_keys)
        not_continued = frozenset(getattr(plan, "dropped", ()) or ())
        vanished = frozenset(getattr(plan, "vanished", ()) or ())
        abandoned = frozenset((rid, att) for _, rid, att in
                              getattr(plan, "abandoned", ()) or ())
    continued = []
    for owner, rid, att in sorted(triples):
        entry = entries.get((rid, att))
        instance = owners.get(owner, owner) if owners else owner
        continued.append(ContinuedRollout(rid, att + 1, owner, instance,
                                          entry.turns if entry is not None else 0))
    restarted: dict[tuple[str, int], RestartedRollout] = {}
    for owner, rid, att in sorted(vanished):
        restarted[(rid, att)] = RestartedRollout(rid, att, owner, "owner_gone")
    for instance, rid, att in sorted(not_continued):
        reason: RestartReason = "abandoned_by_rl_group" if (rid, att) in abandoned \
            else "not_continued_by_rl"
        restarted.setdefault((rid, att), RestartedRollout(rid, att, instance, reason))
    return RestoreHandover(chosen, tuple(continued),
                           tuple(sorted(restarted.values(), key=lambda r: r.rollout_id)),
                           kept, passed_over, dropped)
