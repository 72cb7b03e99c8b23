"""Replay with equality checks: an environment constructed afresh is given the recorded
prompt and actions again, without calling the model, and each step must return what was
recorded. The first difference is a ``Divergence``; the rollout then starts over."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from nemo_ckpt.adapters.framework import Framework
from nemo_ckpt.adapters.step_output import StepOutput
from nemo_ckpt.adapters.turn_records import TurnRecord

__all__ = ["Divergence", "compare", "replay"]

_FIELDS = ("observations", "reward", "done", "extra")


@dataclass(frozen=True)
class Divergence:
    """Where a replay first returned something other than what was recorded.

    Attributes:
        turn: The turn's index in the live trajectory (0 is ``init``).
        fields: The parts of the output that differ (``observations``, ``reward``,
            ``done``, ``extra``), or ``("raised",)`` when the replayed call raised.
        detail: What was recorded and what the replay returned, shortened.
    """

    turn: int
    fields: tuple[str, ...]
    detail: str

    def __str__(self) -> str:
        return f"turn {self.turn}: {', '.join(self.fields)} differ ({self.detail})"


def _packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def compare(recorded: TurnRecord, replayed: StepOutput, turn: int) -> Divergence | None:
    """None when ``replayed`` equals the record's output, else the fields that differ.
    Compared as encoded plain data: exact, NaN equal to itself."""
    again = replayed.as_plain()
    if _packed(again) == _packed(recorded.output):
        return None
    differ = tuple(f for f in _FIELDS
                   if _packed(again.get(f)) != _packed(recorded.output.get(f)))
    shown = "; ".join(f"{f}: recorded {_short(recorded.output.get(f))}, replayed "
                      f"{_short(again.get(f))}" for f in differ)
    return Divergence(turn, differ or ("output",), shown)


def replay(framework: Framework, env: Any, records: Sequence[TurnRecord],
           replayed: list[StepOutput] | None = None) -> Divergence | None:
    """Run ``records`` (a live trajectory, ``init`` first) on ``env``, checking each
    output; the first divergence, or None when every step returned what was recorded.
    ``replayed``, when given, receives each output that equalled its record."""
    for turn, record in enumerate(records):
        try:
            if record.kind == "init":
                output = framework.init(env, record.given)
            else:
                output = framework.step(env, record.given)
        except Exception as exc:  # a replayed step that raises diverged, whatever it is
            return Divergence(turn, ("raised",), f"{record.kind} raised {exc!r}"[:300])
        divergence = compare(record, output, turn)
        if divergence is not None:
            return divergence
        if replayed is not None:
            replayed.append(output)
    return None
