"""The plan of one schedule: what a seed draws (the workload's shape and every fault's
time and kind) before anything runs. Each group of draws has its own RNG, so that a new
group leaves every other draw of a seed as it was."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from nemo_ckpt.config import CheckpointConfig

CONFIG = CheckpointConfig(namespace="sim", drain_timeout_s=1.0, lease_s=6.0,
                          phase_timeout_s=3.0, persist_timeout_s=15.0, turn_timeout_s=10.0,
                          sandbox_read_max_entries=10_000)


# Faults aimed at a phase boundary: kill the actor a call arrives at, kill an actor right
# after a file operation returns, cancel the driver's operation as it sends a call. A
# step's call has one name on both sides; ``holder.`` aims at its arrival at a holder,
# the bare name at the coordinator (or, for the calls only holders get, at a holder).
TRIGGERS = {
    "kill_at": ["holder.begin_snapshot", "holder.start_writes", "finish_writes",
                "holder.commit_snapshot", "holder.renew",
                "prepare_restore", "commit_restore", "abort_restore", "abort",
                "begin_snapshot", "start_writes", "commit_snapshot", "abort_snapshot",
                "renew"],
    "kill_after_io": ["write_held_shard", "write_manifest", "load_shard", "read_manifest",
                      "remove_snapshot_files", "remove_unreferenced_files", "persist",
                      "prepare_restore", "commit_restore", "collect_quietly"],
    "cancel_at": ["begin_snapshot", "start_writes", "commit_snapshot", "renew",
                  "prepare_restore", "commit_restore"],
}

# The apparent size of the sparse file a turn makes (``Plan.sparse``).
SPARSE_BYTES = 32 << 20


@dataclass(frozen=True)
class NemoGroup:
    """One prompt group of a NeMo RL schedule (``Plan.nemo_groups``): a sibling per
    instance, as ``nemo_ckpt.testing.nemo_rl``'s ledger records it."""

    granularity: str  # RecoveryGranularity: "sibling" or "prompt_group"
    level: str  # RecoveryTargetLevel: "turn" or "sibling"
    # Sealed, the group is published for training (it leaves the ledger; its rows stay
    # staged) and trained this many seconds later; None: it stays sealed in the ledger.
    train_after: float | None


