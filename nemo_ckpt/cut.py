"""The data-plane cut, and the check of a backend capture against it.

RL's real cut (``DataPlaneMutationCut``) fits the protocol below through a thin adapter.
The check is a pure function, so it is tested without Ray and reused by every backend.

The check holds only if both sides keep one rule: RL records a dispatch in its ledger
before the environment opens the session, and every staging row an environment worker
writes is written inside a turn, before the turn commits. A turn in flight holds the
pause's drain, so after the pause and the barrier the cut holds everything that the
captured sessions reference.

A finished session (its result handed in, not yet acknowledged: ``nemo_ckpt.receipts``)
is accepted whether RL's ledger still expects it (RL has not recorded the finish yet) or
no longer has an unfinished attempt of its rollout (RL recorded it, and may have moved
its staging rows out of staging): its rows are not required in the cut.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from nemo_ckpt.errors import SnapshotMismatchError

# The cut's Protocols are the contract's (``nemo_ckpt.interfaces``), named here too.
from nemo_ckpt.interfaces import DataPlaneMutationCut, EnvironmentEpisode, ScopedCut
from nemo_ckpt.session_record import row_is_finished

__all__ = [
    "DataPlaneMutationCut",
    "ScopedCut",
    "Difference",
    "CutCheckResult",
    "check_capture_against_cut",
    "check_rows_against_cut",
    "CapturedRow",
]


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
        finished: ``(instance_id, episode)`` of the captured sessions whose rollout was
            handed in as finished, not yet acknowledged: a restore hands their results
            back to RL.
        outside_scope: ``(instance_id, episode)`` of the sessions held (captured or
            mid-turn) whose rollout a ``ScopedCut`` does not name: not checked, and
            started over by RL after a crash.
    """

    not_held: frozenset[tuple[str, EnvironmentEpisode]]
    restarting: frozenset[tuple[str, EnvironmentEpisode]]
    orphan_staging_keys: frozenset[str]
    finished: frozenset[tuple[str, EnvironmentEpisode]] = frozenset()
    outside_scope: frozenset[tuple[str, EnvironmentEpisode]] = frozenset()


# One captured session as a holder reports it: (rollout_id, attempt, staging keys, turns,
# earlier keys[, True once finished]); the turns and earlier keys are ignored here.
CapturedRow = Sequence[Any]


def check_capture_against_cut(
    cut: DataPlaneMutationCut,
    captured: Mapping[str, Mapping[EnvironmentEpisode, frozenset[str]]],
    restarting: Mapping[str, frozenset[EnvironmentEpisode]] | None = None,
    finished: Mapping[str, frozenset[EnvironmentEpisode]] | None = None,
) -> CutCheckResult:
    """Check what the backend captured against RL's ledger and staging rows at ``cut``.

    Args:
        cut: The live data-plane cut. A stale cut is refused before anything else.
        captured: Per instance, each captured episode and the staging keys its session
            references (over all its earlier attempts).
        restarting: Per instance, the episodes the backend holds but did not capture.
        finished: Per instance, which of the captured episodes were handed in as
            finished (``nemo_ckpt.receipts``).

    Returns:
        What passed with a note: episodes not held, restarting, and orphan rows.

    Raises:
        SnapshotMismatchError: listing every difference (see ``Difference.kind``).
        Whatever ``cut.require_live()`` raises for a stale cut.
    """
    done = finished or {}

    def row(inst: str, ep: EnvironmentEpisode, keys: frozenset[str]) -> tuple[Any, ...]:
        finished_flag = (True,) if ep in done.get(inst, ()) else ()
        return (ep.rollout_id, ep.attempt, keys, 0, [], *finished_flag)

    rows = {inst: [row(inst, ep, keys) for ep, keys in sessions.items()]
            for inst, sessions in captured.items()}
    mid_turn = {inst: [(ep.rollout_id, ep.attempt) for ep in eps]
                for inst, eps in (restarting or {}).items()}
    return check_rows_against_cut(cut, rows, mid_turn)


