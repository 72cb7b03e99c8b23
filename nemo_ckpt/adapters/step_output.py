"""A step's output as pure data (``StepOutput``), in the plain form a turn record keeps
and a replay compares (``plain``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepOutput", "plain"]


def plain(value: Any) -> Any:
    """``value`` as msgpack-encodable plain data that compares the same however it was
    built: mappings with string keys in sorted order, sequences as lists. A value of any
    other type stands for its type's name alone: it is recorded, but only its type is
    compared."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return value
    if isinstance(value, float):
        return "nan" if math.isnan(value) else value  # NaN != NaN would always diverge
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return {"__not_comparable__": f"{type(value).__module__}.{type(value).__qualname__}"}


@dataclass(frozen=True)
class StepOutput:
    """What ``init`` or one ``step`` returned: the observations (messages), the reward,
    whether the episode is done, and everything else it returned (``extra``: metadata,
    a post-processed action, ``init``'s info), all as ``plain`` data."""

    observations: Any
    reward: float = 0.0
    done: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def as_plain(self) -> dict[str, Any]:
        """The output as the turn record keeps it and a replay compares it."""
        return {"observations": plain(self.observations), "reward": plain(self.reward),
                "done": bool(self.done), "extra": plain(dict(self.extra))}

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> StepOutput:
        reward = data.get("reward", 0.0)
        return cls(observations=data.get("observations"),
                   reward=float("nan") if reward == "nan" else float(reward),
                   done=bool(data.get("done", False)), extra=dict(data.get("extra", {})))
