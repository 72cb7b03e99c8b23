"""The adapter for SkyRL-gym's text environments (``BaseTextEnv``: ``init(prompt)`` ->
observations and info, ``step(action)`` -> observations, reward, done, metadata).

SkyRL-gym is imported when an environment is first made, not with this module
(``pip install nemo-ckpt[skyrl]`` installs it). An environment is made by its registered
id with ``skyrl_gym.make``, so a team's own registered environments work as SkyRL-gym's.

The chat history is kept as SkyRL-gym's generator keeps it: the very list ``init``
returned, extended after each step with the action and the step's observations. Some
environments read or change that list through the reference they kept (``rlm`` pops its
per-turn prompt off it), so a replay keeps it the same way.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nemo_ckpt.adapters.step_output import StepOutput
from nemo_ckpt.errors import EnvironmentAdapterError

__all__ = ["SkyRLGym"]

# The keys of BaseTextEnvStepOutput the adapter names; the others go to ``extra``.
_MAIN = ("observations", "reward", "done")


class SkyRLGym:
    """A ``Framework`` for one registered SkyRL-gym environment and its arguments.

    ``env_config`` and ``extras`` are what the environment's constructor takes (the
    dataset row's ``extras``: ``reward_spec``, ``max_turns``, ...). ``configure``, when
    given, is called with the rollout's sandbox directory (or None) and returns them
    instead, for an environment whose files live in the sandbox.
    """

    def __init__(self, env_id: str, env_config: Any = None,
                 extras: Mapping[str, Any] | None = None,
                 configure: Callable[[Path | None], tuple[Any, Mapping[str, Any]]] | None = None
                 ) -> None:
        self.env_id = env_id
        self.name = f"skyrl_gym:{env_id}"
        self._env_config = env_config
        self._extras = dict(extras or {})
        self._configure = configure
        # Each live environment's chat history (the list its init returned).
        self._histories: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()

    def make(self, directory: Path | None) -> Any:
        try:
            import skyrl_gym
        except ImportError as exc:
            raise EnvironmentAdapterError(
                f"SkyRL-gym is not installed here ({exc}); install it with "
                f"pip install 'nemo-ckpt[skyrl]' on every node that runs its rollouts"
                ) from None

        if self._configure is not None:
            env_config, extras = self._configure(directory)
        else:
            env_config, extras = self._env_config, self._extras
        # A copy: an environment may change the extras it was given.
        return skyrl_gym.make(self.env_id, env_config=env_config, extras=dict(extras))

    def init(self, env: Any, prompt: Any) -> StepOutput:
        # A copy: an environment may return the prompt itself, and its history grows.
        observations, info = env.init(copy.deepcopy(prompt))
        if isinstance(observations, list):
            self._histories[env] = observations
        return StepOutput(list(observations), 0.0, False, {"info": info})

    def step(self, env: Any, action: str) -> StepOutput:
        out = env.step(action)
        observations = list(out["observations"] or [])
        history = self._histories.get(env)
        if history is not None:
            history.append({"role": "assistant", "content": action})
            history.extend(observations)
        return StepOutput(observations, float(out["reward"]), bool(out["done"]),
                          {k: v for k, v in out.items() if k not in _MAIN})

    def close(self, env: Any) -> None:
        self._histories.pop(env, None)
        env.close()
