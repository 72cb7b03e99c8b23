"""``RaySnapshot``: the backend's half of one snapshot as the driver holds it while the
caller's block runs (``EnvironmentSnapshot``): the captures aggregated over every holder,
the check against RL's cut, and the snapshot's figures."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from nemo_ckpt.cut import CutCheckResult, DataPlaneMutationCut, check_rows_against_cut
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.phases import CaptureReport

__all__ = ["HeldBefore", "RaySnapshot"]

log = logging.getLogger("nemo_ckpt")

# A log line names at most this many rollouts.
_SHOWN = 10


class HeldBefore:
    """The rollouts a checkpoint's previous snapshot held, captured or restarting, by
    instance (or that its restore made live): one of them that RL still expects and the
    next snapshot does not hold was lost (with a node or a holder), where any other
    expected rollout not held is one dispatched and not opened yet, a normal queue.

    Kept as the holders' encoded capture rows (bytes per rollout, bounded by what was
    captured) and decoded only when a later snapshot finds rollouts not held."""

    def __init__(self, captures: tuple[CaptureReport, ...] = (),
                 live: frozenset[tuple[str, EnvironmentEpisode]] = frozenset()) -> None:
        self._captures = captures
        self._live = live
        self._held: frozenset[tuple[str, EnvironmentEpisode]] | None = None

    def held(self) -> frozenset[tuple[str, EnvironmentEpisode]]:
        if self._held is None:
            self._held = self._live | frozenset(
                (c.instance_id, EnvironmentEpisode(rid, att))
                for c in self._captures
                for rid, att in [*((r[0], r[1]) for r in c.rows()), *c.restarting])
        return self._held


def _shown(pairs: Iterable[tuple[str, EnvironmentEpisode]]) -> str:
    """Up to ``_SHOWN`` of ``pairs``, sorted, as ``instance/capture_key``."""
    ordered = sorted(pairs)
    return ", ".join(f"{i}/{ep.capture_key}" for i, ep in ordered[:_SHOWN]) \
        + (" ..." if len(ordered) > _SHOWN else "")


class RaySnapshot:
    """The backend's half of one snapshot, as aggregated over every holder.

    Implements ``EnvironmentSnapshot``. Its figures grow as the snapshot proceeds:
    persist seconds and bytes written are known once the context has exited.
    """

    def __init__(self, begun: Any, held_before: HeldBefore | None = None) -> None:
        self.snapshot_id: str = begun.snapshot_id
        self._begun = begun
        self._held_before = held_before
        self.check_result: CutCheckResult | None = None
        # The error of a check that refused this snapshot: it can no longer commit,
        # even if the caller catches the error inside the block.
        self.refused: BaseException | None = None
        self._committed: dict[str, float | int] = {}
        self._holders_paused: float | None = None
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
        ``metrics()["not_held_rollouts"]``: they start over after a crash. Those that
        this checkpoint's previous snapshot held (or its restore made live) were lost,
        with a node or a holder, and are logged as a warning; the others are dispatched
        and not opened yet, a normal queue, logged at DEBUG.
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
            self._log_not_held(result.not_held)
        orphans = result.orphan_staging_keys
        unrecorded = orphans & frozenset(
            k for c in self._begun.captures for k in c.unrecorded_keys)
        if unrecorded:
            log.warning(
                "snapshot %s: the cut holds %d staging row(s) written by turns whose commit "
                "failed recording the session's sandbox (its worker got the error, e.g. a "
                "container podman could not restore after its checkpoint): those turns "
                "never committed, and a restore from this snapshot clears their rows: %s%s",
                self.snapshot_id, len(unrecorded),
                ", ".join(sorted(unrecorded)[:_SHOWN]),
                " ..." if len(unrecorded) > _SHOWN else "")
            orphans = orphans - unrecorded
        if orphans:
            shown = ", ".join(sorted(orphans)[:_SHOWN])
            log.warning(
                "snapshot %s: the cut holds %d staging row(s) that no captured session "
                "references; a restore from this snapshot clears them: %s%s. Outside the "
                "rows of rollouts mid-turn at the drain deadline (%d here), this usually "
                "means RL's data plane leaves a finished rollout's rows in staging: "
                "recording a rollout as finished must move its rows out of staging (the "
                "README's ledger rules)", self.snapshot_id, len(orphans),
                shown, " ..." if len(orphans) > _SHOWN else "",
                len(result.restarting))

    def _log_not_held(self, not_held: frozenset[tuple[str, EnvironmentEpisode]]) -> None:
        lost = not_held & self._held_before.held() if self._held_before else frozenset()
        if lost:
            log.warning(
                "snapshot %s: %d rollout(s) RL expects that were held at this job's "
                "previous snapshot or restore are held no more (lost with a node or a "
                "holder); they start over after a crash: %s", self.snapshot_id, len(lost),
                _shown(lost))
        if queued := not_held - lost:
            log.debug(
                "snapshot %s: %d rollout(s) RL dispatched are not opened yet; they start "
                "over after a crash: %s", self.snapshot_id, len(queued), _shown(queued))

    def held(self) -> HeldBefore:
        """What this snapshot held, for the next one to tell a lost rollout from one
        not opened yet."""
        return HeldBefore(tuple(self._begun.captures))

    def metrics(self, paused_seconds: float) -> dict[str, float | int]:
        """Figures for this snapshot: seconds as floats, bytes and counts as ints.

        ``paused_seconds`` is returned as given: the caller's own measure of the
        snapshot (the contract's argument). The backend's own measure of how long the
        holders stayed paused is ``holders_paused_seconds``, known once the block has
        exited (the manifest records it; ``nemo-ckpt inspect`` shows it). The rest:
        ``figures``."""
        return {"paused_seconds": float(paused_seconds), **self.figures()}

    def figures(self) -> dict[str, float | int]:
        """``metrics`` without the caller's ``paused_seconds``: what the manifest
        records, and once committed ``snapshot_seconds`` (``snapshot()`` entered ->
        committed)."""
        b = self._begun
        figures: dict[str, float | int] = {
            "entry_seconds": b.entry_seconds,
            "drain_seconds": max((p.drain_seconds for p in b.pauses), default=0.0),
            "capture_seconds": max((c.capture_seconds for c in b.captures), default=0.0),
            "persist_seconds": 0.0,
            "bytes_written": 0,
            "captured_rollouts": self.captured_rollouts,
            "restarted_rollouts": self.restarted_rollouts,
            # Of those, sessions classed restart-only (nemo_ckpt.sandbox_backend).
            "restart_only_rollouts": sum(c.restart_only_count for c in b.captures),
            "holders": len(b.instances),
            "state_bytes": sum(c.state_bytes for c in b.captures),
            # Since each holder started (nemo_ckpt.adapters: a replay that diverged).
            "replay_restarted_rollouts": sum(c.replay_restarts for c in b.captures),
        }
        if self.check_result is not None:
            figures["not_held_rollouts"] = len(self.check_result.not_held)
            figures["orphan_staging_rows"] = len(self.check_result.orphan_staging_keys)
            figures["finished_rollouts"] = len(self.check_result.finished)
        if self._holders_paused is not None:
            figures["holders_paused_seconds"] = self._holders_paused
        figures.update(self._committed)
        return figures

    def _record_release(self, holders_paused_seconds: float) -> None:
        """The block has exited after ``holders_paused_seconds`` since ``snapshot()``
        was entered: the holders are released from here."""
        self._holders_paused = holders_paused_seconds

    def _record_commit(self, manifest_metrics: dict[str, float | int],
                       snapshot_seconds: float) -> None:
        """Committed ``snapshot_seconds`` after ``snapshot()`` was entered (the whole
        save: NeMo RL's ``total_save_seconds``, ``nemo_ckpt.nemo_rl_telemetry``)."""
        for key in ("persist_seconds", "bytes_written"):
            if key in manifest_metrics:
                self._committed[key] = manifest_metrics[key]
        self._committed["snapshot_seconds"] = snapshot_seconds
