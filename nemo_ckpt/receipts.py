"""Completion receipts: a finished rollout's result, kept by the backend until RL
acknowledges it.

A ledger rule beside the seed contract (``nemo_ckpt.interfaces`` stays as it is):

1. A worker hands a finished rollout's result to its holder
   (``SessionClient.finish(episode, result)``). The session stays, finished: it runs no
   more turns, and it holds the result.
2. RL records the rollout as finished in its ledger (and moves its staging rows out of
   staging), whenever it likes: no lock against snapshots.
3. Once RL's record is durable (in RL's next checkpoint, or as soon as it is recorded
   when RL's half is saved at the same cut as the backend's),
   ``RayEnvironmentCheckpoint.acknowledge([episode])`` drops the session.

A snapshot that meets a finished, unacknowledged session captures it as finished, with
its result; the cut check accepts it whether or not RL's ledger still expects it. A
restore installs it again, finished, at the same attempt, and hands its result back to
RL (``RayEnvironmentCheckpoint.restored_results``, read inside the ``restored()``
block) instead of listing it in ``continued_attempts``: RL records the results it does
not have yet, and acknowledges each one. Its staging rows are in ``staging_keys``, so RL
keeps them until it records the finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_ckpt.interfaces import EnvironmentEpisode

__all__ = ["FinishedRollout"]


@dataclass(frozen=True)
class FinishedRollout:
    """A finished rollout's result, restored and not yet acknowledged.

    Attributes:
        instance_id: The instance that holds it (again, after the restore).
        episode: The attempt that finished; acknowledge exactly this one.
        result: The bytes its worker handed to ``SessionClient.finish``.
    """

    instance_id: str
    episode: EnvironmentEpisode
    result: bytes
