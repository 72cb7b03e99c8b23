"""A deterministic toy multi-turn environment, and the Ray actor that runs it.

The task: an agent must bring a number to a target with tool calls (``add``, ``sub``,
``mul``, ``div`` by 2..9), one call per turn, and calls ``answer`` once it is there.
Its policy is a seeded epsilon-greedy one whose random draws depend on the seed, the
rollout, the turn and the full state, including a digest of every earlier action. So a
rollout's trajectory is a pure function of ``(seed, rollout_id, turns)``: independent of
scheduling, timing, attempts and of which node runs it, and any turn restored with the
wrong state changes every turn after it.

Each turn is one ``SessionClient.turn``: the model call's token-capture row is written to
the data plane inside the turn, before ``turn.complete(record, state, [staging_key])``
commits it (the rule DESIGN.md asks environment workers to keep). With a sandbox root,
each rollout also works in its own directory, a checkout of one small repository: every
turn creates, edits, renames and deletes files there (``sandbox_turn``), derived from the
turn's record, so a rollout's final directory is as much a pure function as its turns.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import random
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, cast

from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.sessions import SessionClient

__all__ = [
    "TOOLS",
    "ToyState",
    "RolloutTask",
    "RolloutOutcome",
    "ToyEnvWorker",
    "toy_env_worker_actor_class",
    "initial_state",
    "step",
    "staging_key",
    "ordered_staging_keys",
    "reference_trajectory",
    "start_env_workers",
    "make_sandbox",
    "sandbox_turn",
    "directory_listing",
]

TOOLS = ("add", "sub", "mul", "div")
_ARGS = tuple(range(2, 10))
_EPSILON = 0.3  # how often the policy explores instead of taking the greedy call
_MODULUS = 100_003  # keeps values small whatever the policy does


@dataclass(frozen=True)
class ToyState:
    """The environment's state after a turn; serialized as canonical JSON bytes.

    Attributes:
        seed: The run's seed (the policy's draws depend on it).
        rollout_id: The rollout this state belongs to.
        turns: How many turns the rollout runs in all.
        turn: The next turn's index (the number of turns committed so far).
        value: The agent's current number.
        target: The number it must reach.
        trail: A digest of every action so far.
    """

    seed: int
    rollout_id: str
    turns: int
    turn: int
    value: int
    target: int
    trail: str

    def to_bytes(self) -> bytes:
        """Canonical JSON: equal states have equal bytes."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ToyState:
        """Parse ``to_bytes``' output; raises ValueError on anything else."""
        try:
            return cls(**json.loads(data))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a toy environment state: {exc}") from None

    @property
    def done(self) -> bool:
        """Whether every turn has run."""
        return self.turn >= self.turns


def _rng(*parts: object) -> random.Random:
    # A bytes seed is hashed the same way in every process (unlike hash() of a str).
    return random.Random(hashlib.sha256(repr(parts).encode()).digest())


def initial_state(seed: int, rollout_id: str, turns: int) -> ToyState:
    """The task of ``rollout_id`` under ``seed``: a start value and a target."""
    if turns < 1:
        raise ValueError("a rollout runs at least one turn")
    rng = _rng(seed, rollout_id, "task")
    return ToyState(seed=seed, rollout_id=rollout_id, turns=turns, turn=0,
                    value=rng.randint(2, 30), target=rng.randint(40, 600), trail="")


def _apply(value: int, tool: str, arg: int) -> int:
    if tool == "add":
        return (value + arg) % _MODULUS
    if tool == "sub":
        return (value - arg) % _MODULUS
    if tool == "mul":
        return (value * arg) % _MODULUS
    if tool == "div":
        return value // arg
    if tool == "answer":
        return value
    raise ValueError(f"unknown tool {tool!r}")


def _tokens(text: str) -> list[int]:
    # A byte-level "tokenizer": enough to make token rows that differ when text differs.
    return list(text.encode())


def step(state: ToyState) -> tuple[ToyState, dict[str, Any], dict[str, Any]]:
    """Run one turn: the policy's model call, then the tool call.

    Returns the new state, the turn record and the model call's token-capture row
    (both JSON-compatible, neither naming the attempt, so reruns agree).
    """
    if state.done:
        raise ValueError(f"{state.rollout_id} already ran its {state.turns} turns")
    rng = _rng(state.seed, state.rollout_id, state.turn, state.value, state.trail)
    prompt = f"turn {state.turn}: value={state.value} target={state.target}"
    if state.value == state.target:
        tool, arg = "answer", state.value
    elif rng.random() < _EPSILON:
        tool, arg = rng.choice([(t, a) for t in TOOLS for a in _ARGS])
    else:
        tool, arg = min(((t, a) for t in TOOLS for a in _ARGS),
                        key=lambda c: (abs(_apply(state.value, *c) - state.target), c))
    completion = f"call {tool}({arg})"
    completion_tokens = _tokens(completion)
    result = _apply(state.value, tool, arg)
    distance = abs(state.target - result)
    record = {
        "turn": state.turn,
        "observation": prompt,
        "action": {"tool": tool, "arg": arg},
        "result": result,
        "distance": distance,
        "reward": 1.0 if tool == "answer" else round(1.0 / (1 + distance), 6),
    }
    row = {
        "rollout_id": state.rollout_id,
        "turn": state.turn,
        "prompt_tokens": _tokens(prompt),
        "completion_tokens": completion_tokens,
        "logprobs": [round(-2.0 * rng.random(), 4) for _ in completion_tokens],
    }
    trail = hashlib.sha256(f"{state.trail}|{completion}".encode()).hexdigest()[:16]
    new = ToyState(seed=state.seed, rollout_id=state.rollout_id, turns=state.turns,
                   turn=state.turn + 1, value=result, target=state.target, trail=trail)
    return new, record, row


