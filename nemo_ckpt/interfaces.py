"""The contract between RL's single controller and an environment backend.

The controller saves and restores the rollout state that lives in the environment
backend (agent sessions, tool state, the turns already run) only through
``EnvironmentCheckpoint``; it never names the backend. ``RayEnvironmentCheckpoint``
(in ``nemo_ckpt.driver``) implements it over Ray actors; a backend that keeps
no rollout state uses ``NoEnvironmentCheckpoint``.

A rollout snapshot calls the interface in this order::

    async with env_checkpoint.snapshot(path) as snapshot:      # backend paused
        async with data_plane_barrier.checkpoint() as cut:     # RL's data plane frozen
            if snapshot is not None:
                await snapshot.check_against_cut(cut)
            ...                                                 # RL saves its own state
    # backend resumed

and a restore in this order::

    async with env_checkpoint.restored(path) as restored:      # backend restoring
        ...  # RL restores its data plane: continues restored.continued_attempts,
             # keeps restored.staging_keys, starts every other unfinished rollout over
    # restored sessions live (or dropped, if the block raised)

What a cut offers the check (``DataPlaneMutationCut``, and ``ScopedCut`` for an RL that
continues only some rollouts) is part of the contract too, here; ``nemo_ckpt.cut`` checks a
capture against one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, runtime_checkable

__all__ = [
    "DataPlaneMutationCut",
    "ScopedCut",
    "EnvironmentEpisode",
    "RestoredEnvironmentRollouts",
    "EnvironmentSnapshot",
    "EnvironmentCheckpoint",
    "NoEnvironmentCheckpoint",
]


@dataclass(frozen=True, order=True)
class EnvironmentEpisode:
    """One attempt at a rollout, as the environment backend knows it.

    RL's recovery ledger names rollouts this way when it asks the backend to retire,
    forget or continue them.

    Attributes:
        rollout_id: The rollout's base id; every attempt of the rollout shares it.
        attempt: How many times the backend has restored this rollout: 0 for the first
            run, and each restore continues it as the next attempt.
    """

    rollout_id: str
    attempt: int

    def __post_init__(self) -> None:
        if not isinstance(self.rollout_id, str) or not self.rollout_id:
            raise ValueError("environment episode rollout_id must not be empty")
        # bool is an int subclass; True as an attempt is always a caller's bug.
        if (
            not isinstance(self.attempt, int)
            or isinstance(self.attempt, bool)
            or self.attempt < 0
        ):
            raise ValueError("environment episode attempt must be non-negative")

    @property
    def capture_key(self) -> str:
        """The key of this attempt's rows: ``<rollout_id>-a<attempt>``.

        Attempt 0 keeps the bare rollout id. The backend keys its rows the same way.
        """
        if self.attempt == 0:
            return self.rollout_id
        return f"{self.rollout_id}-a{self.attempt}"

    def next_attempt(self) -> EnvironmentEpisode:
        """The attempt the backend creates when it restores this one."""
        return EnvironmentEpisode(self.rollout_id, self.attempt + 1)


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


@runtime_checkable
class ScopedCut(DataPlaneMutationCut, Protocol):
    """A cut whose RL continues only some rollouts at turn level (NeMo RL: the turn-level
    prompt groups; ``nemo_ckpt.integrations.nemo_rl`` makes one). The check reads these
    two methods when the cut has them.
    """

    def rollouts_in_scope(self) -> frozenset[str]:
        """The rollout ids RL continues from a snapshot. A captured session of any other
        rollout is outside the check: RL starts it over, and a restore drops it."""
        ...

    def retained_staging_keys(self) -> frozenset[str]:
        """Staging rows RL keeps for its own reasons (NeMo RL: sealed attempts' rows,
        kept until their group is trained); never orphans."""
        ...


@dataclass(frozen=True)
class RestoredEnvironmentRollouts:
    """What an environment restore continued, for RL to match.

    Attributes:
        continued_attempts: ``(instance_id, rollout_id, attempt)`` of every rollout the
            backend restored, with the attempt that was captured. RL's ledger continues
            exactly these and starts every other unfinished rollout over.
        staging_keys: Token-capture staging rows the restored rollouts still reference,
            over all their earlier attempts. RL keeps these rather than clearing them
            as orphans.
    """

    continued_attempts: frozenset[tuple[str, str, int]] = frozenset()
    staging_keys: frozenset[str] = frozenset()


class EnvironmentSnapshot(Protocol):
    """The backend's half of one rollout snapshot, while the backend is paused."""

    @property
    def restarted_rollouts(self) -> int:
        """How many rollouts the backend could not capture; they start over after a crash."""
        ...

    async def check_against_cut(self, cut: DataPlaneMutationCut) -> None:
        """Require the captured state to agree with RL's data plane at ``cut``.

        Raises when the backend's rollouts and RL's ledger disagree, since such a
        snapshot could not be restored.
        """
        ...

    def metrics(self, paused_seconds: float) -> dict[str, float | int]:
        """The backend's figures for this snapshot, logged with the snapshot timings:
        seconds as floats, bytes and counts as ints."""
        ...


class EnvironmentCheckpoint(Protocol):
    """Rollout state that an environment backend keeps between turns."""

    @property
    def holds_rollout_state(self) -> bool:
        """Whether rollout snapshots must capture this backend.

        True means a trainer checkpoint (which never pauses the backend) cannot stand
        in for a rollout snapshot.
        """
        ...

    async def check_startup(self) -> None:
        """Refuse, or warn about, a deployment that cannot recover as configured."""
        ...

    def snapshot(
        self, checkpoint_path: Path
    ) -> contextlib.AbstractAsyncContextManager[Optional[EnvironmentSnapshot]]:
        """Pause the backend and save its rollouts under ``checkpoint_path``.

        Yields ``None`` when there is nothing to save. The backend resumes, and accepts
        new rollouts again, when the context exits.
        """
        ...

    def restored(
        self, checkpoint_path: Path
    ) -> contextlib.AbstractAsyncContextManager[RestoredEnvironmentRollouts]:
        """Restore the backend's rollouts from ``checkpoint_path``.

        The restore is kept only if the context exits cleanly; on an exception the
        backend drops what it restored before it resumes.
        """
        ...

    def is_unavailable(self, error: BaseException) -> bool:
        """Whether a failed snapshot only met a backend that was briefly unreachable.

        Such a failure left nothing RL holds changed, so the caller may retry.
        """
        ...


class NoEnvironmentCheckpoint:
    """The checkpoint of a backend that keeps no rollout state between turns."""

    @property
    def holds_rollout_state(self) -> bool:
        """Always False: there is nothing to capture."""
        return False

    async def check_startup(self) -> None:
        """Nothing to check: any deployment recovers."""
        return None

    @contextlib.asynccontextmanager
    async def snapshot(
        self, checkpoint_path: Path
    ) -> AsyncIterator[Optional[EnvironmentSnapshot]]:
        """Yield ``None``: there is never anything to save."""
        del checkpoint_path
        yield None

    @contextlib.asynccontextmanager
    async def restored(
        self, checkpoint_path: Path
    ) -> AsyncIterator[RestoredEnvironmentRollouts]:
        """Refuse: a rollout checkpoint with environment state cannot be restored here."""
        raise RuntimeError(
            f"rollout checkpoint {checkpoint_path} contains turn-level environment "
            "state, but this run's environment backend keeps none to restore"
        )
        yield RestoredEnvironmentRollouts()  # pragma: no cover

    def is_unavailable(self, error: BaseException) -> bool:
        """Always False: this backend is never unreachable."""
        del error
        return False
