"""Reading NeMo RL's recovery ledger for ``nemo_ckpt.integrations.nemo_rl``: its
listings checked, and what its records say about the Gym episodes it will drop or has
dropped (issue 52). Duck-typed: nothing of NeMo RL is imported.

A record is read through the attributes NeMo RL's ``groups()`` copies have (schema 4;
docs/NEMO_RL.md): ``status``, ``recovery_granularity``, ``restore_level``, ``siblings``,
each sibling's ``generation_index`` and ``attempts`` (the current one last), each
attempt's ``status``, ``gym_instance_id``, ``gym_attempt`` and ``attempt_id``, and the
record's ``gym_episode(i)`` and ``logical_rollout_id(i)``. A record that lacks one is
skipped: what it would have named is then left as the ledger leaves it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

__all__ = ["DroppedEpisodes", "abandoned_whole", "dropped_attempts", "inventory", "keys",
           "known_rollouts", "owners_named", "records", "unowned_episodes"]

# What one owner's inventory may hold before it is refused: a claim to bound, as any.
_MAX_INVENTORY = 10_000_000

# The ledger's refusal of restored episodes it did not continue (the changes before it
# are made), and the list of triples it names.
_UNOWNED = "Gym restored episodes are not owned by dispatched turn-level rollouts:"

Triple = tuple[str, str, int]


def _value(field: object) -> object:
    """An enum member's value (NeMo RL's str enums), or the field itself."""
    return getattr(field, "value", field)


def records(ledger: Any) -> list[Any] | None:
    """The ledger's group records (``groups()``, read once per use: it copies them), or
    None when it has no ``groups``."""
    method = getattr(ledger, "groups", None)
    return list(method()) if callable(method) else None


def _episodes(record: Any) -> Iterator[tuple[Any, bool, str, int]]:
    """Each attempt of each sibling of ``record``: (attempt, is current, rollout id,
    Gym attempt). The current attempt's id is the record's own ``gym_episode``; an
    earlier one's is NeMo RL's ``<logical id>_a<attempt id>``."""
    for sibling in getattr(record, "siblings", ()):
        index = sibling.generation_index
        attempts = list(sibling.attempts)
        for position, attempt in enumerate(attempts):
            current = position == len(attempts) - 1
            if current:
                rollout_id, gym_attempt = record.gym_episode(index)
            else:
                rollout_id = f"{record.logical_rollout_id(index)}_a{attempt.attempt_id}"
                gym_attempt = attempt.gym_attempt
            yield attempt, current, str(rollout_id), int(gym_attempt)


def abandoned_whole(groups: list[Any] | None) -> frozenset[tuple[str, int]]:
    """The ``(rollout_id, attempt)`` of the current attempts of every generating group
    of PROMPT_GROUP granularity: ``prepare_for_restart`` abandons such a group whole,
    whatever its level, and refuses every restored episode of it (issue 52, point 1)."""
    found: set[tuple[str, int]] = set()
    for record in groups or ():
        try:
            if (_value(record.status) != "generating"
                    or _value(record.recovery_granularity) != "prompt_group"):
                continue
            found.update((rid, att) for _, current, rid, att in _episodes(record)
                         if current)
        except (AttributeError, TypeError, ValueError, RuntimeError):
            continue
    return frozenset(found)


def dropped_attempts(groups: list[Any] | None) -> frozenset[Triple]:
    """``(owner, rollout_id, attempt)`` of every attempt the ledger's records show
    dropped that had a Gym owner: a current attempt abandoned or failed, or one a
    retry replaced. Whether its session reached Gym is not recorded at schema 4:
    retiring one that did not only refuses its late turns (issue 52, point 2)."""
    found: set[Triple] = set()
    for record in groups or ():
        try:
            for attempt, current, rid, att in _episodes(record):
                owner = attempt.gym_instance_id
                dropped = not current or _value(attempt.status) in ("abandoned", "failed")
                if dropped and isinstance(owner, str) and owner:
                    found.add((owner, rid, att))
        except (AttributeError, TypeError, ValueError, RuntimeError):
            continue
    return frozenset(found)


def known_rollouts(groups: list[Any] | None) -> frozenset[str] | None:
    """Every Gym rollout id the ledger's groups still hold (any attempt), or None when
    it cannot say (no ``groups()``, or a record it cannot read)."""
    if groups is None:
        return None
    found: set[str] = set()
    for record in groups or ():
        try:
            found.update(rid for _, _, rid, _ in _episodes(record))
        except (AttributeError, TypeError, ValueError, RuntimeError):
            return None
    return frozenset(found)


def owners_named(groups: list[Any] | None) -> frozenset[str]:
    """Every Gym owner the current attempts of the ledger's groups name (NeMo RL's
    ``groups()``, each attempt's ``gym_instance_id``); none when it has no ``groups``.
    The inventory raises for an owner it is not asked about, and a ledger may name
    owners ``owners=`` does not (a restored one, or a mistake)."""
    named: set[str] = set()
    for record in groups or ():
        for sibling in getattr(record, "siblings", ()):
            for attempt in list(getattr(sibling, "attempts", ()))[-1:]:
                owner = getattr(attempt, "gym_instance_id", None)
                if isinstance(owner, str) and owner:
                    named.add(owner)
    return frozenset(named)


def unowned_episodes(error: ValueError) -> frozenset[Triple] | None:
    """The triples the ledger's ``prepare_for_restart`` names as not continued, or None
    when ``error`` is not that refusal or its list does not read."""
    text = str(error)
    if not text.startswith(_UNOWNED):
        return None
    match = re.fullmatch(r"\s*(\[.*\])\s*", text[len(_UNOWNED):], flags=re.S)
    if match is None:
        return None
    try:
        listed = ast.literal_eval(match.group(1))
    except (ValueError, SyntaxError):
        return None
    if not isinstance(listed, list) or not all(
            isinstance(t, tuple) and len(t) == 3 and isinstance(t[0], str)
            and isinstance(t[1], str) and isinstance(t[2], int) for t in listed):
        return None
    return frozenset(listed)


def keys(found: object, what: str) -> frozenset[str]:
    """A set of staging row keys, checked."""
    if isinstance(found, (str, bytes)) or not isinstance(found, Collection | Iterable):
        raise TypeError(f"{what} returned {type(found).__name__}, not a set of staging "
                        f"row keys (str)")
    listed = frozenset(found)
    if any(not isinstance(k, str) for k in listed):
        raise TypeError(f"{what} returned a key that is not a str")
    return listed


def inventory(found: object, what: str) -> dict[str, tuple[tuple[str, int], ...]]:
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


class DroppedEpisodes:
    """Which Gym episodes the ledger dropped while Gym may still hold their sessions,
    with or without its retirement queue (issue 52, point 2): the queue's (newer
    revisions), the attempts its records show dropped (``dropped_attempts``), and the
    rollouts once seen in its inventory whose group has left it (published or
    discarded: schema 4 keeps no record of them). What was sent to be retired is not
    sent again while the ledger still shows it dropped."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], str] = {}  # (rollout, attempt) -> owner
        self._sent: frozenset[Triple] = frozenset()

    def saw(self, listed: Mapping[str, Iterable[tuple[str, int]]]) -> None:
        """An inventory read: what Gym holds for RL now."""
        for owner, pairs in listed.items():
            for pair in pairs:
                self._seen[pair] = owner

    def now(self, groups: list[Any] | None, live: Mapping[str, Iterable[tuple[str, int]]],
            queued: Mapping[str, Iterable[tuple[str, int]]]) -> frozenset[Triple]:
        """Everything dropped now (never what ``live``, the inventory, lists)."""
        found = {(owner, rid, att) for owner, pairs in queued.items() for rid, att in pairs}
        found |= dropped_attempts(groups)
        known = known_rollouts(groups)
        if known is not None:
            found |= {(owner, rid, att) for (rid, att), owner in self._seen.items()
                      if rid not in known}
        held = {pair for pairs in live.values() for pair in pairs}
        return frozenset(t for t in found if (t[1], t[2]) not in held)

    def to_send(self, dropped: frozenset[Triple], queued: frozenset[Triple]
                ) -> frozenset[Triple]:
        """What to retire: the queue's, and what was not sent already."""
        return (dropped - self._sent) | queued

    def sent(self, dropped: frozenset[Triple], sent: frozenset[Triple]) -> None:
        """``sent`` was retired: remember it while the ledger shows it dropped, and
        forget what was seen of groups that have left the ledger."""
        self._sent = (self._sent | sent) & dropped
        gone = {(rid, att) for _, rid, att in sent}
        for pair in gone:
            self._seen.pop(pair, None)