def reference_trajectory(seed: int, rollout_id: str, turns: int
                         ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """What any run must produce for this rollout, computed in this process:
    ``(records, rows)``, comparable with ``Trajectory.steps``."""
    state = initial_state(seed, rollout_id, turns)
    records, rows = [], []
    while not state.done:
        state, record, row = step(state)
        records.append(record)
        rows.append(row)
    return tuple(records), tuple(rows)


def staging_key(episode: EnvironmentEpisode, turn: int) -> str:
    """The key of the row that ``episode`` writes in ``turn``: ``<capture key>/t<turn>``."""
    return f"{episode.capture_key}/t{turn:04d}"


def ordered_staging_keys(session: SessionRecord) -> tuple[str, ...]:
    """The session's staging keys in turn order, over all its attempts.

    Each committed turn wrote exactly one row, under the capture key of the attempt
    that ran it; rows of turns that never committed are not in the session.
    """
    keys = []
    for turn in range(len(session.turns)):
        suffix = f"/t{turn:04d}"
        found = [k for k in session.staging_keys if k.endswith(suffix)]
        if len(found) != 1:
            raise ValueError(
                f"session {session.episode.capture_key} has {len(found)} staging rows for "
                f"turn {turn} ({found}); each committed turn writes exactly one")
        keys.append(found[0])
    return tuple(keys)


@dataclass(frozen=True)
class RolloutTask:
    """What the driver asks a worker to run.

    Attributes:
        episode: The attempt, as the ledger dispatched (or restored) it.
        instance_id: The session-holder instance the ledger assigned it to.
        namespace: The Ray namespace of the holders.
        seed: The run's seed.
        turns: How many turns the rollout runs.
        fresh: Open a new session (True) or continue a restored one (False).
        sandbox_root: Where a fresh session's sandbox directory is made (the job's
            ``CheckpointConfig.sandbox_root``); None runs without one.
    """

    episode: EnvironmentEpisode
    instance_id: str
    namespace: str
    seed: int
    turns: int
    fresh: bool
    sandbox_root: Optional[str] = None


@dataclass(frozen=True)
class RolloutOutcome:
    """A rollout run to its end, as the worker hands it back to the driver.

    Attributes:
        records: Every turn record (JSON bytes), over all attempts, oldest first.
        staging_keys: The rows those turns wrote, in the same order.
        turns_at_start: Turns the session already held (restored) when this worker began.
        turns_run: Turns this worker ran.
        node_id: The node the worker runs on.
        directory: The session's sandbox directory at the end, every entry with its
            kind, mode and bytes (``directory_listing``); None without one.
    """

    episode: EnvironmentEpisode
    instance_id: str
    node_id: str
    records: tuple[bytes, ...]
    staging_keys: tuple[str, ...]
    turns_at_start: int
    turns_run: int
    directory: Optional[dict[str, tuple[str, int, bytes]]] = None

    def decoded_records(self) -> list[Any]:
        """The turn records as JSON values, for the data plane's trajectory."""
        return [json.loads(r) for r in self.records]


class ToyEnvWorker:
    """An environment worker: runs rollouts turn by turn through ``SessionClient``.

    One or more run on every node (``start_env_workers``); each runs many rollouts
    concurrently. ``turn_seconds`` simulates the model's and the tool's time per turn.
    """

    def __init__(self, turn_seconds: float = 0.05) -> None:
        import ray

        self._turn_seconds = turn_seconds
        self._node_id = ray.get_runtime_context().get_node_id()
        self._clients: dict[tuple[str, str], SessionClient] = {}

    async def node_id(self) -> str:
        """The node this worker runs on (also a readiness probe)."""
        return self._node_id

    async def run_rollout(self, task: RolloutTask, data_plane: Any) -> RolloutOutcome:
        """Run ``task``'s rollout to its last turn and return it; the session stays open
        until RL retires it (RL consumes the result first)."""
        episode = task.episode
        client = await self._client(task.namespace, task.instance_id)
        if task.fresh:
            directory = None
            if task.sandbox_root is not None:
                directory = make_sandbox(Path(task.sandbox_root) / "work" / task.namespace
                                         / episode.capture_key)
            await client.open(episode, initial_state(task.seed, episode.rollout_id,
                                                     task.turns).to_bytes(),
                              directory=directory)
            at_start = 0
        else:
            at_start = len((await client.get(episode)).turns)
        for _ in range(at_start, task.turns):
            async with client.turn(episode) as turn:
                state = ToyState.from_bytes(turn.state)
                if state.turn != turn.turn_count:
                    raise RuntimeError(
                        f"{episode.capture_key}: state is at turn {state.turn} but the "
                        f"session holds {turn.turn_count} turns; the restore is inconsistent")
                await asyncio.sleep(self._turn_seconds)  # the model's and the tool's time
                new_state, record, row = step(state)
                key = staging_key(episode, state.turn)
                # Inside the turn, before it commits: the row exists before anything
                # that references it.
                await _write_row(data_plane, key, row)
                if turn.directory is not None:
                    sandbox_turn(turn.directory, state.turn, record)
                turn.complete(_encode(record), new_state.to_bytes(), [key])
        final = await client.get(episode)
        return RolloutOutcome(
            episode=episode, instance_id=task.instance_id, node_id=self._node_id,
            records=final.turns, staging_keys=ordered_staging_keys(final),
            turns_at_start=at_start, turns_run=task.turns - at_start,
            directory=None if final.directory is None
            else directory_listing(Path(final.directory)))

    async def _client(self, namespace: str, instance_id: str) -> SessionClient:
        key = (namespace, instance_id)
        if key not in self._clients:
            self._clients[key] = await SessionClient.connect(instance_id=instance_id,
                                                             namespace=namespace)
        return self._clients[key]


# --- the toy's sandbox: a repository checkout each turn works in ---------------------


def make_sandbox(directory: Path) -> Path:
    """A fresh checkout of the toy's repository at ``directory`` (a crashed attempt's
    leftovers there go first). Every rollout starts from the same files."""
    if directory.exists():
        shutil.rmtree(directory)
    (directory / "src").mkdir(parents=True)
    (directory / "README.md").write_text("# toy repository\n\nEach turn works in here.\n")
    (directory / "src" / "app.py").write_text("def run(x):\n    return x\n")
    data = hashlib.sha256(b"toy-data").digest() * 2048  # 64 KiB, the same in every rollout
    (directory / "data.bin").write_bytes(data)
    script = directory / "check.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    (directory / "entry").symlink_to("src/app.py")
    return directory


def sandbox_turn(directory: Path, turn: int, record: Mapping[str, Any]) -> None:
    """What a toy turn does to its directory: create a note, append to the log, rename
    the previous note, delete an old one. Derived from the turn's record only, so every
    run of a rollout leaves the same bytes."""
    notes = directory / "notes"
    notes.mkdir(exist_ok=True)
    (notes / f"turn-{turn:03d}.json").write_text(_encode(record).decode() + "\n")
    action = record["action"]
    with open(directory / "log.txt", "a") as log:
        log.write(f"{turn} {action['tool']}({action['arg']}) -> {record['result']}\n")
    if turn >= 1:
        os.rename(notes / f"turn-{turn - 1:03d}.json", notes / f"done-{turn - 1:03d}.json")
    if turn >= 3:
        (notes / f"done-{turn - 3:03d}.json").unlink()
    (directory / "src" / "app.py").write_text(
        f"def run(x):\n    return x  # last result {record['result']}\n")


def directory_listing(directory: Path) -> dict[str, tuple[str, int, bytes]]:
    """Every entry below ``directory``: kind, mode bits and bytes (a link's target)."""
    out: dict[str, tuple[str, int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(directory).as_posix()
            st = full.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", 0, os.readlink(full).encode())
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), b"")
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), full.read_bytes())
    return out


