"""Checks of command-line options and paths, shared by ``nemo-ckpt`` and the examples.

Everything here runs before Ray is imported: a bad option is a usage error (argparse's
exit code 2) in a fraction of a second, not a traceback after a cluster has started.
The path checks leave nothing behind: a folder they create to try it is removed again.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from nemo_ckpt.errors import CheckpointPathError
from nemo_ckpt.storage.location import LocalLocation, as_path_or_url, parse_location

__all__ = [
    "checkpoint_path",
    "checkpoint_folder",
    "at_least",
    "positive_float",
    "non_negative_float",
    "non_empty",
    "writable_folder_problem",
    "output_file_problem",
]


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type=`` for an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type=`` for a finite number above 0."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse ``type=`` for a finite number of 0 or more."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def non_empty(text: str) -> str:
    """An argparse ``type=`` for a name: not empty, no whitespace around it."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    if text != text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} has whitespace around it")
    return text


def checkpoint_path(text: str) -> Path | str:
    """An argparse ``type=`` for a checkpoint path: a folder (a ``Path``) or an object
    store's URL (text, as ``nemo_ckpt.storage.location`` writes it); a malformed URL is refused
    with why, never taken for a folder named after it."""
    try:
        return as_path_or_url(text)
    except CheckpointPathError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def checkpoint_folder(text: str) -> Path:
    """An argparse ``type=`` for the examples' ``--checkpoint-dir``: a local folder. A
    URL is refused with why (their toy data plane writes RL's half as files beside the
    environment's), never taken for a folder named after it."""
    try:
        location = parse_location(text)
    except CheckpointPathError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not isinstance(location, LocalLocation):
        raise argparse.ArgumentTypeError(
            f"{location} is an object-store URL; this example keeps RL's half of each "
            f"checkpoint in files beside the environment's, so it needs a folder")
    return location.path


def writable_folder_problem(folder: Path) -> str | None:
    """Why files cannot be written under ``folder`` (created if missing), or None.

    Tries it for real, since permissions alone do not tell (root, read-only mounts,
    full disks): creates the missing folders and a temporary file, then removes every
    one of them, so nothing is left whatever the answer.
    """
    folder = Path(folder).expanduser().absolute()
    missing: list[Path] = []
    existing = folder
    while not existing.exists():
        if existing.is_symlink():
            return f"{existing} is a broken symbolic link"
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    created: list[Path] = []
    try:
        for path in reversed(missing):
            path.mkdir()
            created.append(path)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".nemo-ckpt-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = "" if exc.filename in (None, str(folder)) else f" ({exc.filename})"
        return f"cannot write under {folder}: {exc.strerror or exc}{where}"
    finally:
        for path in reversed(created):
            with contextlib.suppress(OSError):
                path.rmdir()
    return None


def output_file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be written as an output file later, or None.

    The file's folder is checked as ``writable_folder_problem`` does; an existing file
    is opened for appending, which changes nothing in it.
    """
    path = Path(path).expanduser().absolute()
    if path.is_dir():
        return f"{path} is a folder"
    problem = writable_folder_problem(path.parent)
    if problem is not None:
        return problem
    if path.exists():
        try:
            with open(path, "a"):
                pass
        except OSError as exc:
            return f"cannot write {path}: {exc.strerror or exc}"
    return None
