"""What an adapter for one framework provides (``Framework``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from nemo_ckpt.adapters.step_output import StepOutput

__all__ = ["Framework"]


class Framework(Protocol):
    """An adapter for one framework's environments: how to construct one afresh, run
    its ``init`` and its ``step``, and close it. Everything else (recording, replay,
    the state export, sessions) is the framework-neutral ``AdaptedRollout``.

    ``make`` must construct an equal environment every time it is called for the same
    rollout: replay relies on it. ``directory`` is the rollout's sandbox directory, if
    it owns one (after a restore, the restored copy).
    """

    name: str

    def make(self, directory: Path | None) -> Any: ...

    def init(self, env: Any, prompt: Any) -> StepOutput: ...

    def step(self, env: Any, action: str) -> StepOutput: ...

    def close(self, env: Any) -> None: ...
