"""How far a long catalog call has got: the type its ``progress`` callback receives.

``verify_snapshot``, ``list_snapshots``, ``latest_snapshot`` and ``keep_last`` (and their
``_async`` forms) report each step of their work as it ends; ``nemo-ckpt verify`` and
``nemo-ckpt rm --keep-last`` render the same reports as a progress line on stderr.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CatalogProgress", "ProgressCallback"]


@dataclass(frozen=True)
class CatalogProgress:
    """``done`` of ``total`` steps of one kind (``what``: "manifests read", "shards
    verified", "directories verified", "snapshots kept or removed", ...) are finished;
    ``current`` names the one that just finished (a path or a file; "" before the first).
    A call may go through several kinds in turn, each counted from 0 to its own total."""

    what: str
    done: int
    total: int
    current: str = ""


ProgressCallback = Callable[[CatalogProgress], None]
