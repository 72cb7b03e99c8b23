"""The environment worker of ``examples/minimal_driver.py``.

A toy multi-turn environment (a counter that a "model" moves each turn) run turn by
turn through nemo-ckpt's ``SessionClient``. The driver starts one worker per session
holder, on the holder's node, and hands it the holder's instance id and the job's
namespace; a rollout always runs on the instance RL's ledger dispatched it to.

Each turn writes one token-capture staging row to RL's data plane *inside* the turn,
before the turn commits: the rule that lets a snapshot's check find every row a
captured session references.

With a sandbox root, each rollout also owns a directory there, and every turn appends
its record to the directory's ``turns.log``: a continued rollout checks that the log
its restored directory holds is exactly its restored turns.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import ray

from nemo_ckpt import EnvironmentEpisode, SessionClient

__all__ = ["EnvWorker", "EnvWorkerActor", "initial_state", "run_one_turn", "expected_records",
           "result_of", "records_of"]


def initial_state(rollout_id: str) -> bytes:
    """A rollout's environment state before its first turn (bytes the env serializes)."""
    return json.dumps({"rollout": rollout_id, "turn": 0, "value": len(rollout_id)}).encode()


def run_one_turn(state: bytes) -> tuple[bytes, bytes, dict[str, Any]]:
    """One turn: the model's call and the tool's result.

    Returns the new state, the turn's record and its token-capture row. A pure function
    of the state, so a rollout continued from a restored state ends exactly as a run
    that never crashed.
    """
    s = json.loads(state)
    value = (s["value"] * 31 + s["turn"] + 7) % 1000  # the "tool call"
    record = json.dumps({"turn": s["turn"], "value": value}).encode()
    row = {"prompt": f"value={s['value']}", "completion": f"call step -> {value}"}
    new_state = json.dumps({"rollout": s["rollout"], "turn": s["turn"] + 1,
                            "value": value}).encode()
    return new_state, record, row


def result_of(records: list[bytes]) -> bytes:
    """A finished rollout's result as the backend keeps it: its turn records, as bytes."""
    return json.dumps([record.decode() for record in records]).encode()


def records_of(result: bytes) -> list[bytes]:
    """The turn records in a result that a restore handed back."""
    return [record.encode() for record in json.loads(result)]


def expected_records(rollout_id: str, turns: int) -> list[bytes]:
    """The turn records of a rollout that never crashed."""
    state, records = initial_state(rollout_id), []
    for _ in range(turns):
        state, record, _ = run_one_turn(state)
        records.append(record)
    return records


def append_to_log(sandbox: Path, record: bytes, turns: int, last: tuple[bytes, ...]) -> None:
    """A turn's work in its sandbox: check that ``turns.log`` holds as many lines as the
    session has committed turns, the last one its last record (after a restore too),
    then append this turn's record."""
    log = sandbox / "turns.log"
    lines = log.read_bytes().splitlines()
    if len(lines) != turns or tuple(lines[-1:]) != last:
        raise RuntimeError(f"{log} does not hold the session's {turns} turns: the "
                           f"directory and the session were not restored together")
    with open(log, "ab") as f:
        f.write(record + b"\n")


class EnvWorker:
    """Runs rollouts for one session-holder instance."""

    def __init__(self, instance_id: str, namespace: str, data_plane: Any,
                 turn_seconds: float = 0.0, sandbox_root: str | None = None) -> None:
        self.instance_id = instance_id
        self.namespace = namespace  # the same as CheckpointConfig.namespace
        self.data_plane = data_plane  # RL's data plane: an actor handle
        self.turn_seconds = turn_seconds
        self.sandbox_root = sandbox_root  # the same as CheckpointConfig.sandbox_root
        self.client: SessionClient | None = None

    def new_sandbox(self, episode: EnvironmentEpisode) -> Path | None:
        """A fresh attempt's sandbox directory, under the sandbox root (None without)."""
        if self.sandbox_root is None:
            return None
        sandbox = Path(self.sandbox_root) / "work" / episode.capture_key
        sandbox.mkdir(parents=True, exist_ok=True)  # the rollout's checkout, say
        (sandbox / "turns.log").write_bytes(b"")
        return sandbox

    async def run(self, episode: EnvironmentEpisode, until_turn: int, fresh: bool,
                  last: bool = False) -> list[bytes]:
        """Run ``episode`` until its session holds ``until_turn`` turns; return the
        session's turn records. ``fresh``: open the session (a new attempt); otherwise
        continue the session a restore brought back. ``last``: the rollout ends there,
        so hand its result to the backend, which keeps it until RL acknowledges it."""
        if self.client is None:
            self.client = await SessionClient.connect(instance_id=self.instance_id,
                                                      namespace=self.namespace)
        client = self.client
        if fresh:
            await client.open(episode, state=initial_state(episode.rollout_id),
                              directory=self.new_sandbox(episode))  # None: no directory
        session = await client.get(episode)
        for _ in range(len(session.turns), until_turn):
            async with client.turn(episode) as turn:             # waits while a snapshot pauses
                await asyncio.sleep(self.turn_seconds)            # the model's and tool's time
                new_state, record, row = run_one_turn(turn.state)
                key = f"{episode.capture_key}/t{turn.turn_count}"
                await self.data_plane.write_staging.remote(key, row)  # inside the turn
                if turn.directory is not None:                    # restored with the session
                    append_to_log(turn.directory, record, turn.turn_count,
                                  await turn.read_turns(-1))  # the last record only
                turn.complete(record, new_state, [key])           # commits when the block exits
        turns = list((await client.get(episode)).turns)
        if last:  # kept, finished, until the driver acknowledges RL's record of it
            await client.finish(episode, result_of(turns))
        return turns


# The Ray actor (Any: Ray's stubs type ray.remote(...)(cls) as the class itself). No CPU
# reserved: the toy sleeps; a real environment worker asks for its CPUs and GPUs.
EnvWorkerActor: Any = ray.remote(num_cpus=0)(EnvWorker)