def check_rows_against_cut(
    cut: DataPlaneMutationCut,
    captured: Mapping[str, Iterable[CapturedRow]],
    restarting: Mapping[str, Iterable[tuple[str, int]]] | None = None,
) -> CutCheckResult:
    """``check_capture_against_cut`` on the rows holders report, at set speed.

    The check runs on whole sets, in C: the captured (instance, rollout, attempt) set
    against the expected one, the union of referenced keys against the cut's, the
    rollout ids for duplicates. Only when a difference exists does it go session by
    session to name each one. This runs while the backend is paused and RL's data plane
    is frozen, so its cost is the pause's (benchmarks/README.md, "the cut check").
    """
    cut.require_live()
    restarting = restarting or {}
    scope = _scope(cut)
    outside: set[tuple[str, str, int]] = set()
    outside_keys: set[str] = set()
    if scope is not None:
        captured, restarting = _within(scope, captured, restarting, outside, outside_keys)
    expected_eps = _expected_episodes(cut)
    expected = {(inst, ep.rollout_id, ep.attempt)
                for inst, eps in expected_eps.items() for ep in eps}
    cut_rows = _staging_keys(cut)
    held: set[tuple[str, str, int]] = set()
    finished: set[tuple[str, str, int]] = set()
    referenced: set[str] = set()
    kept: set[str] = set()  # rows of finished sessions
    count = 0
    for inst, rows in captured.items():
        rows = list(rows)
        count += len(rows)
        held.update(zip(itertools.repeat(inst), map(itemgetter(0), rows),
                        map(itemgetter(1), rows)))
        # Only a finished session's row is longer: a Python loop only when one is there.
        if rows and max(map(len, rows)) > 5:
            done = [row for row in rows if row_is_finished(row)]
            finished.update((inst, row[0], row[1]) for row in done)
            # Its rows keep it from being an orphan, but the cut need not hold them.
            kept.update(itertools.chain.from_iterable(map(itemgetter(2), done)))
            rows = [row for row in rows if not row_is_finished(row)]
        referenced.update(itertools.chain.from_iterable(map(itemgetter(2), rows)))
    mid_turn = {(inst, rid, att) for inst, pairs in restarting.items() for rid, att in pairs}
    everything = held | mid_turn
    recorded = _recorded_by_rl(finished, expected)
    if len(held) != count or held - expected - recorded or not referenced <= cut_rows \
            or len({rid for _, rid, _ in everything}) != len(everything):
        _raise_differences(cut_rows, expected, captured, mid_turn, recorded)
    return CutCheckResult(
        not_held=frozenset((inst, EnvironmentEpisode(rid, att))
                           for inst, rid, att in expected - everything),
        restarting=frozenset((inst, EnvironmentEpisode(rid, att))
                             for inst, rid, att in mid_turn),
        orphan_staging_keys=frozenset(cut_rows - referenced - kept - outside_keys
                                      - _retained(cut)),
        finished=frozenset((inst, EnvironmentEpisode(rid, att)) for inst, rid, att in finished),
        outside_scope=frozenset((inst, EnvironmentEpisode(rid, att))
                                for inst, rid, att in outside),
    )


def _scope(cut: DataPlaneMutationCut) -> Set[str] | None:
    method = getattr(cut, "rollouts_in_scope", None)
    if method is None:
        return None
    found = method()
    if not _is_collection(found):
        raise _wrong_type("rollouts_in_scope", "a frozenset of rollout ids (str)", found)
    return found if isinstance(found, (set, frozenset)) else frozenset(found)


def _retained(cut: DataPlaneMutationCut) -> Set[str]:
    method = getattr(cut, "retained_staging_keys", None)
    if method is None:
        return frozenset()
    found = method()
    if not _is_collection(found):
        raise _wrong_type("retained_staging_keys", "a frozenset of staging keys (str)", found)
    return found if isinstance(found, (set, frozenset)) else frozenset(found)


def _within(scope: Set[str], captured: Mapping[str, Iterable[CapturedRow]],
            restarting: Mapping[str, Iterable[tuple[str, int]]],
            outside: set[tuple[str, str, int]], outside_keys: set[str],
            ) -> tuple[dict[str, list[CapturedRow]], dict[str, list[tuple[str, int]]]]:
    """The rows whose rollout ``scope`` names; the others' (instance, rollout, attempt)
    go into ``outside`` and the rows they reference into ``outside_keys``."""
    kept: dict[str, list[CapturedRow]] = {}
    for inst, rows in captured.items():
        rows = list(rows)
        # The usual case, every row in scope, is one set comparison at C speed (this
        # runs on the pause's path); the per-row filter only when some are not.
        if set(map(itemgetter(0), rows)) <= scope:
            kept[inst] = rows
            continue
        kept[inst] = [row for row in rows if row[0] in scope]
        if len(kept[inst]) != len(rows):
            for row in rows:
                if row[0] not in scope:
                    outside.add((inst, row[0], row[1]))
                    outside_keys.update(row[2])
    mid_turn: dict[str, list[tuple[str, int]]] = {}
    for inst, pairs in restarting.items():
        mid_turn[inst] = []
        for rid, att in pairs:
            if rid in scope:
                mid_turn[inst].append((rid, att))
            else:
                outside.add((inst, rid, att))
    return kept, mid_turn


