"""The numbers of a root's commits: each snapshot's ``sequence`` (manifest format 6), by
which ``nemo_ckpt.catalog.listing`` lists a root's snapshots newest first, because the hosts that
commit under one root across a job's restarts have clocks with any offset. Storage's, as
the commit it serves is: the coordinator takes one just before it writes a manifest.

A commit takes the next number just before its manifest is written, by creating a file
named for it (holding a token of the commit's own) in ``<root>/.nemo_ckpt_sequence``
that must not exist yet: of two coordinators taking a number at once (a zombie and its
successor, say), the medium lets one create it and the other takes the next. So a commit
that began after another's manifest was written always numbers higher; two commits that
overlap may come out in either order, as either may be called the newer. A medium that
ignores the condition (``Folder.enforces_conditions``) may give one number twice; the
commits' times, then their ids, break such ties (``nemo_ckpt.catalog.listing``). Only the newest
few files are kept. When the folder is missing or empty (a new root, or one a user
tidied), the first number is past the highest any committed manifest under the root
carries (``highest_sequence``).

The root is the job's checkpoint root, or the checkpoint path's parent when it names none.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from nemo_ckpt.errors import NemoCkptError, SnapshotReadError, SnapshotWriteError
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.folder import ABSENT, Folder, write_conditionally
from nemo_ckpt.storage.location import join_location, parent_location
from nemo_ckpt.storage.snapshot_files import committed_snapshots, read_manifest

__all__ = ["SEQUENCE_DIR", "highest_sequence", "sequence_root", "take_sequence"]

SEQUENCE_DIR = ".nemo_ckpt_sequence"
# Numbers kept below the newest: enough for the coordinators racing for one at once.
_KEEP = 16
# A name is a claim: longer ones are not numbers this module wrote.
_MAX_DIGITS = 18
_ATTEMPTS = 64


def sequence_root(checkpoint_root: str | None, checkpoint_path: str) -> str:
    """Where a commit into ``checkpoint_path`` takes its number."""
    return checkpoint_root if checkpoint_root is not None \
        else parent_location(checkpoint_path, 1)


def highest_sequence(root: Path | str) -> int:
    """The highest ``sequence`` of the committed snapshots below ``root`` (0 when none
    has one): what a coordinator's first commit there numbers past. A manifest that does
    not read is passed over, as ``nemo_ckpt.catalog.listing`` lists it apart."""
    highest = 0
    for path in committed_snapshots(root):
        try:
            highest = max(highest, read_manifest(path).sequence or 0)
        except SnapshotReadError:
            continue
    return highest


def _numbers(folder: Folder) -> list[int]:
    return [int(n) for n in folder.names()
            if n.isascii() and n.isdigit() and len(n) <= _MAX_DIGITS]


def take_sequence(root: str) -> int:
    """The next number under ``root``, taken for one commit (the module docstring)."""
    folder = folder_at(join_location(root, SEQUENCE_DIR))
    folder.prepare()
    taken = _numbers(folder)
    number = max(taken) + 1 if taken else highest_sequence(root) + 1
    # Written into the number's file: a retry that meets its own landed create takes it.
    token = uuid.uuid4().hex.encode()
    for _ in range(_ATTEMPTS):
        try:
            write_conditionally(folder, str(number), token, ABSENT, sync=False)
        except FileExistsError:
            number = max([number, *_numbers(folder)]) + 1
            continue
        # Best effort: a number left behind only costs a listing entry.
        old = [str(n) for n in taken if n < number - _KEEP]
        if old:
            try:
                folder.remove(old)
            except (OSError, NemoCkptError):
                pass
        return number
    raise SnapshotWriteError(
        folder.describe(), f"no commit number could be taken under {root} in "
                           f"{_ATTEMPTS} attempts: as many coordinators took one at once; "
                           f"is more than one job committing under this root?")
