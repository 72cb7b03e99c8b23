"""The small deterministic text environment of the simulation's adapter-driven rollouts
(``Plan.adapted``): a Gymnasium-style ``init``/``step`` environment, run through
``nemo_ckpt.adapters.AdaptedRollout`` with a scripted policy in the model's place, and
the crash-free run its continued rollouts must equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_ckpt.adapters import StepOutput


class CounterTextEnv:
    """Each step folds the action into a value; the observation says the value. Its
    state is in memory only (no state export): a restore rebuilds it by replay."""

    def __init__(self, rollout_id: str, steps: int) -> None:
        self.rollout_id, self.steps = rollout_id, steps
        self.turns, self.value = 0, len(rollout_id)

    def init(self, prompt: Any) -> tuple[list[dict[str, str]], dict[str, Any]]:
        return [{"role": "user", "content": f"{prompt[0]['content']}: {self.value}"}], {}

    def step(self, action: str) -> dict[str, Any]:
        self.turns += 1
        self.value = (self.value * 31 + len(action) + self.turns) % 1000
        done = self.turns >= self.steps
        return {"observations": [] if done else [{"role": "user", "content": f"{self.value}"}],
                "reward": self.value / 1000, "done": done, "metadata": {"turn": self.turns}}


class CounterFramework:
    """The ``Framework`` for ``CounterTextEnv`` (``steps`` steps after ``init``)."""

    def __init__(self, rollout_id: str, steps: int) -> None:
        self.name = "simulation:counter"
        self.rollout_id, self.steps = rollout_id, steps
        self.prompt = [{"role": "user", "content": f"count for {rollout_id}"}]

    def make(self, directory: Path | None) -> CounterTextEnv:
        return CounterTextEnv(self.rollout_id, self.steps)

    def init(self, env: Any, prompt: Any) -> StepOutput:
        observations, info = env.init(prompt)
        return StepOutput(observations, 0.0, False, {"info": info})

    def step(self, env: Any, action: str) -> StepOutput:
        out = env.step(action)
        return StepOutput(out["observations"], out["reward"], out["done"],
                          {"metadata": out["metadata"]})

    def close(self, env: Any) -> None:
        pass


def policy(rollout_id: str, turn: int) -> str:
    """The scripted model's action at step ``turn`` (1-based)."""
    return f"call {rollout_id} step {turn}" + "!" * (turn % 3)


def reference(framework: CounterFramework) -> list[dict[str, Any]]:
    """What ``init`` and each step return in a crash-free run, as plain data."""
    env = framework.make(None)
    outputs = [framework.init(env, framework.prompt)]
    while not outputs[-1].done:
        outputs.append(framework.step(env, policy(framework.rollout_id, len(outputs))))
    return [o.as_plain() for o in outputs]
