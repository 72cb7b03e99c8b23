"""The deterministic simulation: many seeded schedules of the real driver, coordinator and
holders, with environment workers running turns, RL's ledger and barrier, finished
results handed in and acknowledged with no lock against snapshots (completion receipts), a
crash and restore, a second driver, and faults at any await; invariants after each.

Each schedule is a pure function of its seed (``actors.sim``: virtual time, a
seeded transport that delivers an actor's calls in a seeded order, pickled messages,
real files in a temporary folder). Faults: actors killed (holders, the coordinator, the
driver, workers, whole nodes), the driver's operation and workers' rollouts cancelled,
clocks jumping past leases, shard and manifest writes failing or torn by a death
mid-write, shard reads slower than a lease, cuts that do not match (caught inside the
block or not), an exception inside ``restored()``. In a fifth of the schedules the
rollouts own sandbox directories, which every turn changes and checks against the
session's state, and every committed snapshot's directories must verify blob by blob.
In a quarter of the others the rollouts run a small deterministic text environment
through ``nemo_ckpt.adapters.AdaptedRollout`` (issue 28; ``text_env``): a continued one is
rebuilt by replay, whose observations must equal the recorded ones and a crash-free run.

The world outside the protocol (issue 23): blocking work runs as threads that outlive
their cancelled callers; every process has its own clocks (offsets up to hours, rates
within 10%); every ``Folder`` call may fail after it happened, reads may fail, and the
disk may be full for seconds (``DiskFaults``); a gc from another host, a retention
script (``remove_snapshot`` at any moment, refused while the job holds the path), a
second job, and a hostile process inside the sandboxes act meanwhile
(``HostileSandbox``); a copy of a committed manifest is damaged. Its invariants: no
committed snapshot references a missing blob, nothing outside a sandbox is read into
one, sparse files stay sparse, no call waits past its deadline, damaged data is the
project's error.

Ray as it behaves (issue 29; ``_ray_plan``): a death is noticed late, and the name resolves
to the dead actor until Ray releases it; a stalled node (or the coordinator's process,
once right after a manifest's rename) is declared dead past Ray's detection delay, and
runs again as a zombie whose work still reaches files and holders; a holder admits a few
concurrent calls in its one concurrency group (``actors.sim.method_group``),
with more workers' turns than that; a restarted driver brings another config. Its
invariants: no zombie's clean-up tears a newer snapshot (case 29.1), no abort or next
call fails only because it met the dead coordinator's name (29.2), no control call waits
behind turns (29.3), no driver with another config commits.

NeMo RL as the caller (issue 36, then 52; ``Plan.nemo_rl``, a quarter of the schedules): RL
is ``nemo_ckpt.testing.nemo_rl``'s recovery ledger, barrier, staging and published groups
(``rl.NemoRL``), driven through ``nemo_ckpt.integrations.nemo_rl`` with its ``retained=``
and ``drain=``, RL's half saved with ``NemoRlState``. The plan draws, apart, a prompt group
per rollout of a node (a sibling per instance) with its granularity (SIBLING or
PROMPT_GROUP), restore level (TURN or SIBLING) and publication (sealed groups published,
their rows staged until a later train step, or kept sealed in the ledger), the ledger's
revision (schema 4, or with its retirement queue), and how long a finished rollout's
reply travels before RL seals it. Workers close their sessions, as NeMo Gym's do; a
rollout that fails live has its group's unsealed work abandoned and retried, and
``retire_dropped()`` run. Its invariants (issue 52): a restore never fails whole for a
prompt-group group nor hands its sessions over; after ``retire_dropped()`` no session of
a dropped rollout held before it is held still; no published group's or sealed
attempt's row is reported as an orphan or left out of a restore's keep set; no rollout
finished in the environment before a committed snapshot began is unsealed at its cut,
and what its drain sealed is sealed after a restore (never run again). In half of those
(``Plan.manager``) every snapshot is a ``RolloutCheckpointManager``'s, with its names,
rename and retention.

Hostile files in the root (issue 50; ``Plan.planted``, a quarter of the schedules): a FIFO
planted as a folder's manifest, or a link there to a FIFO, which every read of the root
(a commit's numbering, a gc, a collection, a manager's listing) must refuse at once (the
guard reports one that waits: case 50.5); in manager schedules a committed snapshot's
record nested 100,000 deep (50.6), a link named as a partial snapshot whose target's files
no sweep may remove (50.8), and a second job's manager on the same root running its
retention now and then (``Plan.second_manager``), whose sweep must never take a snapshot
in progress: each snapshot the manager returns has its record and RL's half (50.7).

    .venv/bin/python -m tests.simulation                  # 10,000 schedules on 2 processes
    .venv/bin/python -m tests.simulation --replay SEED    # one schedule, with its trace

A violation prints its seed and the replay command. The run re-executes itself with
``PYTHONHASHSEED=0``, so a replay iterates sets exactly as the failing run did.

The parts, TigerBeetle's simulator's split: ``plan`` (what a seed draws), ``workload``
(the drivers' script, the workers' rollouts, RL's side in ``rl``), ``faults`` (every
fault, at its time or its trigger), ``checkers`` (the invariants and the reviewed cases
they show), each over the ``state`` it shares with the others; ``schedule`` joins them to
the world's hooks and runs one seed; ``runner`` runs many.
"""

from .checkers import CASES, case_of
from .plan import CONFIG, Plan
from .runner import REPLAY, main, run_many, run_one
from .schedule import Schedule
from .state import Result

__all__ = ["CASES", "CONFIG", "REPLAY", "Plan", "Result", "Schedule", "case_of", "main",
           "run_many", "run_one"]
