"""A restore's plan, apart from any I/O: where instances go, which shards each holder
reads, and whether what the holders read may go live.

The coordinator (``actors.coordinator.actor``) reads the manifest, asks the holders to read
their shards, and hands what they report here; each function is a pure decision, so
the whole plan is tested without actors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from nemo_ckpt.errors import BackendUnavailableError, RestoreConflictError, ShardCorruptedError
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.phases import RestorePrepared, ShardRef, instance_sort_key
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.storage.shards import shard_problems

__all__ = ["CONFLICT_FIX", "VerifiedRestore", "assign_shards", "conflict_error", "holder_said",
           "least_loaded_node", "place_instances", "verify_prepared"]


def least_loaded_node(alive_nodes: Iterable[str], holder_nodes: Iterable[str]) -> str:
    """The alive node that hosts the fewest holders (ties: the smallest id)."""
    load = {n: 0 for n in alive_nodes}
    for node in holder_nodes:
        if node in load:
            load[node] += 1
    if not load:
        raise BackendUnavailableError("no alive Ray node to place a holder on")
    return min(load, key=lambda n: (load[n], n))


def place_instances(instances: Iterable[str], alive_nodes: Sequence[str],
                    holder_nodes: Iterable[str]) -> list[tuple[str, str]]:
    """Where each of ``instances`` (holders to create, in order) goes: each on the least
    loaded alive node, counting the holders already there and those placed before it,
    so that all can be created at once."""
    hosted = list(holder_nodes)
    placed = []
    for inst in instances:
        node = least_loaded_node(alive_nodes, hosted)
        hosted.append(node)
        placed.append((inst, node))
    return placed


def assign_shards(shards: Iterable[ShardRef], instances: Iterable[str],
                  checkpoint_path: str) -> dict[str, list[ShardRef]]:
    """Each placed instance's shards (``shards``: the manifest's, as the wire carries
    them); refused if a shard's instance has no holder."""
    shards_of: dict[str, list[ShardRef]] = {i: [] for i in instances}
    for shard in shards:
        if shard.instance_id not in shards_of:
            raise BackendUnavailableError(
                f"no holder could be placed for instance {shard.instance_id} of "
                f"{checkpoint_path}; retry once the cluster has a node for it")
        shards_of[shard.instance_id].append(shard)
    return shards_of


# What to do about a restore's rollouts that are live: said by every RestoreConflictError.
CONFLICT_FIX = (
    "holders are detached actors that outlive their driver, so these are most likely "
    "sessions of the job that crashed or of its old driver. Fix: shut the namespace's "
    "actors down and wait until they are gone (`await RayEnvironmentCheckpoint(config)"
    ".shutdown(wait=True)`), then restore with a new RayEnvironmentCheckpoint; or, if "
    "those sessions are this job's own, retire or close them first")
_SHOWN = 10  # rollouts named per holder


# How a holder's refusal of live sessions ends; ``CONFLICT_FIX`` says it, and more.
_HOLDER_FIX = "; retire or close them first, or restore into a fresh job"


def holder_said(instance_id: str, error: BaseException) -> str:
    """A holder's own conflict message, without the instance id it starts with and
    without the fix ``CONFLICT_FIX`` gives (a fix of another conflict, say a directory
    in the way, stays)."""
    text = str(error)
    text = text[len(instance_id) + 2:] if text.startswith(f"{instance_id}: ") else text
    return text[:-len(_HOLDER_FIX)] if text.endswith(_HOLDER_FIX) else text


def conflict_error(checkpoint_path: str, live: Mapping[str, Sequence[str]]
                   ) -> RestoreConflictError:
    """The refusal of a restore whose rollouts are live now: every holder where they
    are (``live``: instance -> its rollouts, or what the holder said), and the fix."""
    holders = sorted(live, key=instance_sort_key)
    found = "; ".join(
        f"{inst}: {', '.join(live[inst][:_SHOWN])}"
        f"{f' and {len(live[inst]) - _SHOWN} more' if len(live[inst]) > _SHOWN else ''}"
        for inst in holders)
    return RestoreConflictError(
        f"cannot restore {checkpoint_path}: rollouts it holds are live now on "
        f"{len(holders)} holder(s), {', '.join(holders)} ({found}); {CONFLICT_FIX}")


@dataclass(frozen=True)
class VerifiedRestore:
    """What a prepared restore will continue, once every check passed."""

    continued_attempts: frozenset[tuple[str, str, int]]  # (instance, rollout, attempt)
    staging_keys: frozenset[str]
    bytes_read: int
    read_seconds: float  # the slowest holder's shard reads
    finished: tuple[FinishedRollout, ...] = ()  # installed as captured, not continued


def verify_prepared(listed: Mapping[str, Mapping[str, int]] | None, directory: str,
                    checkpoint_path: str,
                    prepared: Mapping[str, RestorePrepared]) -> VerifiedRestore:
    """Check what the holders read against the manifest, shard by shard (the check
    ``nemo-ckpt verify`` makes), that no rollout goes live twice, and that none of them
    is live now on any holder. ``listed``: the rollouts the manifest lists per shard
    file (``rollouts_by_shard``; None for format 3 and later, which list none). Raises
    ``ShardCorruptedError`` or ``RestoreConflictError``, naming every problem found."""
    by_shard = {p.instance_id: p.sessions_by_shard() for p in prepared.values()}
    problems = [problem for shards in by_shard.values() for file, sessions in shards
                for problem in shard_problems(
                    None if listed is None else listed.get(file, {}), sessions,
                    f"{directory}/{file}")]
    continued = {inst: [pair for _, pairs in shards for pair in pairs]
                 for inst, shards in by_shard.items()}
    restored = [rid for pairs in continued.values() for rid, _ in pairs]
    finished = tuple(sorted(
        (FinishedRollout(p.instance_id, EnvironmentEpisode(rid, att), result)
         for p in prepared.values() for rid, att, result in p.finished_results()),
        key=lambda f: (f.instance_id, f.episode)))
    done = {(f.instance_id, f.episode.rollout_id) for f in finished}
    if len(set(restored)) != len(restored):
        twice = sorted(r for r, n in Counter(restored).items() if n > 1)
        problems.append(f"rollouts held by two shards of {directory}: {twice[:10]}; "
                        f"restore an earlier checkpoint")
    if problems:
        raise ShardCorruptedError(directory, "; ".join(problems))
    # Nothing is live yet: a rollout live on any holder refuses the whole restore.
    restoring = set(restored)
    clash: dict[str, list[str]] = {}
    for p in prepared.values():
        live = sorted(rid for rid in p.live() if rid in restoring)
        if live:
            clash[p.instance_id] = live
    if clash:
        raise conflict_error(checkpoint_path, clash)
    return VerifiedRestore(
        continued_attempts=frozenset(
            (inst, rid, attempt) for inst, pairs in continued.items()
            for rid, attempt in pairs if (inst, rid) not in done),
        finished=finished,
        staging_keys=frozenset().union(*(p.staging_keys for p in prepared.values())),
        bytes_read=sum(p.bytes_read for p in prepared.values()),
        read_seconds=max((p.read_seconds for p in prepared.values()), default=0.0),
    )
