"""What every ``nemo-ckpt`` command prints with: tables, sizes, numbers, error lines."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nemo_ckpt.catalog.verification import one_line
from nemo_ckpt.errors import SnapshotNotFoundError, SnapshotReadError
from nemo_ckpt.storage.manifest import ENVIRONMENT_DIR, MANIFEST_NAME

__all__ = ["PROG", "human_bytes", "number", "one_line", "read_error", "table"]

PROG = "nemo-ckpt"


def human_bytes(n: float) -> str:
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Left-aligned columns, two spaces apart, no trailing blanks."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()
            for row in cells]


def read_error(command: str, path: Path | str, error: SnapshotReadError) -> str:
    """The one stderr line for a snapshot that cannot be read, with a hint where one helps."""
    message = one_line(error)
    if isinstance(error, SnapshotNotFoundError) and isinstance(path, Path) \
            and (path / MANIFEST_NAME).is_file():
        # The commonest slip: pointing at <checkpoint>/environment instead of <checkpoint>.
        message += (f" ({path} itself holds {MANIFEST_NAME}: it looks like the "
                    f"{ENVIRONMENT_DIR}/ folder; pass its parent, {path.parent})")
    return f"{PROG} {command}: error: {message}"