@dataclass
class Plan:
    """What a seed draws: the workload, then the faults."""

    seed: int
    nodes: int
    rollouts_per_node: int
    turns: int
    ops: list[str]  # "snap:A", "snap:B", "restore"
    faults: list[tuple[float, str]]  # (when, kind)
    triggers: list[tuple[str, str, int]]  # (kind, method or function, at its n-th call)
    second_driver: list[float]  # when a second driver in the namespace snapshots
    io_fail: float
    io_tear: float
    slow_reads: bool
    bad_cut: float
    catch_mismatch: bool
    raise_in_restore: bool
    sandboxes: bool
    clock_skew_s: float
    disk_after: float  # chance a write or removal raises after it happened
    disk_read_fail: float  # chance a read raises EIO
    enospc: list[tuple[float, float]]  # (from, seconds): every write finds the disk full
    long_save: bool  # RL's own save inside the block outlasts a lease
    gc_every: float  # a gc process collects the store every ~this many seconds (0: none)
    retention: list[float]  # when a user's script removes the oldest committed snapshot
    second_job: list[float]  # when another job claims a path of this one
    hostile: float  # chance a file being scanned is swapped by the sandbox's own process
    sparse: bool  # a turn makes a sparse file
    damage: str | None  # a copy of a committed manifest, damaged: "huge" or "nested"
    # Ray as it behaves (issue 29), drawn apart too (``_ray_plan``):
    slow_death: bool  # callers learn of a death late; the name points at the dead
    detect_s: float  # seconds of a stall after which Ray declares the stalled dead
    stalls: list[tuple[float, str, float]]  # (when, "coordinator" or "node", seconds)
    stall_manifest: int | None  # the coordinator stalls after its n-th manifest rename
    coordinator_node_dies: float | None  # when the coordinator and its node's holders die
    turn_limit: int | None  # a holder's concurrent calls in its (turn) group
    successor_config: str | None  # a restarted driver's config: "lease" or "mismatch"
    # The driver's own releases of the holders (issue 26), drawn apart (``_release_plan``):
    release_link: str | None  # each one "slow" (past the commit), "lost" or "twice"
    release_kill: int | None  # the driver dies as it sends its n-th one
    # The rollouts run a text environment through nemo_ckpt.adapters (issue 28), in a
    # quarter of the schedules without sandboxes; drawn apart, last.
    adapted: bool = False
    # In half the adapted schedules, the answer to a session's open travels slowly
    # (issue 56): a snapshot's pause lands between AdaptedRollout.start's open and its
    # init turn, capturing the session with no turns; drawn apart.
    slow_open: bool = False
    # Untrusted stored data (issue 34), drawn apart, in sandbox schedules only: the first
    # rollout of each node has an id this long (near and past what a file name holds),
    # and a hostile writer plants a tree that expands to 2^30 directories in a copy of a
    # committed snapshot.
    long_id: int | None = None
    tree_bomb: bool = False
    # At-most-once delivery (issue 34): the chance that the answer of any call that ran
    # is lost on its way back; drawn apart, after the others.
    reply_loss: float = 0.0
    # A conditional store write (a claim's create or renewal, the collection claim, a
    # commit number, the manifest) that lands and then errors, as a bucket's client
    # retry makes it (issue 34): the chance of each, drawn apart, last.
    disk_landed: float = 0.0
    # The driver's snapshots and restores run through nemo_ckpt.integrations.nemo_rl
    # with NeMo RL's shape of ledger, cut and staging listing (issue 36); drawn apart.
    nemo_rl: bool = False
    # The driver's snapshots are a RolloutCheckpointManager's (its names, its check, its
    # retention keeping the newest two), in half the nemo_rl schedules; drawn apart.
    manager: bool = False
    # Hostile files in the root (issue 50), drawn apart: a FIFO planted as the manifest
    # of a folder of its own ("fifo"), or a link there to a FIFO elsewhere ("link"); and,
    # in manager schedules, the first committed snapshot's record nested 100,000 deep,
    # and when a second job's manager on the same root runs its retention (its sweep).
    planted: str | None = None
    record_bomb: bool = False
    second_manager: list[float] = field(default_factory=list)
    # The live coordinator stops answering for a long while, never declared dead (a
    # loaded machine; issue 56, case 2): (when, seconds), drawn apart; None: it does not.
    hang: tuple[float, float] | None = None
    # NeMo RL's recovery objects (issue 52), in the nemo_rl schedules, drawn apart: a
    # prompt group per rollout of a node (its granularity, restore level, publication),
    # the ledger's revision (schema 4 alone, or with its retirement queue), and how long
    # a finished rollout's reply travels to RL before RL seals it (a cut meets some
    # finished in the environment, not sealed: the integration's drain= seals them).
    nemo_groups: list[NemoGroup] = field(default_factory=list)
    retirement_queue: bool = False
    seal_delay: float = 0.0

    @classmethod
    def make(cls, seed: int) -> Plan:
        rng = random.Random(f"plan-{seed}")
        ops = [rng.choice(["snap:A", "snap:A", "snap:B"]) for _ in range(rng.randint(2, 5))]
        if rng.random() < 0.5:  # after two snapshots, so that one has likely committed
            ops.insert(rng.randint(2, len(ops)), "restore")
        kinds = ["kill_holder", "kill_coordinator", "cancel_op", "cancel_op", "kill_driver",
                 "cancel_rollout", "cancel_rollout", "kill_worker", "clock_jump_holder",
                 "clock_jump_coordinator", "kill_node"]
        faults = sorted((round(rng.uniform(0.2, 9.0), 3), rng.choice(kinds))
                        for _ in range(rng.choice([0, 1, 1, 2, 2, 3])))
        triggers = []
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            kind = rng.choice(sorted(TRIGGERS))
            triggers.append((kind, rng.choice(TRIGGERS[kind]), rng.randint(1, 3)))
        plan = cls(
            seed=seed, nodes=rng.choice([2, 3]), rollouts_per_node=rng.randint(1, 3),
            turns=rng.randint(2, 5), ops=ops, faults=faults, triggers=triggers,
            second_driver=sorted(round(rng.uniform(0.2, 6.0), 3)
                                 for _ in range(rng.choice([0, 0, 0, 0, 1, 2]))),
            io_fail=rng.choice([0.0, 0.0, 0.0, 0.15]),
            io_tear=rng.choice([0.0, 0.0, 0.0, 0.0, 0.1]),
            slow_reads=rng.random() < 0.15,
            bad_cut=rng.choice([0.0, 0.0, 0.25]),
            catch_mismatch=rng.random() < 0.5,
            raise_in_restore=rng.random() < 0.15,
            # Its own draw: the plans of every other seed stay as they were.
            sandboxes=random.Random(f"sandboxes-{seed}").random() < 0.2,
            clock_skew_s=random.Random(f"skew-{seed}").choice([0.0, 60.0, 3 * 3600.0]),
            **_world_plan(seed), **_ray_plan(seed), **_release_plan(seed),
        )
        plan.adapted = (not plan.sandboxes
                        and random.Random(f"adapted-{seed}").random() < 0.25)
        plan.slow_open = plan.adapted and random.Random(f"slow-open-{seed}").random() < 0.5
        if plan.sandboxes:
            untrusted = random.Random(f"untrusted-{seed}")
            plan.long_id = untrusted.choice([None] * 4 + [200, 216, 217, 233, 254])
            plan.tree_bomb = untrusted.random() < 0.25
        plan.reply_loss = random.Random(f"reply-loss-{seed}").choice(
            [0.0, 0.0, 0.0, 0.005, 0.02, 0.05])
        plan.disk_landed = random.Random(f"landed-{seed}").choice([0.0, 0.0, 0.0, 0.2])
        plan.nemo_rl = random.Random(f"nemo-rl-{seed}").random() < 0.25
        plan.manager = plan.nemo_rl and random.Random(f"manager-{seed}").random() < 0.5
        plan.planted = random.Random(f"planted-{seed}").choice([None] * 6 + ["fifo", "link"])
        plan.record_bomb = plan.manager and random.Random(f"record-{seed}").random() < 0.5
        if plan.manager:
            beside = random.Random(f"second-manager-{seed}")
            plan.second_manager = sorted(round(beside.uniform(0.5, 9.0), 3)
                                         for _ in range(beside.choice([0, 2, 4, 8])))
        hang = random.Random(f"hang-{seed}")
        if hang.random() < 0.1:
            plan.hang = (round(hang.uniform(0.3, 9.0), 3), round(hang.uniform(30.0, 120.0), 3))
        if plan.turn_limit is not None:  # more turns waiting at a gate than slots
            plan.rollouts_per_node = max(plan.rollouts_per_node, plan.turn_limit
                                         + random.Random(f"turns-{seed}").randint(1, 3))
        if plan.nemo_rl:
            plan.nemo_groups, plan.retirement_queue, plan.seal_delay = _nemo_rl_plan(
                seed, plan.rollouts_per_node)
        return plan


