"""What every ``nemo-ckpt`` command prints with: tables, sizes, numbers, error lines."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from nemo_ckpt.catalog.verification import one_line
from nemo_ckpt.errors import SnapshotNotFoundError, SnapshotReadError
from nemo_ckpt.progress import CatalogProgress
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.location import ObjectLocation, parse_location
from nemo_ckpt.storage.manifest import ENVIRONMENT_DIR, MANIFEST_NAME
from nemo_ckpt.storage.snapshot_files import committed_snapshots

__all__ = ["PROG", "ProgressLine", "add_progress_option", "human_bytes", "nothing_at_root",
           "number", "one_line", "progress_line", "read_error", "table"]

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


def read_error(command: str, path: Path | str, error: SnapshotReadError,
               then: str = "") -> str:
    """The one stderr line for a snapshot that cannot be read, with a hint where one helps.
    A path that holds no snapshot is a user's slip, not damage: it is told apart from a
    snapshot to give up on (``then``: what the command did, as "Nothing was removed.")."""
    message = one_line(error)
    if isinstance(error, SnapshotNotFoundError):
        why = _not_a_snapshot(path)
        if why is not None:
            message = f"no environment snapshot at {folder_at(str(path)).describe()}: {why}"
    if then and then not in message:
        message += f" {then}"
    return f"{PROG} {command}: error: {message}"


def nothing_at_root(root: Path | str) -> str | None:
    """Why ``root``, a bucket's prefix, is no checkpoint root: nothing at all is there
    (None when something is, or ``root`` is a folder, which ``list_snapshots`` checks
    itself). A prefix exists only while an object is under it, so the library takes an
    empty one for a root without snapshots yet; a user who typed it has mistyped it."""
    if not isinstance(parse_location(root), ObjectLocation):
        return None
    folder = folder_at(str(root))
    if folder.names() or folder.subfolders():
        return None
    return (f"there is nothing at {folder.describe()}, so it is no checkpoint root "
            f"(mistyped?): pass CheckpointConfig.checkpoint_root, or a prefix above "
            f"checkpoint paths")


def _not_a_snapshot(path: Path | str) -> str | None:
    """Why ``path`` (no manifest under it) is not a snapshot, when it is a slip: the
    environment folder itself, a checkpoint root, or nothing at all."""
    if isinstance(path, Path) and (path / MANIFEST_NAME).is_file():
        # The commonest slip: pointing at <checkpoint>/environment instead of <checkpoint>.
        return (f"{path} itself holds {MANIFEST_NAME}: it looks like the {ENVIRONMENT_DIR}/ "
                f"folder; pass its parent, {path.parent}.")
    folder = folder_at(str(path))
    if not folder.names() and not folder.subfolders():
        return (f"there is nothing there (mistyped?): pass the checkpoint path snapshot() "
                f"was given; `{PROG} ls ROOT` lists the snapshots under a root.")
    below = committed_snapshots(path)
    if below:
        return (f"it is a folder above {len(below)} committed snapshot(s): pass one of "
                f"them (`{PROG} ls {folder.describe()}` lists them).")
    return None


def add_progress_option(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress``: a progress line on stderr (default: only when
    stderr is a terminal)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="show a progress line on stderr (default: only when stderr "
                             "is a terminal)")


class ProgressLine:
    """The catalog's progress on stderr, as ``<prog> <command>: <what> <done>/<total>``:
    on a terminal one line rewritten in place, and ended before anything else is
    printed; elsewhere (``--progress`` into a file or a pipe) a line per step."""

    def __init__(self, command: str, err: TextIO, terminal: bool) -> None:
        self._prefix = f"{PROG} {command}: "
        self._err = err
        self._terminal = terminal
        self._open = False  # a line without its newline yet (terminal only)

    def __call__(self, step: CatalogProgress) -> None:
        text = f"{self._prefix}{step.what} {step.done}/{step.total}"
        if self._terminal:
            self._err.write(f"\r\x1b[K{text}")  # back to the start, clear the old line
            self._open = True
        else:
            self._err.write(text + "\n")
        self._err.flush()

    def end(self) -> None:
        """End the line being rewritten, so what follows starts on its own."""
        if self._open:
            self._err.write("\n")
            self._err.flush()
            self._open = False


def progress_line(command: str, wanted: bool | None, err: TextIO) -> ProgressLine | None:
    """The progress line of ``command`` when ``wanted`` (None: when ``err`` is a
    terminal), else None."""
    terminal = _is_terminal(err)
    if not (terminal if wanted is None else wanted):
        return None
    return ProgressLine(command, err, terminal)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or foreign stream
        return False
