"""NeMo RL's rollout recovery on nemo-ckpt, with no code of the user's.

NeMo RL's single controller runs the seed's call order (``nemo_ckpt.interfaces``) with
its own objects: a ``DataPlaneCheckpointBarrier`` whose ``checkpoint()`` yields a
``DataPlaneMutationCut`` that has only ``require_live()``; a ``RolloutRecoveryLedger``
that knows, per owner (a Gym replica id), the turn-level attempts it dispatched; and the
staging partition of its data plane. ``NemoRlEnvironmentCheckpoint`` wraps a
``RayEnvironmentCheckpoint`` so that this code works unchanged::

    env_checkpoint = NemoRlEnvironmentCheckpoint(
        RayEnvironmentCheckpoint(config), ledger=ledger,
        staging=data_plane.list_staging_keys,      # async, returns the staging row keys
        owners={"tools/replica-0": "holder-0", ...},   # RL's owner id -> our instance
        retained=controller.retained_staging_keys,  # rows RL keeps beyond the ledger's
        drain=controller.drain_finished_replies)    # seal what Gym finished, pre-cut
    async with env_checkpoint.snapshot(path, timeout_s=control_timeout_s) as snapshot:
        async with barrier.checkpoint() as cut:
            if snapshot is not None:
                await snapshot.check_against_cut(cut)
            ...

What it reads from NeMo RL, and how it judges (the version it follows is in
``nemo_ckpt.testing.nemo_rl``, the test double written from NeMo RL's documented
behaviour):

- **The check's scope is what RL names.** Under the cut, the expected attempts are
  ``ledger.gym_checkpoint_inventory(owner_ids)``: per owner, the ``(rollout_id,
  attempt)`` of every turn-level group's attempt that is dispatched, or reserved after a
  restore. A captured session of any other rollout (another group's, a sealed or dropped
  attempt's) is outside the check: RL starts it over, and a restore drops it. Sessions
  of dropped episodes not retired yet are named in the log; ``retire_dropped()``
  before a snapshot retires them. What was dropped is the ledger's retirement queue
  (``ledger.gym_checkpoint_retirements``, acknowledged with ``mark_gym_retired``) when
  it has one, and in any case what its records show (``groups()``: attempts abandoned,
  failed or replaced) and the rollouts seen in its inventory whose group has left it:
  schema 4 has no queue.
- **Staging rows** are the staging partition's listing, awaited under the cut. Sealed
  attempts' rows (``ledger.expected_staging_keys()``) and the rows of ``retained``
  (the caller's: NeMo RL's controller keeps published groups' rows until trained, and
  its route plans' cleanup keys) are never orphans, and a restore keeps them.
- **Owners map to instances both ways**: ``owners`` maps each RL owner id to the
  instance (holder) that keeps its sessions; several owners may share one. A live
  rollout given to an owner ``owners=`` does not name is ``UnmappedOwnerError`` at a
  snapshot, before the ledger's own ``RuntimeError``. Back from a restore, a continued
  session is handed to RL under its owner only when its rollout's owner in the
  restored ledger maps to the instance it was restored on, and its group is not one the
  ledger abandons whole (PROMPT_GROUP granularity); any other is dropped (it starts
  over). Should the ledger still refuse a triple it was given (a state not foreseen
  here), the changes it made stand and the refused sessions are dropped the same way:
  a restore never fails whole on it. Those of abandoned groups are named in a log line
  and in ``RestartPlan.abandoned``; every dropped session is retired.
- **The restore's hand-over**: ``restored()`` yields ``continued_attempts`` in owner ids
  (load RL's ledger before entering it), and ``prepare_for_restart(cut, restored)`` calls
  the ledger's with them and returns the staging rows RL keeps: the restored sessions',
  the sealed attempts' and ``retained``'s.
- **Owners may change between a snapshot and its restore** (fewer Gym replicas, or
  others): the restore asks the inventory about every owner the restored ledger names
  (its groups' current attempts, ``ledger.groups()``), not only those of ``owners=``,
  as the ledger raises for an owner it is not asked about. The rollouts of an owner
  ``owners=`` no longer names are not handed over: the ledger abandons them and RL
  starts them over; a warning and ``RestartPlan.vanished`` name them.
- **Deadlines** are the caller's: ``snapshot``/``restored`` take ``timeout_s`` (NeMo RL's
  ``control_timeout_s``) for the pause or the restore's preparation, and the staging
  listing gets what is left of it; a deadline missed is ``BackendUnavailableError`` or
  ``StagingListingTimeoutError``, both ``is_unavailable`` (nothing changed: retry).
- **Finished, not sealed**: a rollout Gym finished whose reply RL has not sealed at the
  cut would be abandoned by a restore and run again. ``drain`` (NeMo RL's controller
  drains its on-wire Gym replies before its cut) is awaited once the holders are
  paused and have captured every open session, and before the snapshot is handed to the
  caller for its cut, within the snapshot's deadline: a rollout whose session closed
  before the capture is sealed by then, and one that closes later was captured (it
  continues from its last turn).
- **Finished rollouts**: NeMo RL seals a finished rollout's result itself and never
  calls ``acknowledge``, so its environment workers end a session with
  ``SessionClient.close`` (never ``finish``, whose results would pile up in the holders);
  a snapshot that captures finished sessions says so in a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from nemo_ckpt.catalog.snapshot_diff import snapshot_index
from nemo_ckpt.errors import (
    BackendUnavailableError,
    NemoCkptError,
    StagingListingError,
    StagingListingTimeoutError,
    UnmappedOwnerError,
)
from nemo_ckpt.integrations import nemo_rl_ledger as nrl
from nemo_ckpt.interfaces import EnvironmentEpisode, RestoredEnvironmentRollouts

__all__ = [
    "LEDGER_METHODS",
    "NemoRlCut",
    "NemoRlEnvironmentCheckpoint",
    "NemoRlSnapshot",
    "RestartPlan",
    "RetainedKeys",
    "StagingListing",
]

log = logging.getLogger("nemo_ckpt")

# What the integration calls on NeMo RL's ledger; ``groups()``,
# ``gym_checkpoint_retirements`` and ``mark_gym_retired`` are used when the ledger has them.
LEDGER_METHODS = ("gym_checkpoint_inventory", "expected_staging_keys", "prepare_for_restart")
_CHECKPOINT_METHODS = ("snapshot", "restored", "is_unavailable", "check_startup", "retire")

# The staging partition's listing: awaited under the cut, it returns the row keys.
StagingListing = Callable[[], Awaitable[Iterable[str]]]

# The rows RL keeps beyond the ledger's (published groups' still to be trained, route
# plans' cleanup keys): read under the cut, sync or async.
RetainedKeys = Callable[[], "Iterable[str] | Awaitable[Iterable[str]]"]

Triple = tuple[str, str, int]


def _missing(obj: object, methods: Iterable[str]) -> list[str]:
    return [m for m in methods if not callable(getattr(obj, m, None))]


def _check_ledger(ledger: object) -> None:
    missing = _missing(ledger, LEDGER_METHODS)
    if missing:
        raise TypeError(
            f"the ledger given to NemoRlEnvironmentCheckpoint ({type(ledger).__name__}) "
            f"has no {', '.join(missing)}: pass NeMo RL's RolloutRecoveryLedger (schema 4 "
            f"or later), or an object with {', '.join(LEDGER_METHODS)}")


class NemoRlCut:
    """The cut the core check reads (``nemo_ckpt.cut.ScopedCut``), made under NeMo RL's
    live cut from its ledger and staging listing. Live exactly while RL's cut is."""

    def __init__(self, cut: Any, expected: Mapping[str, frozenset[EnvironmentEpisode]],
                 staging: frozenset[str], scope: frozenset[str],
                 retained: frozenset[str]) -> None:
        self._cut = cut
        self._expected = expected
        self._staging = staging
        self._scope = scope
        self._retained = retained

    def require_live(self) -> None:
        self._cut.require_live()

    def expected_episodes(self) -> Mapping[str, frozenset[EnvironmentEpisode]]:
        self.require_live()
        return self._expected

    def staging_keys(self) -> frozenset[str]:
        self.require_live()
        return self._staging

    def rollouts_in_scope(self) -> frozenset[str]:
        return self._scope

    def retained_staging_keys(self) -> frozenset[str]:
        return self._retained


