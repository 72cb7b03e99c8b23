"""An adapted rollout's turn record: what ``init`` or one ``step`` was given (the prompt,
the action) and what it returned, msgpack-encoded. The records are the rollout's
trajectory and what a replay checks against.

A session's records may hold several trajectories: an ``init`` record begins one, and
one whose ``restarted`` names a divergence began because the replay of the trajectory
before it returned something else. The live trajectory is the one the last ``init``
begins (``live_records``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from nemo_ckpt.adapters.step_output import StepOutput, plain
from nemo_ckpt.errors import EnvironmentAdapterError

__all__ = ["TurnRecord", "decode_record", "live_records", "FORMAT"]

FORMAT = "nemo-ckpt.adapter/1"


@dataclass(frozen=True)
class TurnRecord:
    """One turn of an adapted rollout.

    Attributes:
        kind: ``"init"`` (given the prompt) or ``"step"`` (given the action).
        given: The prompt (``plain`` data) or the action (a string).
        output: What it returned, as ``StepOutput.as_plain`` made it.
        restarted: On an ``init`` record, the divergence that made the rollout start
            over (None for its first ``init``).
    """

    kind: Literal["init", "step"]
    given: Any
    output: dict[str, Any]
    restarted: str | None = None

    @classmethod
    def of(cls, kind: Literal["init", "step"], given: Any, output: StepOutput,
           restarted: str | None = None) -> TurnRecord:
        return cls(kind, plain(given), output.as_plain(), restarted)

    def encode(self) -> bytes:
        return msgpack.packb({"format": FORMAT, "kind": self.kind, "given": self.given,
                              "output": self.output, "restarted": self.restarted},
                             use_bin_type=True)

    @property
    def step_output(self) -> StepOutput:
        return StepOutput.from_plain(self.output)


def decode_record(data: bytes, where: str) -> TurnRecord:
    """A turn record the adapter wrote, or EnvironmentAdapterError naming ``where``."""
    try:
        d = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise EnvironmentAdapterError(
            f"{where} is not a turn record of nemo_ckpt.adapters ({exc}); resume only "
            f"sessions AdaptedRollout.start opened") from None
    if (not isinstance(d, dict) or d.get("format") != FORMAT
            or d.get("kind") not in ("init", "step") or not isinstance(d.get("output"), dict)):
        raise EnvironmentAdapterError(
            f"{where} is not a turn record of nemo_ckpt.adapters (format {FORMAT}); resume "
            f"only sessions AdaptedRollout.start opened")
    restarted = d.get("restarted")
    return TurnRecord(d["kind"], d.get("given"), d["output"],
                      restarted if isinstance(restarted, str) else None)


def live_records(records: Sequence[TurnRecord]) -> list[TurnRecord]:
    """The live trajectory: from the last ``init`` record on (empty without one)."""
    starts = [i for i, r in enumerate(records) if r.kind == "init"]
    return list(records[starts[-1]:]) if starts else []