def _recorded_by_rl(finished: set[tuple[str, str, int]], expected: set[tuple[str, str, int]]
                    ) -> set[tuple[str, str, int]]:
    """The finished sessions RL's ledger no longer expects in any attempt: RL recorded
    the finish and has not acknowledged it yet."""
    if not finished:
        return set()
    unfinished = {rid for _, rid, _ in expected}
    return {f for f in finished if f[1] not in unfinished}


def _wrong_type(method: str, expected: str, got: object) -> TypeError:
    return TypeError(
        f"the cut's {method}() returned {type(got).__name__}, not {expected}; fix the "
        f"adapter that wraps RL's cut (nemo_ckpt.cut.DataPlaneMutationCut says the types)")


def _is_collection(value: object) -> bool:
    """A set-like collection of items: not text, bytes or a mapping, whose iteration
    would check characters or keys instead."""
    return isinstance(value, Collection) and not isinstance(
        value, (str, bytes, bytearray, memoryview, Mapping))


# The types are checked on the containers and one item each: per-item checks would
# cost the pause a Python loop over every row (a wrong item type still shows up as a
# mismatch naming it).
def _expected_episodes(cut: DataPlaneMutationCut) -> Mapping[str, Collection[EnvironmentEpisode]]:
    found = cut.expected_episodes()
    if not isinstance(found, Mapping):
        raise _wrong_type("expected_episodes", "a mapping of instance id -> episodes", found)
    for inst, eps in found.items():
        if not isinstance(inst, str):
            raise _wrong_type("expected_episodes", "a mapping keyed by instance id (str)",
                              inst)
        if not _is_collection(eps):
            raise _wrong_type("expected_episodes",
                              f"a frozenset of EnvironmentEpisode for {inst!r}", eps)
        for ep in itertools.islice(eps, 1):
            if not isinstance(ep, EnvironmentEpisode):
                raise _wrong_type("expected_episodes",
                                  f"a frozenset of EnvironmentEpisode for {inst!r} (an item "
                                  f"is {type(ep).__name__})", eps)
    return found


def _staging_keys(cut: DataPlaneMutationCut) -> Set[str]:
    found = cut.staging_keys()
    if not _is_collection(found):
        raise _wrong_type("staging_keys", "a frozenset of staging keys (str)", found)
    for key in itertools.islice(found, 1):
        if not isinstance(key, str):
            raise _wrong_type("staging_keys", f"a frozenset of staging keys (str; an item "
                                              f"is {type(key).__name__})", found)
    return found if isinstance(found, (set, frozenset)) else frozenset(found)


def _raise_differences(cut_rows: Set[str], expected: set[tuple[str, str, int]],
                       captured: Mapping[str, Iterable[CapturedRow]],
                       mid_turn: set[tuple[str, str, int]],
                       recorded: set[tuple[str, str, int]]) -> None:
    """Name every difference, session by session; only runs when there is one."""
    expected_at: dict[str, set[tuple[str, int]]] = {}
    for inst, rid, att in expected:
        expected_at.setdefault(rid, set()).add((inst, att))
    differences: list[Difference] = []
    held: dict[str, dict[str, int]] = {}  # rollout id -> {instance: attempt}
    for inst, rows in captured.items():
        for row in rows:
            rid, att, keys = row[0], row[1], row[2]
            ep = EnvironmentEpisode(rid, att)
            if (inst, rid, att) not in expected and (inst, rid, att) not in recorded:
                differences.append(_unexpected(inst, ep, expected_at.get(rid, set())))
            for key in sorted(set(keys) - cut_rows) if not row_is_finished(row) else ():
                differences.append(Difference(
                    "missing_staging_key", inst, rid, att,
                    f"references staging row {key!r}, which the cut does not hold"))
            places = held.setdefault(rid, {})
            if inst in places:
                differences.append(Difference(
                    "duplicate_rollout", inst, rid, att,
                    f"the same rollout is captured twice on {inst}"))
            places[inst] = att
    for inst, rid, att in mid_turn:
        held.setdefault(rid, {})[inst] = att
    for rollout_id, where in held.items():
        if len(where) > 1:
            for inst, attempt in where.items():
                others = sorted(set(where) - {inst})
                differences.append(Difference(
                    "duplicate_rollout", inst, rollout_id, attempt,
                    f"the same rollout is also held on {others}"))
    if differences:
        raise SnapshotMismatchError(tuple(sorted(set(differences))))


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
