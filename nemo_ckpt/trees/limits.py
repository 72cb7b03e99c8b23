"""What a sandbox may hold when it is scanned, and what a stored tree may expand to
when it is read (``CheckpointConfig``'s ``sandbox_*`` fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """What one scan may record; each is a ``CheckpointConfig`` field (named in the
    error). Bytes are stored bytes: a sparse file counts its data extents."""

    file_bytes: int = 1 << 30
    sandbox_bytes: int = 8 << 30
    files: int = 200_000  # entries of any kind: files, directories and links


MAX_DEPTH = 256  # directories deeper than this are refused when a stored tree is read


@dataclass(frozen=True, slots=True)
class TreeBudget:
    """What one read of a stored tree may expand to: entries (a subtree named twice
    counts twice: a tree object may be referenced from many places, so a few crafted
    objects could name 2^30 directories), the bytes its files claim, and its depth.
    Checked as the tree is expanded, so an over-budget tree costs at most the budget.
    ``entries`` and ``bytes`` are ``CheckpointConfig`` fields (named in the error)."""

    entries: int = SandboxLimits().files
    bytes: int = SandboxLimits().sandbox_bytes
    depth: int = MAX_DEPTH
