"""RL's side of a schedule, as the contract assumes it: the ledger of dispatched episodes,
the staging rows, the barrier that freezes both while a cut is live, and RL's own saves."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.testing.data_plane import StaticCut


@dataclass
class Saved:
    snapshot_id: str
    expected: dict[str, frozenset[Ep]]
    rows: frozenset[str]
    finished: frozenset[str]


class SimRL:
    """RL's ledger and data plane, as the contract assumes them: a dispatch is recorded
    before the session opens, rows are written inside turns, and the barrier freezes
    both while a cut is live. A finish is recorded with no lock against snapshots: the
    worker handed the result to the backend first (completion receipts)."""

    def __init__(self) -> None:
        self.expected: dict[str, set[Ep]] = defaultdict(set)
        self.where: dict[str, tuple[str, Ep]] = {}  # rollout -> (instance, episode)
        self.rows: set[str] = set()
        self.finished: set[str] = set()
        self.unfrozen = asyncio.Event()
        self.unfrozen.set()
        self.saves: dict[str, Saved] = {}  # committed with the environment's snapshot

    async def dispatch(self, instance: str, ep: Ep) -> None:
        await self.unfrozen.wait()
        self.expected[instance].add(ep)
        self.where[ep.rollout_id] = (instance, ep)

    async def write_row(self, key: str) -> None:
        await self.unfrozen.wait()
        self.rows.add(key)

    async def record_finish(self, ep: Ep) -> None:
        """Record ``ep`` as finished, once the barrier lets mutations through; nothing if
        the ledger has moved on from it (a restore since)."""
        await self.unfrozen.wait()
        if self.where.get(ep.rollout_id, (None, None))[1] == ep:
            self.finish(ep.rollout_id)

    def finish(self, rollout_id: str) -> None:
        instance, ep = self.where.pop(rollout_id)
        self.expected[instance].discard(ep)
        self.finished.add(rollout_id)

    @contextlib.asynccontextmanager
    async def checkpoint(self) -> AsyncIterator[StaticCut]:
        self.unfrozen.clear()
        cut = StaticCut({i: set(eps) for i, eps in self.expected.items()}, set(self.rows))
        try:
            yield cut
        finally:
            cut.expire()
            self.unfrozen.set()

    def state(self, snapshot_id: str) -> Saved:
        return Saved(snapshot_id, {i: frozenset(e) for i, e in self.expected.items()},
                     frozenset(self.rows), frozenset(self.finished))


class NemoRlView:
    """RL's side as NeMo RL's objects show it, for the schedules that run through
    ``nemo_ckpt.integrations.nemo_rl`` (``Plan.nemo_rl``): a recovery ledger and a staging
    listing over a cut's content (set as the barrier freezes it, or from RL's saved
    state at a restore), and a cut that has only ``require_live``. Owners are the
    instances (identity)."""

    OWNERS = {f"holder-{k}": f"holder-{k}" for k in range(64)}

    def __init__(self) -> None:
        self.cut: StaticCut | None = None
        self.restarted: set[tuple[str, str, int]] | None = None

    def gym_checkpoint_inventory(self, instance_ids: frozenset[str]
                                 ) -> dict[str, tuple[tuple[str, int], ...]]:
        assert self.cut is not None
        found = {i: tuple(sorted((ep.rollout_id, ep.attempt) for ep in eps))
                 for i, eps in self.cut.expected_episodes().items() if eps}
        unknown = set(found) - set(instance_ids)
        if unknown:  # as NeMo RL's ledger does
            raise RuntimeError(f"turn-level rollout references unavailable Gym instance "
                               f"{sorted(unknown)}")
        return {i: found.get(i, ()) for i in instance_ids}

    def expected_staging_keys(self) -> set[str]:
        return set()  # no sealed attempts: RL records a finish by moving its rows out

    def prepare_for_restart(self, cut: Any, *, restored_gym_episodes: set[tuple[str, str, int]]
                            ) -> None:
        cut.require_live()
        inventory = self.gym_checkpoint_inventory(frozenset(self.OWNERS))
        owned = {(o, r, a) for o, eps in inventory.items() for r, a in eps}
        unused = restored_gym_episodes - owned
        if unused:
            raise ValueError(f"Gym restored episodes are not owned by dispatched turn-level "
                             f"rollouts: {sorted(unused)!r}")
        self.restarted = set(restored_gym_episodes)

    async def list_staging(self) -> frozenset[str]:
        assert self.cut is not None
        await asyncio.sleep(0)
        return self.cut.staging_keys()


class LiveOnly:
    """NeMo RL's ``DataPlaneMutationCut``: ``require_live()`` and nothing else."""

    def __init__(self, cut: StaticCut) -> None:
        self._cut = cut

    def require_live(self) -> None:
        self._cut.require_live()
