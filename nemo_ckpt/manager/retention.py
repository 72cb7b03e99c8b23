"""Which managed snapshots retention keeps (pure: the manager does the removing)."""

from __future__ import annotations

from collections.abc import Sequence

from nemo_ckpt.manager.contract import ManagedSnapshot

__all__ = ["retained"]


def retained(found: Sequence[ManagedSnapshot], keep_latest_k: int,
             trainer_step: int | None) -> set[str]:
    """The paths to keep of ``found`` (newest first): the ``keep_latest_k`` newest, the
    anchor of ``trainer_step`` (the newest trainer checkpoint known saved; None: the
    newest anchor), and every anchor newer than it, whose trainer checkpoint may not
    have landed yet."""
    keep = {s.path for s in found[:keep_latest_k]}
    steps = [s.anchor_step for s in found if s.anchor_step is not None]
    saved = trainer_step if trainer_step is not None else max(steps, default=None)
    if saved is None:
        return keep
    keep.update(s.path for s in found if s.anchor_step is not None and s.anchor_step > saved)
    keep.update([s.path for s in found if s.anchor_step == saved][:1])
    return keep
