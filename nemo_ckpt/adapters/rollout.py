"""``AdaptedRollout``: one rollout of another framework's environment, run through a
``SessionClient`` so that it recovers turn by turn with no change to the environment.

``init`` and each ``step`` run inside a turn of the rollout's session; the turn record is
the prompt or action and what the call returned (``nemo_ckpt.adapters.turn_records``).
The session's state is empty, unless the environment offers the state export
(``nemo_ckpt.adapters.state_export``): then it is the environment's exported state.
Until ``init`` commits, it is the prompt: ``start`` opens the session with it, so that a
snapshot taken between the open and the ``init`` turn (a session captured with no turns)
holds what ``resume`` needs to start that rollout afresh, with no ``prompt=`` (issue 56).

After a restore, ``AdaptedRollout.resume`` constructs the environment afresh and either
loads its exported state or replays the live trajectory's prompt and actions, without
the model, checking every output (``nemo_ckpt.adapters.replay``). A replay that returns
something else makes the rollout start over in the same session: a warning names it,
the holder counts it in the next snapshot's ``replay_restarted_rollouts``, and a new
``init`` turn begins a fresh trajectory the model runs again. Nothing diverges silently.

The environment's calls run on the worker's event loop, as a hand-written worker's
turn would run them: an environment whose steps block for long belongs in a worker of
its own.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Literal, cast

import msgpack

from nemo_ckpt.adapters.framework import Framework
from nemo_ckpt.adapters.replay import replay
from nemo_ckpt.adapters.state_export import offers_state_export
from nemo_ckpt.adapters.step_output import StepOutput, plain
from nemo_ckpt.adapters.turn_records import TurnRecord, decode_record, live_records
from nemo_ckpt.errors import EnvironmentAdapterError
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.sessions import SessionClient

__all__ = ["AdaptedRollout", "Staging", "trajectory_of"]

log = logging.getLogger("nemo_ckpt.adapters")

# Called inside a turn with the turn's index in the session: writes the turn's
# token-capture rows to RL's data plane and returns their keys.
Staging = Callable[[int], Awaitable[Iterable[str]]]
"""The type of ``AdaptedRollout``'s ``staging`` argument: an async function (or any
callable that returns an awaitable) that ``AdaptedRollout`` calls inside each turn with
the turn's index in the session (0 for ``init``), and that writes the turn's
token-capture rows to RL's data plane and returns their staging keys, an iterable of
``str`` (``[]`` for none). E.g. ``async def staging(turn: int) -> list[str]``."""

RebuiltBy = Literal["fresh", "replay", "state", "restarted"]

# A session state that is an exported environment state starts with this byte; an
# empty state means "rebuilt by replay".
_EXPORTED = b"S"
# The state ``start`` opens a session with, until its ``init`` commits: this byte, then
# the prompt as msgpack (its plain form, as the init record stores it).
_PROMPT = b"P"


def _opening_state(prompt: Any) -> bytes:
    """The state a session opens with: the prompt, when its plain form is the prompt's
    own data (a value of another type is recorded by its type alone, which ``init``
    cannot be given again); else empty, and ``resume`` asks for ``prompt=``."""
    given = plain(prompt)
    return _PROMPT + msgpack.packb(given, use_bin_type=True) if _replayable(given) else b""


def _replayable(value: Any) -> bool:
    if isinstance(value, dict):
        return "__not_comparable__" not in value and all(map(_replayable, value.values()))
    if isinstance(value, list):
        return all(map(_replayable, value))
    return True


def _recorded_prompt(state: bytes) -> tuple[bool, Any]:
    """``(True, prompt)`` if ``state`` is one ``start`` opened a session with."""
    if state[:1] != _PROMPT:
        return False, None
    try:
        return True, msgpack.unpackb(state[1:], raw=False)
    except Exception:
        return False, None


def trajectory_of(result: bytes) -> list[TurnRecord]:
    """The live trajectory in a finished rollout's result (``AdaptedRollout.finish``)."""
    try:
        records = msgpack.unpackb(result, raw=False)
    except Exception:
        records = None
    if not isinstance(records, list):
        raise EnvironmentAdapterError("a result of AdaptedRollout.finish is a list of "
                                      "turn records; this one is not")
    return [decode_record(r, f"record {i} of the result") for i, r in enumerate(records)]


def _check_staging(staging: object) -> None:
    if staging is not None and not callable(staging):
        raise TypeError(
            f"staging must be an async function of the turn's index that writes the "
            f"turn's staging rows and returns their keys (async def staging(turn: int) "
            f"-> list[str]), or None; got {type(staging).__name__}")