def _encode(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


async def _write_row(data_plane: Any, key: str, row: Any) -> None:
    from nemo_ckpt.testing.data_plane import ReferenceDataPlane

    if isinstance(data_plane, ReferenceDataPlane):
        await data_plane.write_staging(key, row)
    else:
        await data_plane.write_staging.remote(key, row)


@functools.cache
def toy_env_worker_actor_class() -> Any:
    """``ToyEnvWorker`` as a Ray actor class, made on first use."""
    # Not at import, so that importing this module (and nemo_ckpt.testing) imports
    # no Ray.
    import ray

    # No CPU reserved: the toy's work is sleeping; real workers would ask for CPUs.
    return cast(Any, ray.remote)(num_cpus=0, max_restarts=0, max_concurrency=1000)(ToyEnvWorker)


def __getattr__(name: str) -> Any:
    if name == "ToyEnvWorkerActor":  # ToyEnvWorker as a Ray actor class
        return toy_env_worker_actor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start_env_workers(node_ids: Iterable[str], per_node: int = 1,
                      turn_seconds: float = 0.05) -> dict[str, list[Any]]:
    """Start ``per_node`` workers pinned to each node; returns node id -> handles."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {
        node: [toy_env_worker_actor_class().options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(turn_seconds) for _ in range(per_node)]
        for node in node_ids
    }
