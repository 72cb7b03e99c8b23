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
        owners={"tools/replica-0": "holder-0", ...})   # RL's owner id -> our instance
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
  of dropped episodes not retired yet (``ledger.gym_checkpoint_retirements``, when the
  ledger has it) are named in the log; ``retire_dropped()`` before a snapshot retires
  them.
- **Staging rows** are the staging partition's listing, awaited under the cut. Sealed
  attempts' rows (``ledger.expected_staging_keys()``) stay in staging until their
  group is trained: they are never orphans.
- **Owners map to instances both ways**: ``owners`` maps each RL owner id to the
  instance (holder) that keeps its sessions; several owners may share one. Back from a
  restore, a continued session is handed to RL under its owner only when its rollout's
  owner in the restored ledger maps to the instance it was restored on; any other is
  dropped (it starts over), so ``prepare_for_restart`` never meets a triple it cannot use.
- **The restore's hand-over**: ``restored()`` yields ``continued_attempts`` in owner ids
  (load RL's ledger before entering it), and ``prepare_for_restart(cut, restored)`` calls
  the ledger's with them and returns the staging rows RL keeps: the restored sessions'
  and the sealed attempts'.
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
- **Finished rollouts**: NeMo RL seals a finished rollout's result itself and never
  calls ``acknowledge``, so its environment workers end a session with
  ``SessionClient.close`` (never ``finish``, whose results would pile up in the holders);
  a snapshot that captures finished sessions says so in a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from nemo_ckpt.catalog.snapshot_diff import snapshot_index
from nemo_ckpt.errors import (
    BackendUnavailableError,
    NemoCkptError,
    StagingListingError,
    StagingListingTimeoutError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode, RestoredEnvironmentRollouts

__all__ = [
    "LEDGER_METHODS",
    "NemoRlCut",
    "NemoRlEnvironmentCheckpoint",
    "NemoRlSnapshot",
    "RestartPlan",
    "StagingListing",
]

log = logging.getLogger("nemo_ckpt")

# What the integration calls on NeMo RL's ledger; ``gym_checkpoint_retirements`` is used
# when the ledger has it (the ledgers before it retired nothing).
LEDGER_METHODS = ("gym_checkpoint_inventory", "expected_staging_keys", "prepare_for_restart")
_CHECKPOINT_METHODS = ("snapshot", "restored", "is_unavailable", "check_startup", "retire")

# The staging partition's listing: awaited under the cut, it returns the row keys.
StagingListing = Callable[[], Awaitable[Iterable[str]]]

# What one owner's inventory may hold before it is refused: a claim to bound, as any.
_MAX_INVENTORY = 10_000_000


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
    """

    restored_gym_episodes: frozenset[tuple[str, str, int]]
    keep_staging_keys: frozenset[str]
    dropped: frozenset[tuple[str, str, int]]
    vanished: frozenset[tuple[str, str, int]] = frozenset()


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

    Raises:
        TypeError: naming every method a given object lacks, or a malformed ``owners``.
    """

    def __init__(self, checkpoint: Any, *, ledger: Any, staging: StagingListing,
                 owners: Mapping[str, str], timeout_s: float | None = None) -> None:
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
        self.owners: Mapping[str, str] = dict(owners)
        self.timeout_s = timeout_s
        self._retirements: frozenset[tuple[str, int]] = frozenset()
        self._to_drop: frozenset[tuple[str, str, int]] = frozenset()
        # The rollouts of owners gone since the snapshot, as last warned of (once each).
        self._vanished: frozenset[tuple[str, str, int]] = frozenset()
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
        """``RayEnvironmentCheckpoint.snapshot``, with the pause and capture held to
        ``timeout_s`` (or the constructor's): past it the snapshot is aborted on every
        holder and ``BackendUnavailableError`` raised."""
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
        inner = await _enter(manager, limit, f"the snapshot into {checkpoint_path}")
        snap = None if inner is None else NemoRlSnapshot(inner, self, deadline)
        async with _entered(manager):
            yield snap

    @contextlib.asynccontextmanager
    async def restored(self, checkpoint_path: Path, *, timeout_s: float | None = None
                       ) -> AsyncIterator[RestoredEnvironmentRollouts]:
        """``RayEnvironmentCheckpoint.restored``, yielding ``continued_attempts`` in RL's
        owner ids, as the ledger loaded before this call will take them (the module
        docstring); sessions it cannot hand over are retired once the restore is live."""
        limit = timeout_s if timeout_s is not None else self.timeout_s
        manager = self.checkpoint.restored(checkpoint_path)
        inner = await _enter(manager, limit, f"the restore from {checkpoint_path}")
        self._vanished = frozenset()
        async with _entered(manager):
            handed, self._to_drop = await self._hand_over(inner, checkpoint_path)
            self._inner_restored = inner
            self._restored_path = checkpoint_path
            try:
                yield handed
            finally:
                self._inner_restored = None
        dropped = self._to_drop
        if dropped:
            # Normal for groups RL restarts whole (not turn-level): said, not warned.
            log.info("restore from %s: %d restored session(s) RL's ledger does not "
                     "continue on their instance (another group's, or their owner now "
                     "maps elsewhere); retired, they start over", checkpoint_path,
                     len(dropped))
            episodes = [EnvironmentEpisode(rid, att).next_attempt() for _, rid, att in dropped]
            try:
                await self.checkpoint.retire(episodes)
            except NemoCkptError as exc:  # they would idle; never fail a live restore
                log.warning("restore from %s: %d restored session(s) RL does not continue "
                            "could not be retired (%s); retire them by hand",
                            checkpoint_path, len(dropped), exc)

    # --- NeMo RL's side ------------------------------------------------------------------

    async def prepare_for_restart(self, cut: Any, restored: RestoredEnvironmentRollouts
                                  ) -> RestartPlan:
        """Inside ``restored()``'s block, under a live cut: the ledger's
        ``prepare_for_restart(cut, restored_gym_episodes=...)`` with the attempts
        ``restored`` continues, and the staging rows RL keeps."""
        cut.require_live()
        ledger = self._current_ledger()
        if self._inner_restored is not None:  # the ledger as loaded now decides
            restored, self._to_drop = await self._hand_over(self._inner_restored,
                                                            self._restored_path)
        episodes = set(restored.continued_attempts)
        ledger.prepare_for_restart(cut, restored_gym_episodes=episodes)
        keep = frozenset(restored.staging_keys) | _keys(ledger.expected_staging_keys(),
                                                        "expected_staging_keys")
        return RestartPlan(frozenset(episodes), keep, self._to_drop, self._vanished)

    async def retire_dropped(self) -> frozenset[tuple[str, str, int]]:
        """Retire in the backend every episode RL dropped and lists in
        ``ledger.gym_checkpoint_retirements`` (outside a snapshot). Returns the
        ``(owner_id, rollout_id, attempt)`` retired, for RL to record."""
        ledger = self._current_ledger()
        method = getattr(ledger, "gym_checkpoint_retirements", None)
        if method is None:
            return frozenset()
        listed = _inventory(method(frozenset(self.owners)), "gym_checkpoint_retirements")
        triples = frozenset((owner, rid, att) for owner, eps in listed.items()
                            for rid, att in eps)
        if triples:
            await self.checkpoint.retire([EnvironmentEpisode(rid, att)
                                          for _, rid, att in triples])
        return triples

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

    def _ledger_inventory(self, also_named: bool = False
                          ) -> tuple[Any, dict[str, tuple[tuple[str, int], ...]]]:
        """The current ledger, and its inventory of this backend's owners, checked; with
        ``also_named``, of every owner the ledger names too (a restored ledger's owners
        may be gone: ``_owners_named``)."""
        ledger = self._current_ledger()
        owners = frozenset(self.owners)
        if also_named:
            owners |= _owners_named(ledger)
        return ledger, _inventory(ledger.gym_checkpoint_inventory(owners),
                                  "gym_checkpoint_inventory")

    async def _cut_view(self, cut: Any, deadline: float | None) -> NemoRlCut:
        ledger, inventory = self._ledger_inventory()
        expected: dict[str, set[EnvironmentEpisode]] = {}
        for owner, pairs in inventory.items():
            instance = self._instance_of(owner)
            expected.setdefault(instance, set()).update(
                EnvironmentEpisode(rid, att) for rid, att in pairs)
        method = getattr(ledger, "gym_checkpoint_retirements", None)
        retiring = {} if method is None else _inventory(
            method(frozenset(self.owners)), "gym_checkpoint_retirements")
        self._retirements = frozenset(p for pairs in retiring.values() for p in pairs)
        staging = await self._list_staging(deadline)
        cut.require_live()  # the listing awaited: the cut must still hold what it says
        retained = _keys(ledger.expected_staging_keys(), "expected_staging_keys")
        return NemoRlCut(
            cut, {inst: frozenset(eps) for inst, eps in expected.items()}, staging,
            frozenset(rid for pairs in inventory.values() for rid, _ in pairs), retained)

    def _instance_of(self, owner: str) -> str:
        try:
            return self.owners[owner]
        except KeyError:
            raise TypeError(f"RL's ledger names owner {owner!r}, which owners= does not "
                            f"map to an instance; add it") from None

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
        return _keys(listed, "the staging listing")

    async def _hand_over(self, inner: RestoredEnvironmentRollouts, path: Path | str
                         ) -> tuple[RestoredEnvironmentRollouts,
                                    frozenset[tuple[str, str, int]]]:
        """The restored attempts in owner ids that the loaded ledger continues with the
        rows they reference, and the restored sessions it does not (dropped). The
        rollouts of owners gone since the snapshot are warned of once (``_vanished``)."""
        _, inventory = self._ledger_inventory(also_named=True)
        owner_of = {(rid, att): owner for owner, pairs in inventory.items()
                    for rid, att in pairs}
        vanished = frozenset((owner, rid, att) for owner, pairs in inventory.items()
                             if owner not in self.owners for rid, att in pairs)
        if vanished and vanished != self._vanished:
            self._vanished = vanished
            gone = sorted({owner for owner, _, _ in vanished})
            named = sorted(f"{rid}@{att}" for _, rid, att in vanished)
            log.warning(
                "restore from %s: RL's ledger gives %d turn-level rollout(s) to Gym "
                "owner(s) %s, which owners= no longer names; they start over: %s%s",
                path, len(vanished), ", ".join(gone), ", ".join(named[:20]),
                "" if len(named) <= 20 else f" (and {len(named) - 20} more: "
                                            f"RestartPlan.vanished)")
        handed: set[tuple[str, str, int]] = set()
        dropped: set[tuple[str, str, int]] = set()
        for instance, rid, att in inner.continued_attempts:
            owner = owner_of.get((rid, att))
            if owner is not None and self.owners.get(owner) == instance:
                handed.add((owner, rid, att))
            else:
                dropped.add((instance, rid, att))
        keys = frozenset(inner.staging_keys) if handed else frozenset()
        if dropped and handed:  # their rows are RL's to clear: the shards' indexes say which
            keys -= await self._blocking(_rows_of_dropped, path, handed, dropped)
        return (RestoredEnvironmentRollouts(continued_attempts=frozenset(handed),
                                            staging_keys=keys),
                frozenset(dropped))


def _owners_named(ledger: Any) -> frozenset[str]:
    """Every Gym owner the current attempts of the ledger's groups name (NeMo RL's
    ``groups()``, each attempt's ``gym_instance_id``); none when it has no ``groups``.
    The inventory raises for an owner it is not asked about, and a restored ledger may
    name owners this job no longer has."""
    groups = getattr(ledger, "groups", None)
    if not callable(groups):
        return frozenset()
    named: set[str] = set()
    for record in groups():
        for sibling in getattr(record, "siblings", ()):
            for attempt in list(getattr(sibling, "attempts", ()))[-1:]:
                owner = getattr(attempt, "gym_instance_id", None)
                if isinstance(owner, str) and owner:
                    named.add(owner)
    return frozenset(named)


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


async def _call(listing: StagingListing) -> Iterable[str]:
    return await listing()


async def _enter(manager: Any, limit: float | None, what: str) -> Any:
    """Enter ``manager`` within ``limit`` seconds; a missed deadline cancels the entry
    (which aborts the operation on every holder) and is ``BackendUnavailableError``.

    The entry runs in the caller's task, not in one of ``asyncio.wait_for``'s (before
    Python 3.12 it runs the entry in a task of its own): ``_entered`` exits it in the
    caller's, and what the entry set in its context (the operation's tracing span)
    must be reset in the same context, or OpenTelemetry logs "Failed to detach
    context" at every snapshot and restore with a deadline."""
    if limit is None:
        return await manager.__aenter__()
    task = asyncio.current_task()
    assert task is not None  # an ``async`` method runs in a task
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(max(0.0, limit), expire)
    try:
        return await manager.__aenter__()
    except asyncio.CancelledError:
        if not expired:
            raise  # the caller's own cancellation
        raise BackendUnavailableError(
            f"{what} did not get past its preparation within the caller's deadline of "
            f"{limit}s; it was aborted on every holder and nothing changed: retry") from None
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


def _keys(found: object, what: str) -> frozenset[str]:
    if isinstance(found, (str, bytes)) or not isinstance(found, Collection | Iterable):
        raise TypeError(f"{what} returned {type(found).__name__}, not a set of staging "
                        f"row keys (str)")
    keys = frozenset(found)
    if any(not isinstance(k, str) for k in keys):
        raise TypeError(f"{what} returned a key that is not a str")
    return keys


def _inventory(found: object, what: str) -> dict[str, tuple[tuple[str, int], ...]]:
    """A ledger's per-owner ``(rollout_id, attempt)`` listing, checked."""
    if not isinstance(found, Mapping):
        raise TypeError(f"the ledger's {what}() returned {type(found).__name__}, not a "
                        f"mapping of owner id -> ((rollout_id, attempt), ...)")
    checked: dict[str, tuple[tuple[str, int], ...]] = {}
    for owner, pairs in found.items():
        if not isinstance(owner, str) or not isinstance(pairs, Iterable):
            raise TypeError(f"the ledger's {what}() holds {owner!r}: {pairs!r}")
        items = tuple(pairs)
        if len(items) > _MAX_INVENTORY:
            raise TypeError(f"the ledger's {what}() lists {len(items)} episodes for "
                            f"{owner!r}, more than {_MAX_INVENTORY}")
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], int) and not isinstance(item[1], bool)):
                raise TypeError(f"the ledger's {what}() lists {item!r} for {owner!r}, not "
                                f"a (rollout_id, attempt) pair")
        checked[owner] = items
    return checked