async def _staging_keys(staging: Staging | None, turn: int) -> Iterable[str]:
    """The keys ``staging`` returns for ``turn`` (``Turn.complete`` checks them), or
    ``TypeError`` for a plain function, whose list cannot be awaited."""
    if staging is None:
        return ()
    pending: object = staging(turn)
    if not inspect.isawaitable(pending):
        raise TypeError(
            f"staging({turn}) returned {type(pending).__name__}, not an awaitable: make "
            f"it an async function (async def staging(turn: int) -> list[str])")
    return cast(Iterable[str], await pending)


class AdaptedRollout:
    """One rollout of a ``Framework``'s environment, recovered turn by turn.

    Usage (in an environment worker)::

        rollout = await AdaptedRollout.start(client, episode, framework, prompt)
        while not rollout.done:
            action = policy(rollout.conversation)           # the model's call
            await rollout.step(action, staging)             # one committed turn
        await rollout.finish()                              # handed to the backend

    and after a restore, for a continued rollout::

        rollout = await AdaptedRollout.resume(client, episode, framework)
    """

    def __init__(self, client: SessionClient, episode: EnvironmentEpisode,
                 framework: Framework) -> None:
        self._client = client
        self.episode = episode
        self._framework = framework
        self._env: Any = None
        self._records: list[TurnRecord] = []
        # How the environment was last made: "fresh" (started here), "replay", "state"
        # or "restarted" (a replay diverged and the rollout started over).
        self.rebuilt_by: RebuiltBy = "fresh"
        self.restarts = 0
        # What the last rebuild's replay returned, turn by turn, before any divergence.
        self.replayed: list[StepOutput] = []

    # --- starting and resuming -----------------------------------------------------------

    @classmethod
    async def start(cls, client: SessionClient, episode: EnvironmentEpisode,
                    framework: Framework, prompt: Any, directory: Path | None = None,
                    staging: Staging | None = None) -> AdaptedRollout:
        """Open ``episode``'s session (a fresh attempt; ``directory``: its sandbox) and
        run the environment's ``init(prompt)`` as its first turn. ``staging`` (a
        ``Staging``: ``async def staging(turn: int) -> list[str]``) writes that turn's
        staging rows inside it and returns their keys; ``TypeError`` if it is not
        callable, before the session is opened. The session opens with the prompt as
        its state, so that ``resume`` can run ``init`` if a snapshot captures it before
        that turn commits."""
        _check_staging(staging)
        await client.open(episode, _opening_state(prompt), directory=directory)
        rollout = cls(client, episode, framework)
        await rollout._init(prompt, None, staging)
        return rollout

    @classmethod
    async def resume(cls, client: SessionClient, episode: EnvironmentEpisode,
                     framework: Framework, prompt: Any = None) -> AdaptedRollout:
        """Continue ``episode``'s session (a continued rollout after a restore, or a
        worker that lost its environment): rebuild the environment from its exported
        state or by a checked replay. A session whose ``init`` never committed (captured
        between ``start``'s open and its first turn) starts afresh: ``init`` runs with the
        prompt ``start`` recorded at the open, and ``rebuilt_by`` is ``"fresh"``.
        ``prompt`` is needed only for a session ``start`` did not open with a prompt it
        could record (one of a type that is not plain data, or an older release's)."""
        rollout = cls(client, episode, framework)
        session = await client.get(episode)
        live = rollout._live(session)
        if not live:
            if prompt is None:
                recorded, prompt = _recorded_prompt(session.state)
                if not recorded:
                    raise EnvironmentAdapterError(
                        f"rollout {episode.capture_key} has no committed init turn to "
                        f"replay and no recorded prompt; pass prompt= to "
                        f"AdaptedRollout.resume, or start a new attempt")
            await rollout._init(prompt, None, None)
        else:
            await rollout._rebuild(session, live)
        return rollout

    def _live(self, session: SessionRecord) -> list[TurnRecord]:
        key = self.episode.capture_key
        return live_records([decode_record(t, f"turn {i} of {key}")
                             for i, t in enumerate(session.turns)])

    async def _init(self, prompt: Any, restarted: str | None, staging: Staging | None) -> None:
        async with self._client.turn(self.episode) as turn:
            env = self._framework.make(turn.directory)
            try:
                record = TurnRecord.of("init", prompt, self._framework.init(env, prompt),
                                       restarted)
                keys = await _staging_keys(staging, turn.turn_count)
                turn.complete(record.encode(), self._state_of(env), keys)
            except BaseException:
                self._framework.close(env)
                raise
        self._replace_env(env)
        self._records = [record]

    async def _rebuild(self, session: SessionRecord, live: list[TurnRecord]) -> None:
        env = self._framework.make(None if session.directory is None
                                   else Path(session.directory))
        if session.state[:1] == _EXPORTED and offers_state_export(env):
            env.set_state(session.state[1:])
            self._replace_env(env)
            self._records, self.rebuilt_by = live, "state"
            return
        self.replayed = []
        divergence = replay(self._framework, env, live, self.replayed)
        if divergence is None:
            self._replace_env(env)
            self._records, self.rebuilt_by = live, "replay"
            return
        self._framework.close(env)
        log.warning("rollout %s (%s) starts over: replaying its %d recorded turn(s) "
                    "diverged at %s", self.episode.capture_key, self._framework.name,
                    len(live), divergence)
        await self._client.replay_diverged(self.episode, str(divergence))
        self.restarts += 1
        await self._init(live[0].given, str(divergence), None)
        self.rebuilt_by = "restarted"

    def _state_of(self, env: Any) -> bytes:
        return _EXPORTED + env.get_state() if offers_state_export(env) else b""

    def _replace_env(self, env: Any) -> None:
        if self._env is not None and self._env is not env:
            self._framework.close(self._env)
        self._env = env

    # --- running -------------------------------------------------------------------------

    async def step(self, action: str, staging: Staging | None = None) -> StepOutput:
        """Run one ``step(action)`` as a committed turn and return its output.
        ``staging`` (a ``Staging``: ``async def staging(turn: int) -> list[str]``)
        writes the turn's staging rows inside it and returns their keys; ``TypeError``
        if it is not callable, before anything runs, or if it does not return an
        awaitable of ``str`` keys (the turn then does not commit). A turn that did not
        commit leaves the environment ahead of the session: the next step rebuilds it
        first."""
        _check_staging(staging)
        if self.done:
            raise EnvironmentAdapterError(
                f"rollout {self.episode.capture_key} is done (its last step returned "
                f"done=True); finish it with AdaptedRollout.finish")
        if self._env is None:
            session = await self._client.get(self.episode)
            await self._rebuild(session, self._live(session))
            if self.done:
                raise EnvironmentAdapterError(
                    f"rollout {self.episode.capture_key} is done after its rebuild; "
                    f"finish it with AdaptedRollout.finish")
        try:
            async with self._client.turn(self.episode) as turn:
                record = TurnRecord.of("step", action, self._framework.step(self._env, action))
                keys = await _staging_keys(staging, turn.turn_count)
                turn.complete(record.encode(), self._state_of(self._env), keys)
        except BaseException:
            env, self._env = self._env, None  # stepped, not committed: rebuilt next time
            if env is not None:
                self._framework.close(env)
            raise
        self._records.append(record)
        return record.step_output

    async def finish(self, result: bytes | None = None) -> bytes:
        """Hand the finished rollout's ``result`` to the backend (kept until RL
        acknowledges it) and close the environment. ``result`` is what RL's ledger reads
        back after a restore; by default the live trajectory (``trajectory_of``)."""
        if result is None:
            result = msgpack.packb([r.encode() for r in self._records], use_bin_type=True)
        await self._client.finish(self.episode, result)
        self.close()
        return result

    def close(self) -> None:
        """Close the environment (the session stays)."""
        if self._env is not None:
            env, self._env = self._env, None
            self._framework.close(env)

    # --- what the model and RL read --------------------------------------------------------

    @property
    def records(self) -> list[TurnRecord]:
        """The live trajectory's turn records, ``init`` first."""
        return list(self._records)

    @property
    def outputs(self) -> list[StepOutput]:
        """What ``init`` and each step returned, in order."""
        return [r.step_output for r in self._records]

    @property
    def done(self) -> bool:
        return bool(self._records) and bool(self._records[-1].output.get("done"))

    @property
    def conversation(self) -> list[Any]:
        """The messages so far: ``init``'s observations, then each action (as the
        assistant's message) and the observations its step returned."""
        messages: list[Any] = []
        for r in self._records:
            if r.kind == "step":
                messages.append({"role": "assistant", "content": r.given})
            obs = r.output.get("observations")
            messages.extend(obs if isinstance(obs, list) else [] if obs is None else [obs])
        return messages
