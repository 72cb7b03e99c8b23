"""The data-plane cut, and the check of a backend capture against it.

RL's real cut (``DataPlaneMutationCut``) fits the protocol below through a thin adapter.
The check is a pure function, so it is tested without Ray and reused by every backend.

The check holds only if both sides keep one rule: RL records a dispatch in its ledger
before the environment opens the session, and every staging row an environment worker
writes is written inside a turn, before the turn commits. A turn in flight holds the
pause's drain, so after the pause and the barrier the cut holds everything that the
captured sessions reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from nemo_ckpt.errors import SnapshotMismatchError
from nemo_ckpt.interfaces import EnvironmentEpisode

__all__ = [
    "DataPlaneMutationCut",
    "Difference",
    "CutCheckResult",
    "check_capture_against_cut",
]


@runtime_checkable
class DataPlaneMutationCut(Protocol):
    """The part of RL's data-plane cut that nemo-ckpt reads.

    A cut is live only inside its barrier section: while it is live, RL's data plane
    accepts no mutation, so what it reports is one consistent state.
    """

    def require_live(self) -> None:
        """Raise if the barrier section that produced this cut has exited."""
        ...

    def expected_episodes(self) -> Mapping[str, frozenset[EnvironmentEpisode]]:
        """RL's ledger at the cut, per instance: the attempts dispatched there and not finished."""
        ...

    def staging_keys(self) -> frozenset[str]:
        """The token-capture staging rows present in the data plane at the cut."""
        ...


@dataclass(frozen=True, order=True)
class Difference:
    """One disagreement between a capture and the cut.

    Attributes:
        kind: ``unexpected_episode`` (the rollout is not expected on that instance, or
            anywhere), ``wrong_attempt`` (expected there, at another attempt),
            ``duplicate_rollout`` (one rollout held on two instances), or
            ``missing_staging_key`` (a captured session references a row the cut lacks).
        instance_id: The instance holding the offending session.
        rollout_id: The offending rollout.
        attempt: The attempt the backend holds.
        detail: What RL expected instead, or the missing staging key.
    """

    kind: str
    instance_id: str
    rollout_id: str
    attempt: int
    detail: str

    def __str__(self) -> str:
        episode = EnvironmentEpisode(self.rollout_id, self.attempt)
        return f"{self.kind}: {self.instance_id}/{episode.capture_key}: {self.detail}"


@dataclass(frozen=True)
class CutCheckResult:
    """What a passing check found, for the snapshot's metrics and warnings.

    Attributes:
        not_held: ``(instance_id, episode)`` pairs RL expects but the backend holds
            neither captured nor restarting: their sessions were not open yet, or were
            lost with a node. They start over after a crash.
        restarting: ``(instance_id, episode)`` pairs the backend holds but could not
            capture (mid-turn at the drain deadline). They start over after a crash.
        orphan_staging_keys: Rows the cut holds that no captured session references;
            a restore from this snapshot clears them.
    """

    not_held: frozenset[tuple[str, EnvironmentEpisode]]
    restarting: frozenset[tuple[str, EnvironmentEpisode]]
    orphan_staging_keys: frozenset[str]


def check_capture_against_cut(
    cut: DataPlaneMutationCut,
    captured: Mapping[str, Mapping[EnvironmentEpisode, frozenset[str]]],
    restarting: Mapping[str, frozenset[EnvironmentEpisode]] | None = None,
) -> CutCheckResult:
    """Check what the backend captured against RL's ledger and staging rows at ``cut``.

    Args:
        cut: The live data-plane cut. A stale cut is refused before anything else.
        captured: Per instance, each captured episode and the staging keys its session
            references (over all its earlier attempts).
        restarting: Per instance, the episodes the backend holds but did not capture.

    Returns:
        What passed with a note: episodes not held, restarting, and orphan rows.

    Raises:
        SnapshotMismatchError: listing every difference (see ``Difference.kind``).
        Whatever ``cut.require_live()`` raises for a stale cut.
    """
    cut.require_live()
    restarting = restarting or {}
    expected = {inst: frozenset(eps) for inst, eps in cut.expected_episodes().items()}
    cut_rows = frozenset(cut.staging_keys())

    # rollout id -> the (instance, attempt) pairs RL expects it at.
    expected_at: dict[str, set[tuple[str, int]]] = {}
    for inst, episodes in expected.items():
        for ep in episodes:
            expected_at.setdefault(ep.rollout_id, set()).add((inst, ep.attempt))

    restarting_pairs = _pairs(restarting)
    captured_pairs = _pairs({i: frozenset(s) for i, s in captured.items()})
    differences: list[Difference] = []
    referenced: set[str] = set()
    for inst, sessions in captured.items():
        inst_expected = expected.get(inst, frozenset())
        for ep, keys in sessions.items():
            referenced.update(keys)
            if ep not in inst_expected:
                differences.append(_unexpected(inst, ep, expected_at.get(ep.rollout_id, set())))
            for key in sorted(keys - cut_rows):
                differences.append(
                    Difference(
                        "missing_staging_key",
                        inst,
                        ep.rollout_id,
                        ep.attempt,
                        f"references staging row {key!r}, which the cut does not hold",
                    )
                )

    # rollout id -> {instance: attempt} over everything the backend holds.
    held: dict[str, dict[str, int]] = {}
    for inst, ep in captured_pairs | restarting_pairs:
        held.setdefault(ep.rollout_id, {})[inst] = ep.attempt
    for rollout_id, where in held.items():
        if len(where) > 1:
            for inst, attempt in where.items():
                others = sorted(set(where) - {inst})
                differences.append(
                    Difference(
                        "duplicate_rollout",
                        inst,
                        rollout_id,
                        attempt,
                        f"the same rollout is also held on {others}",
                    )
                )

    if differences:
        raise SnapshotMismatchError(tuple(sorted(differences)))

    not_held = frozenset(
        (inst, ep)
        for inst, episodes in expected.items()
        for ep in episodes
        if (inst, ep) not in captured_pairs and (inst, ep) not in restarting_pairs
    )
    return CutCheckResult(
        not_held=not_held,
        restarting=frozenset(restarting_pairs),
        orphan_staging_keys=cut_rows - referenced,
    )


def _pairs(
    by_instance: Mapping[str, frozenset[EnvironmentEpisode]],
) -> set[tuple[str, EnvironmentEpisode]]:
    return {(inst, ep) for inst, eps in by_instance.items() for ep in eps}


def _unexpected(
    inst: str, ep: EnvironmentEpisode, expected_at: set[tuple[str, int]]
) -> Difference:
    here = sorted(a for i, a in expected_at if i == inst)
    if here:
        return Difference(
            "wrong_attempt",
            inst,
            ep.rollout_id,
            ep.attempt,
            f"RL's ledger expects attempt(s) {here} of this rollout on {inst}",
        )
    if expected_at:
        return Difference(
            "unexpected_episode",
            inst,
            ep.rollout_id,
            ep.attempt,
            f"RL's ledger dispatched this rollout to {sorted({i for i, _ in expected_at})}, "
            f"not to {inst}",
        )
    return Difference(
        "unexpected_episode",
        inst,
        ep.rollout_id,
        ep.attempt,
        "RL's ledger has no unfinished attempt of this rollout",
    )