@dataclass(frozen=True)
class RestartPlan:
    """What ``NemoRlEnvironmentCheckpoint.prepare_for_restart`` handed RL.

    Attributes:
        restored_gym_episodes: ``(owner_id, rollout_id, attempt)`` passed to the ledger's
            ``prepare_for_restart``: the captured attempts it continues as the next.
        keep_staging_keys: Staging rows RL keeps: those the restored sessions reference
            and the sealed attempts'. RL clears every other row.
        dropped: ``(instance_id, rollout_id, attempt)`` of restored sessions RL does not
            continue (another group's, or not back on their owner's instance); they are
            retired once the restore goes live, and start over.
        vanished: ``(owner_id, rollout_id, attempt)`` of the turn-level rollouts the
            restored ledger gives to owners ``owners=`` no longer names (a Gym replica
            fewer, or renamed): not handed over, they start over.
        abandoned: ``(owner_id, rollout_id, attempt)`` of restored sessions the ledger
            abandons (a group of PROMPT_GROUP granularity is abandoned whole, or a
            triple it refused): not handed over (or refused, its other changes kept),
            retired, they start over. Also in ``dropped``, by instance.
    """

    restored_gym_episodes: frozenset[Triple]
    keep_staging_keys: frozenset[str]
    dropped: frozenset[Triple]
    vanished: frozenset[Triple] = frozenset()
    abandoned: frozenset[Triple] = frozenset()


