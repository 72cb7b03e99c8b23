"""``RaySnapshot``: the backend's half of one snapshot as the driver holds it while the
caller's block runs (``EnvironmentSnapshot``): the captures aggregated over every holder,
the check against RL's cut, and the snapshot's figures."""

from __future__ import annotations

import logging
from typing import Any

from nemo_ckpt.cut import CutCheckResult, DataPlaneMutationCut, check_rows_against_cut
from nemo_ckpt.interfaces import EnvironmentEpisode

__all__ = ["RaySnapshot"]

log = logging.getLogger("nemo_ckpt")


class RaySnapshot:
    """The backend's half of one snapshot, as aggregated over every holder.

    Implements ``EnvironmentSnapshot``. Its figures grow as the snapshot proceeds:
    persist seconds and bytes written are known once the context has exited.
    """

    def __init__(self, begun: Any) -> None:
        self.snapshot_id: str = begun.snapshot_id
        self._begun = begun
        self.check_result: CutCheckResult | None = None
        # The error of a check that refused this snapshot: it can no longer commit,
        # even if the caller catches the error inside the block.
        self.refused: BaseException | None = None
        self._committed: dict[str, float] = {}
        self._captured: dict[str, dict[EnvironmentEpisode, frozenset[str]]] | None = None

    @property
    def restarted_rollouts(self) -> int:
        """Sessions mid-turn at the drain deadline: not captured, they restart after a crash."""
        return sum(len(c.restarting) for c in self._begun.captures)

    @property
    def captured_rollouts(self) -> int:
        """How many sessions the snapshot holds."""
        return sum(c.captured_count for c in self._begun.captures)

    def captured(self) -> dict[str, dict[EnvironmentEpisode, frozenset[str]]]:
        """Per instance, each captured episode and the staging keys it references."""
        if self._captured is None:  # decoded once, on first use, not on the pause's path
            self._captured = {
                c.instance_id: {EnvironmentEpisode(rid, att): frozenset(keys)
                                for rid, att, keys, _turns in c.captured()}
                for c in self._begun.captures
            }
        return {inst: dict(eps) for inst, eps in self._captured.items()}

    def restarting(self) -> dict[str, frozenset[EnvironmentEpisode]]:
        """Per instance, the episodes held mid-turn at the drain deadline."""
        return {c.instance_id: frozenset(EnvironmentEpisode(r, a) for r, a in c.restarting)
                for c in self._begun.captures}

    async def check_against_cut(self, cut: DataPlaneMutationCut) -> None:
        """Require the capture to match RL's ledger and staging rows at ``cut``.

        Raises ``SnapshotMismatchError`` listing every difference; the snapshot then
        does not commit, even if the caller catches the error: the exit raises it
        again. Expected rollouts the backend does not hold are counted in
        ``metrics()["not_held_rollouts"]`` and logged as a warning: they restart.
        """
        try:
            result = check_rows_against_cut(
                cut, {c.instance_id: c.rows() for c in self._begun.captures},
                {c.instance_id: c.restarting for c in self._begun.captures})
        except BaseException as exc:
            self.refused = exc
            raise
        self.check_result = result
        if result.not_held:
            shown = ", ".join(f"{i}/{ep.capture_key}" for i, ep in sorted(result.not_held)[:10])
            log.warning(
                "snapshot %s: %d rollout(s) RL expects are not held by the environment "
                "(not opened yet, or lost with a node); they restart after a crash: %s%s",
                self.snapshot_id, len(result.not_held), shown,
                " ..." if len(result.not_held) > 10 else "")
        if result.orphan_staging_keys:
            shown = ", ".join(sorted(result.orphan_staging_keys)[:10])
            log.warning(
                "snapshot %s: the cut holds %d staging row(s) that no captured session "
                "references; a restore from this snapshot clears them: %s%s. Outside the "
                "rows of rollouts mid-turn at the drain deadline (%d here), this usually "
                "means RL's data plane leaves a finished rollout's rows in staging: "
                "recording a rollout as finished must move its rows out of staging (the "
                "README's ledger rules)", self.snapshot_id, len(result.orphan_staging_keys),
                shown, " ..." if len(result.orphan_staging_keys) > 10 else "",
                len(result.restarting))

    def metrics(self, paused_seconds: float) -> dict[str, float]:
        """Figures for this snapshot, in seconds, bytes and counts."""
        b = self._begun
        figures = {
            "paused_seconds": float(paused_seconds),
            "entry_seconds": b.entry_seconds,
            "drain_seconds": max((p.drain_seconds for p in b.pauses), default=0.0),
            "capture_seconds": max((c.capture_seconds for c in b.captures), default=0.0),
            "persist_seconds": 0.0,
            "bytes_written": 0.0,
            "captured_rollouts": float(self.captured_rollouts),
            "restarted_rollouts": float(self.restarted_rollouts),
            "holders": float(len(b.instances)),
            "state_bytes": float(sum(c.state_bytes for c in b.captures)),
            # Since each holder started (nemo_ckpt.adapters: a replay that diverged).
            "replay_restarted_rollouts": float(sum(c.replay_restarts for c in b.captures)),
        }
        if self.check_result is not None:
            figures["not_held_rollouts"] = float(len(self.check_result.not_held))
            figures["orphan_staging_rows"] = float(len(self.check_result.orphan_staging_keys))
            figures["finished_rollouts"] = float(len(self.check_result.finished))
        figures.update(self._committed)
        return figures

    def _record_commit(self, manifest_metrics: dict[str, float]) -> None:
        for key in ("persist_seconds", "bytes_written"):
            if key in manifest_metrics:
                self._committed[key] = manifest_metrics[key]