def _nemo_rl_plan(seed: int, groups: int) -> tuple[list[NemoGroup], bool, float]:
    """NeMo RL's recovery states a schedule's RL goes through (issue 52), drawn apart."""
    rng = random.Random(f"nemo-rl-ledger-{seed}")
    made = [NemoGroup(granularity=rng.choice(["sibling", "sibling", "prompt_group"]),
                      level=rng.choice(["turn", "turn", "turn", "sibling"]),
                      train_after=rng.choice([None, round(rng.uniform(0.2, 8.0), 3)]))
            for _ in range(groups)]
    return made, rng.random() < 0.5, rng.choice([0.0, 0.5, 2.0, 6.0])


def _world_plan(seed: int) -> dict[str, Any]:
    """The faults of the world outside the protocol's model (issue 23), drawn apart so
    that every other draw of a seed stays as it was."""
    rng = random.Random(f"world-{seed}")
    enospc = []
    if rng.random() < 0.2:
        enospc.append((round(rng.uniform(0.5, 9.0), 3), round(rng.uniform(2.0, 9.0), 3)))
    return dict(
        disk_after=rng.choice([0.0, 0.0, 0.0, 0.05]),
        disk_read_fail=rng.choice([0.0, 0.0, 0.0, 0.0, 0.02]),
        enospc=enospc,
        long_save=rng.random() < (0.6 if enospc else 0.15),
        gc_every=rng.choice([0.0, 0.0, 1.0, 2.5]),
        retention=sorted(round(rng.uniform(1.0, 9.0), 3)
                         for _ in range(rng.choice([0, 0, 1, 2]))),
        second_job=sorted(round(rng.uniform(0.5, 9.0), 3)
                          for _ in range(rng.choice([0, 0, 0, 1]))),
        hostile=rng.choice([0.0, 0.0, 0.0, 0.1]),
        sparse=rng.random() < 0.05,
        damage=rng.choice([None] * 20 + ["huge", "nested"]),
    )


def _ray_plan(seed: int) -> dict[str, Any]:
    """What real Ray does that an ideal transport does not (issue 29): deaths noticed
    late, stalled nodes declared dead that run again, concurrency limits, a restarted
    driver with another config."""
    rng = random.Random(f"ray-{seed}")
    detect = round(rng.uniform(1.0, 4.0), 3)
    stalls = sorted((round(rng.uniform(0.3, 9.0), 3), rng.choice(["coordinator", "node"]),
                     round(rng.uniform(0.3, 10.0), 3))
                    for _ in range(rng.choice([0, 0, 0, 0, 1, 1, 2])))
    return dict(
        slow_death=rng.random() < 0.5,
        detect_s=detect,
        stalls=stalls,
        stall_manifest=rng.choice([None, None, None, 1, 1, 2]),
        turn_limit=rng.choice([None] * 6 + [2, 3, 4]),
        successor_config=rng.choice([None] * 6 + ["lease", "lease", "mismatch"]),
        coordinator_node_dies=random.Random(f"ray-node-{seed}").choice(
            [None] * 6 + [round(random.Random(f"ray-at-{seed}").uniform(0.3, 9.0), 3)]),
    )


def _release_plan(seed: int) -> dict[str, Any]:
    """Faults on the releases a driver sends the holders itself as its block exits,
    beside its commit (issue 26): late enough to meet the next snapshot's pause, lost,
    duplicated, or the driver dying between its releases and the coordinator's."""
    rng = random.Random(f"release-{seed}")
    return dict(
        release_link=rng.choice([None] * 5 + ["slow", "lost", "twice"]),
        release_kill=rng.choice([None] * 9 + [1, 2]),
    )