@dataclass(frozen=True)
class _HandOver:
    """What a restore hands RL, and the restored sessions it does not hand over."""

    restored: RestoredEnvironmentRollouts
    dropped: frozenset[Triple]
    abandoned: frozenset[Triple]


class NemoRlSnapshot:
    """The backend's half of one snapshot, checked the way NeMo RL's ledger means it
    (``EnvironmentSnapshot``); the rest is the wrapped snapshot's."""

    def __init__(self, inner: Any, integration: NemoRlEnvironmentCheckpoint,
                 deadline: float | None) -> None:
        self._inner = inner
        self._integration = integration
        self._deadline = deadline
        self.outside_scope: frozenset[tuple[str, EnvironmentEpisode]] = frozenset()
        self.not_retired: frozenset[tuple[str, str, int]] = frozenset()

    @property
    def restarted_rollouts(self) -> int:
        return int(self._inner.restarted_rollouts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def check_against_cut(self, cut: Any) -> None:
        """NeMo RL's ``cut.require_live()``, then its ledger's inventory and its staging
        listing under that cut, then the core check over what RL names (the module
        docstring). Raises as ``RaySnapshot.check_against_cut`` does, or
        ``StagingListingError`` when the listing fails."""
        cut.require_live()
        try:
            view = await self._integration._cut_view(cut, self._deadline)
        except BaseException as exc:
            self._inner.refused = exc  # a check that raised: the snapshot cannot commit
            raise
        await self._inner.check_against_cut(view)
        result = getattr(self._inner, "check_result", None)
        if result is None:
            return
        self.outside_scope = result.outside_scope
        retiring = self._integration._retirements
        self.not_retired = frozenset(
            (inst, ep.rollout_id, ep.attempt) for inst, ep in result.outside_scope
            if (ep.rollout_id, ep.attempt) in retiring)
        if self.not_retired:
            log.info("snapshot %s: %d session(s) of episodes RL dropped are not retired "
                     "yet; they are not continued (retire_dropped() before a snapshot "
                     "retires them)", getattr(self._inner, "snapshot_id", "?"),
                     len(self.not_retired))
        if result.finished:
            log.warning(
                "snapshot %s: %d finished session(s) wait for an acknowledgement NeMo RL "
                "never sends: under NeMo RL, end a session with SessionClient.close(), "
                "not finish()", getattr(self._inner, "snapshot_id", "?"),
                len(result.finished))

    def metrics(self, paused_seconds: float) -> dict[str, Any]:
        figures = dict(self._inner.metrics(paused_seconds))
        figures["outside_scope_rollouts"] = len(self.outside_scope)
        return figures


class NemoRlEnvironmentCheckpoint:
    """``EnvironmentCheckpoint`` for NeMo RL's controller over a ``RayEnvironmentCheckpoint``
    (or anything with its methods); what it reads and how: the module docstring.

    Args:
        checkpoint: The backend's checkpoint (``RayEnvironmentCheckpoint``).
        ledger: NeMo RL's ``RolloutRecoveryLedger``, or a callable returning the current
            one (the controller replaces it when it loads a checkpoint).
        staging: An async callable listing the staging partition's row keys.
        owners: RL's owner id (a Gym replica id) -> the instance id of the holder that
            keeps its sessions.
        timeout_s: The default deadline of ``snapshot`` and ``restored``; None for the
            backend's own (``CheckpointConfig``).
        retained: A callable (sync or async) returning the staging rows RL keeps beyond
            the ledger's sealed attempts (published groups' rows still to be trained,
            route plans' cleanup keys), read under the cut: never orphans, always kept.
        drain: An async callable that seals the rollouts Gym finished whose replies RL
            has not sealed yet (NeMo RL's drain of on-wire Gym replies); awaited at each
            snapshot once the holders are paused, before the caller's cut.

    Raises:
        TypeError: naming every method a given object lacks, or a malformed argument.
    """

    def __init__(self, checkpoint: Any, *, ledger: Any, staging: StagingListing,
                 owners: Mapping[str, str], timeout_s: float | None = None,
                 retained: RetainedKeys | None = None,
                 drain: Callable[[], Awaitable[Any]] | None = None) -> None:
        missing = _missing(checkpoint, _CHECKPOINT_METHODS)
        if missing:
            raise TypeError(
                f"the checkpoint given to NemoRlEnvironmentCheckpoint "
                f"({type(checkpoint).__name__}) has no {', '.join(missing)}: pass a "
                f"RayEnvironmentCheckpoint")
        self._ledger_source: Callable[[], Any] | None = None
        if _missing(ledger, LEDGER_METHODS) and callable(ledger):
            self._ledger_source = ledger
        else:
            _check_ledger(ledger)
        self._ledger = ledger
        if not callable(staging):
            raise TypeError(
                f"staging= must be an async callable returning the staging partition's "
                f"row keys, not {type(staging).__name__}")
        for name, given in (("retained", retained), ("drain", drain)):
            if given is not None and not callable(given):
                raise TypeError(f"{name}= must be a callable, not {type(given).__name__}")
        if not isinstance(owners, Mapping) or not owners or not all(
                isinstance(o, str) and o and isinstance(i, str) and i
                for o, i in owners.items()):
            raise TypeError("owners= must map each RL owner id (str) to the instance id "
                            "(str) of the holder that keeps its sessions, and name one "
                            "owner at least")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self.checkpoint = checkpoint
        self._staging = staging
        self._retained = retained
        self._drain = drain
        self.owners: Mapping[str, str] = dict(owners)
        self.timeout_s = timeout_s
        self._retirements: frozenset[tuple[str, int]] = frozenset()
        self._dropped_episodes = nrl.DroppedEpisodes()
        self._to_drop: frozenset[Triple] = frozenset()
        # The rollouts of owners gone since the snapshot, as last warned of (once each).
        self._vanished: frozenset[Triple] = frozenset()
        self._inner_restored: RestoredEnvironmentRollouts | None = None
        self._restored_path: Path | str = ""

    # --- the contract --------------------------------------------------------------------

    @property
    def holds_rollout_state(self) -> bool:
        return bool(self.checkpoint.holds_rollout_state)

    async def check_startup(self) -> None:
        await self.checkpoint.check_startup()

    def is_unavailable(self, error: BaseException) -> bool:
        """The backend's classes (``RayEnvironmentCheckpoint.is_unavailable``): true only
        where nothing RL holds changed, a staging listing's timeout included. NeMo RL
        retries a failed snapshot at its next interval exactly when this is true."""
        return bool(self.checkpoint.is_unavailable(error))

    @contextlib.asynccontextmanager
    async def snapshot(self, checkpoint_path: Path, *, timeout_s: float | None = None
                       ) -> AsyncIterator[Optional[NemoRlSnapshot]]:
        """``RayEnvironmentCheckpoint.snapshot``, with the pause and capture (and
        ``drain``) held to ``timeout_s`` (or the constructor's): past it the snapshot is
        aborted on every holder and ``BackendUnavailableError`` raised."""
        async with self._snapshot(self.checkpoint.snapshot(checkpoint_path),
                                  checkpoint_path, timeout_s) as snap:
            yield snap

    @contextlib.asynccontextmanager
    async def final_snapshot(self, checkpoint_path: Path, *,
                             drain_timeout_s: float | None = None,
                             timeout_s: float | None = None
                             ) -> AsyncIterator[Optional[NemoRlSnapshot]]:
        """``RayEnvironmentCheckpoint.final_snapshot`` (a job told to stop: its commit
        parks every session), checked against NeMo RL's ledger as ``snapshot`` is."""
        manager = self.checkpoint.final_snapshot(checkpoint_path,
                                                 drain_timeout_s=drain_timeout_s)
        async with self._snapshot(manager, checkpoint_path, timeout_s) as snap:
            yield snap

    async def draining_holders(self) -> list[Any]:
        """``RayEnvironmentCheckpoint.draining_holders``."""
        return list(await self.checkpoint.draining_holders())

    @contextlib.asynccontextmanager
    async def _snapshot(self, manager: Any, checkpoint_path: Path, timeout_s: float | None
                        ) -> AsyncIterator[Optional[NemoRlSnapshot]]:
        limit = timeout_s if timeout_s is not None else self.timeout_s
        loop = asyncio.get_running_loop()
        deadline = None if limit is None else loop.time() + limit
        inner = await _bounded(manager.__aenter__(), limit,
                               f"the snapshot into {checkpoint_path} did not get past its "
                               f"preparation")
        snap = None if inner is None else NemoRlSnapshot(inner, self, deadline)
        async with _entered(manager):
            if self._drain is not None:  # the holders are paused: nothing finishes now
                left = None if deadline is None else max(0.0, deadline - loop.time())
                await _bounded(_call(self._drain), left,
                               f"RL's drain of finished rollouts before the cut of "
                               f"{checkpoint_path} did not end", limit)
            yield snap

    @contextlib.asynccontextmanager
    async def restored(self, checkpoint_path: Path, *, timeout_s: float | None = None
                       ) -> AsyncIterator[RestoredEnvironmentRollouts]:
        """``RayEnvironmentCheckpoint.restored``, yielding ``continued_attempts`` in RL's
        owner ids, as the ledger loaded before this call will take them (the module
        docstring); sessions it cannot hand over are retired once the restore is live."""
        limit = timeout_s if timeout_s is not None else self.timeout_s
        manager = self.checkpoint.restored(checkpoint_path)
        inner = await _bounded(manager.__aenter__(), limit,
                               f"the restore from {checkpoint_path} did not get past its "
                               f"preparation")
        self._vanished = frozenset()
        async with _entered(manager):
            hand = await self._hand_over(inner, checkpoint_path)
            self._to_drop = hand.dropped
            self._inner_restored = inner
            self._restored_path = checkpoint_path
            try:
                yield hand.restored
            finally:
                self._inner_restored = None
        await self._retire_restored(checkpoint_path)

    # --- NeMo RL's side ------------------------------------------------------------------

    async def prepare_for_restart(self, cut: Any, restored: RestoredEnvironmentRollouts
                                  ) -> RestartPlan:
        """Inside ``restored()``'s block, under a live cut: the ledger's
        ``prepare_for_restart(cut, restored_gym_episodes=...)`` with the attempts
        ``restored`` continues, and the staging rows RL keeps. Never fails on a restored
        episode the ledger will not continue: it is retired and named instead."""
        cut.require_live()
        ledger = self._current_ledger()
        abandoned: frozenset[Triple] = frozenset()
        if self._inner_restored is not None:  # the ledger as loaded now decides
            hand = await self._hand_over(self._inner_restored, self._restored_path)
            restored, self._to_drop, abandoned = hand.restored, hand.dropped, hand.abandoned
        episodes = set(restored.continued_attempts)
        keys = frozenset(restored.staging_keys)
        try:
            ledger.prepare_for_restart(cut, restored_gym_episodes=episodes)
        except ValueError as exc:
            refused = nrl.unowned_episodes(exc)
            if refused is None or not refused <= episodes:
                raise
            # Its changes are made; these start over as an abandoned group's do.
            episodes -= refused
            abandoned |= refused
            gone = {(self.owners[o], rid, att) for o, rid, att in refused}
            self._to_drop |= gone
            if self._restored_path:
                kept = {(self.owners[o], rid, att) for o, rid, att in episodes}
                keys -= await self._blocking(_rows_of_dropped, self._restored_path,
                                             kept, gone)
        if abandoned:
            named = sorted(f"{rid}@{att}" for _, rid, att in abandoned)
            log.info("restore: RL's ledger abandons %d restored rollout(s) (their group "
                     "starts over whole, or the ledger refused them); their sessions "
                     "are retired: %s", len(abandoned), ", ".join(named))
        keep = keys | nrl.keys(ledger.expected_staging_keys(), "expected_staging_keys") \
            | await self._retained_keys()
        return RestartPlan(frozenset(episodes), keep, self._to_drop, self._vanished,
                           abandoned)

    async def retire_dropped(self) -> frozenset[Triple]:
        """Retire in the backend every episode RL dropped while Gym may hold its session
        (outside a snapshot): the ledger's retirement queue when it has one
        (acknowledged with its ``mark_gym_retired``), and what its records show
        (schema 4 has no queue). Returns the ``(owner_id, rollout_id, attempt)``
        retired now."""
        ledger, live, groups = self._ledger_inventory(restoring=True)
        queued = self._queued(ledger)
        dropped = self._dropped_episodes.now(groups, live, queued)
        self._dropped_episodes.saw(live)
        from_queue = frozenset((o, rid, att) for o, pairs in queued.items()
                               for rid, att in pairs)
        send = frozenset(t for t in self._dropped_episodes.to_send(dropped, from_queue)
                         if t[0] in self.owners)
        if send:
            await self.checkpoint.retire([EnvironmentEpisode(rid, att)
                                          for _, rid, att in send])
        self._dropped_episodes.sent(dropped, send)
        acknowledge = getattr(ledger, "mark_gym_retired", None)
        if from_queue and callable(acknowledge):
            acknowledge({o: tuple(pairs) for o, pairs in queued.items() if pairs})
        return send

    def __getattr__(self, name: str) -> Any:
        # retire, forget, acknowledge, holders, shutdown, metrics: the backend's own.
        if name.startswith("_") or name == "checkpoint":
            raise AttributeError(name)
        return getattr(self.checkpoint, name)

    # --- internals ------------------------------------------------------------------------

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        run = getattr(self.checkpoint, "run_blocking", None)
        return await (run(fn, *args) if run is not None else asyncio.to_thread(fn, *args))

    def _current_ledger(self) -> Any:
        if self._ledger_source is None:
            return self._ledger
        ledger = self._ledger_source()
        _check_ledger(ledger)
        return ledger

    def _queued(self, ledger: Any) -> dict[str, tuple[tuple[str, int], ...]]:
        method = getattr(ledger, "gym_checkpoint_retirements", None)
        return {} if method is None else nrl.inventory(method(frozenset(self.owners)),
                                                       "gym_checkpoint_retirements")

    async def _retained_keys(self) -> frozenset[str]:
        if self._retained is None:
            return frozenset()
        found = self._retained()
        if inspect.isawaitable(found):
            found = await found
        return nrl.keys(found, "retained=")

    def _ledger_inventory(self, restoring: bool = False) -> tuple[
            Any, dict[str, tuple[tuple[str, int], ...]], list[Any] | None]:
        """The current ledger, and its inventory of every owner ``owners=`` or the
        ledger names (it raises for an owner it is not asked about), checked. Unless
        ``restoring`` (a restored ledger's owners may be gone), a live rollout of an
        owner ``owners=`` does not map is ``UnmappedOwnerError``. Also its group records
        (``nemo_rl_ledger.records``), read once."""
        ledger = self._current_ledger()
        groups = nrl.records(ledger)
        owners = frozenset(self.owners) | nrl.owners_named(groups)
        try:
            listed = nrl.inventory(ledger.gym_checkpoint_inventory(owners),
                                   "gym_checkpoint_inventory")
        except RuntimeError as exc:  # a ledger without groups(): its words, our fix
            if restoring or "Gym instance" not in str(exc):
                raise
            raise UnmappedOwnerError(_unmapped_message(["(named by the ledger)"], exc)
                                     ) from exc
        unmapped = sorted(o for o, pairs in listed.items() if pairs and o not in self.owners)
        if unmapped and not restoring:
            raise UnmappedOwnerError(_unmapped_message(unmapped, None))
        return ledger, listed, groups

    async def _cut_view(self, cut: Any, deadline: float | None) -> NemoRlCut:
        ledger, inventory, groups = self._ledger_inventory()
        expected: dict[str, set[EnvironmentEpisode]] = {}
        for owner, pairs in inventory.items():
            expected.setdefault(self.owners[owner], set()).update(
                EnvironmentEpisode(rid, att) for rid, att in pairs)
        dropped = self._dropped_episodes.now(groups, inventory, self._queued(ledger))
        self._dropped_episodes.saw(inventory)
        self._retirements = frozenset((rid, att) for _, rid, att in dropped)
        staging = await self._list_staging(deadline)
        cut.require_live()  # the listing awaited: the cut must still hold what it says
        retained = nrl.keys(ledger.expected_staging_keys(), "expected_staging_keys") \
            | await self._retained_keys()
        cut.require_live()
        return NemoRlCut(
            cut, {inst: frozenset(eps) for inst, eps in expected.items()}, staging,
            frozenset(rid for pairs in inventory.values() for rid, _ in pairs), retained)

    async def _list_staging(self, deadline: float | None) -> frozenset[str]:
        loop = asyncio.get_running_loop()
        left = None if deadline is None else max(0.0, deadline - loop.time())
        try:
            listed = await asyncio.wait_for(_call(self._staging), left)
        except asyncio.TimeoutError:
            raise StagingListingTimeoutError(
                "the staging partition's listing missed the snapshot's deadline; nothing "
                "changed: retry the snapshot, or give it a longer timeout_s") from None
        except NemoCkptError:
            raise
        except Exception as exc:
            raise StagingListingError(
                f"listing the staging partition under the cut failed: {exc!r}; the "
                f"snapshot does not commit") from exc
        return nrl.keys(listed, "the staging listing")

    async def _hand_over(self, inner: RestoredEnvironmentRollouts, path: Path | str
                         ) -> _HandOver:
        """The restored attempts in owner ids that the loaded ledger continues with the
        rows they reference; the restored sessions it does not (dropped), and of those,
        the ones of groups it abandons whole (abandoned). The rollouts of owners gone
        since the snapshot are warned of once (``_vanished``)."""
        _, inventory, groups = self._ledger_inventory(restoring=True)
        self._dropped_episodes.saw({o: p for o, p in inventory.items() if o in self.owners})
        whole = nrl.abandoned_whole(groups)
        owner_of = {(rid, att): owner for owner, pairs in inventory.items()
                    for rid, att in pairs}
        self._warn_vanished(inventory, path)
        handed: set[Triple] = set()
        dropped: set[Triple] = set()
        abandoned: set[Triple] = set()
        for instance, rid, att in inner.continued_attempts:
            owner = owner_of.get((rid, att))
            if owner is not None and self.owners.get(owner) == instance \
                    and (rid, att) not in whole:
                handed.add((owner, rid, att))
                continue
            dropped.add((instance, rid, att))
            if owner is not None and (rid, att) in whole:
                abandoned.add((owner, rid, att))
        keys = frozenset(inner.staging_keys) if handed else frozenset()
        if dropped and handed:  # their rows are RL's to clear: the shards' indexes say which
            keys -= await self._blocking(_rows_of_dropped, path, handed, dropped)
        return _HandOver(RestoredEnvironmentRollouts(continued_attempts=frozenset(handed),
                                                     staging_keys=keys),
                         frozenset(dropped), frozenset(abandoned))

    def _warn_vanished(self, inventory: Mapping[str, Iterable[tuple[str, int]]],
                       path: Path | str) -> None:
        vanished = frozenset((owner, rid, att) for owner, pairs in inventory.items()
                             if owner not in self.owners for rid, att in pairs)
        if not vanished or vanished == self._vanished:
            return
        self._vanished = vanished
        gone = sorted({owner for owner, _, _ in vanished})
        named = sorted(f"{rid}@{att}" for _, rid, att in vanished)
        log.warning(
            "restore from %s: RL's ledger gives %d turn-level rollout(s) to Gym "
            "owner(s) %s, which owners= no longer names; they start over: %s%s",
            path, len(vanished), ", ".join(gone), ", ".join(named[:20]),
            "" if len(named) <= 20 else f" (and {len(named) - 20} more: "
                                        f"RestartPlan.vanished)")

    async def _retire_restored(self, path: Path | str) -> None:
        """Once the restore is live: retire the restored sessions RL does not continue."""
        dropped = self._to_drop
        if not dropped:
            return
        # Normal for groups RL restarts whole (not turn-level): said, not warned.
        log.info("restore from %s: %d restored session(s) RL's ledger does not "
                 "continue on their instance (another group's, an abandoned group's, or "
                 "their owner now maps elsewhere); retired, they start over", path,
                 len(dropped))
        episodes = [EnvironmentEpisode(rid, att).next_attempt() for _, rid, att in dropped]
        try:
            await self.checkpoint.retire(episodes)
        except NemoCkptError as exc:  # they would idle; never fail a live restore
            log.warning("restore from %s: %d restored session(s) RL does not continue "
                        "could not be retired (%s); retire them by hand", path,
                        len(dropped), exc)


def _unmapped_message(owners: list[str], cause: BaseException | None) -> str:
    said = "" if cause is None else f" (the ledger: {cause})"
    return (f"RL's ledger gives live rollouts to Gym owner(s) {', '.join(owners)}, which "
            f"owners= of NemoRlEnvironmentCheckpoint does not map to an instance{said}: "
            f"add each RL owner id to owners= with the instance id of the holder that "
            f"keeps its sessions; nothing changed")


def _rows_of_dropped(path: Path | str, handed: set[tuple[str, str, int]],
                     dropped: set[tuple[str, str, int]]) -> frozenset[str]:
    """The rows only dropped sessions reference, from the snapshot's shard indexes."""
    _, rollouts = snapshot_index(path)
    kept_eps = {(rid, att) for _, rid, att in handed}
    dropped_eps = {(rid, att) for _, rid, att in dropped}
    kept: set[str] = set()
    gone: set[str] = set()
    for entry in rollouts:
        if (entry.rollout_id, entry.attempt) in dropped_eps:
            gone.update(entry.staging_keys)
        elif (entry.rollout_id, entry.attempt) in kept_eps:
            kept.update(entry.staging_keys)
    return frozenset(gone - kept)


async def _call(fn: Callable[[], Awaitable[Any]]) -> Any:
    return await fn()


async def _bounded(step: Awaitable[Any], limit: float | None, what: str,
                   deadline_s: float | None = None) -> Any:
    """Await ``step`` within ``limit`` seconds; a missed deadline cancels it (a
    snapshot's or restore's entry aborts the operation on every holder) and is
    ``BackendUnavailableError`` starting with ``what`` and naming the caller's deadline
    (``deadline_s``, or ``limit``).

    ``step`` runs in the caller's task, not in one of ``asyncio.wait_for``'s (before
    Python 3.12 it runs the awaitable in a task of its own): ``_entered`` exits an entry
    in the caller's, and what the entry set in its context (the operation's tracing
    span) must be reset in the same context, or OpenTelemetry logs "Failed to detach
    context" at every snapshot and restore with a deadline."""
    if limit is None:
        return await step
    task = asyncio.current_task()
    assert task is not None  # an ``async`` method runs in a task
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(max(0.0, limit), expire)
    try:
        return await step
    except asyncio.CancelledError:
        if not expired:
            raise  # the caller's own cancellation
        raise BackendUnavailableError(
            f"{what} within the caller's deadline of {deadline_s or limit}s; it was "
            f"aborted on every "
            f"holder and nothing changed: retry") from None
    finally:
        timer.cancel()
        if expired and sys.version_info >= (3, 11):
            task.uncancel()  # our cancellation, consumed here: the task runs on


@contextlib.asynccontextmanager
async def _entered(manager: Any) -> AsyncIterator[None]:
    """Exit an entered ``manager`` as ``async with`` would."""
    try:
        yield
    except BaseException as exc:
        if not await manager.__aexit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        await manager.__aexit__(None, None, None)
