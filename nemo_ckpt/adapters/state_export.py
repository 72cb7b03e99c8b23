"""The state-export protocol: an environment that can save and load its own state as
bytes is captured by that state at every turn instead of being replayed after a restore
(one that keeps a live process or a connection whose effects a replay cannot redo)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["StateExport", "offers_state_export"]


@runtime_checkable
class StateExport(Protocol):
    """What an environment offers to be captured by its state.

    ``get_state()`` returns the environment's whole state as bytes after a step;
    ``set_state(data)``, called on an environment constructed afresh, makes it the
    environment that returned ``data``. The adapter stores the bytes as the session's
    state: nemo-ckpt never decodes them.
    """

    def get_state(self) -> bytes: ...

    def set_state(self, data: bytes) -> None: ...


def offers_state_export(env: Any) -> bool:
    """Whether ``env`` offers both halves of the state export."""
    return isinstance(env, StateExport)
