"""Clean-up of a checkpoint folder: the files no committed snapshot names.

Committed is final: a file the manifest at a path names is never removed by anything
here until a newer manifest replaces it. Files of operations in progress elsewhere stay
too (their claims: ``nemo_ckpt.storage.path_claims``), and only files whose names nemo-ckpt makes
are touched.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from pathlib import Path

from nemo_ckpt.errors import CheckpointPathError
from nemo_ckpt.storage.checkpoint_folder import as_folder
from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.local_folder import TMP_MARK
from nemo_ckpt.storage.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, is_plain_file_name
from nemo_ckpt.storage.names import SHARD_PREFIX, SHARD_SUFFIX, shard_file_name
from nemo_ckpt.storage.path_claims import release_claim
from nemo_ckpt.storage.store_errors import NotARegularFileError
from nemo_ckpt.storage.stored_json import load_stored_json

__all__ = ["manifest_shard_files", "manifest_snapshot_id", "remove_files",
           "remove_snapshot_files", "remove_unreferenced_files"]


def remove_files(directory: Folder | Path, names: Iterable[str]) -> None:
    """Remove the named plain files from ``directory``; missing ones are fine."""
    as_folder(directory).remove([name for name in names if is_plain_file_name(name)])


def manifest_shard_files(directory: Folder | Path) -> set[str]:
    """The shard files the manifest in ``directory`` names now (none without one)."""
    folder = as_folder(directory)
    try:
        data = load_stored_json(folder.read(MANIFEST_NAME, MAX_MANIFEST_BYTES + 1),
                                folder.describe(MANIFEST_NAME), MAX_MANIFEST_BYTES)
        files = {str(s["file"]) for s in data["shards"]}
        return files | {str(s["trees"]["file"]) for s in data["shards"] if s.get("trees")}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # A manifest that does not parse protects nothing we can name: remove nothing.
        where = folder.describe(MANIFEST_NAME)
        raise CheckpointPathError(
            where, f"cannot read the shard list of {where} ({exc}); nothing was removed"
        ) from exc


def _is_ours(name: str) -> bool:
    """A shard or a temp file: the only files clean-up touches."""
    return (name.startswith(SHARD_PREFIX) and name.endswith(SHARD_SUFFIX)) or (
        name.startswith(".") and TMP_MARK in name)


def remove_unreferenced_files(directory: Folder | Path,
                              protect: Collection[str] = ()) -> list[str]:
    """After a commit, remove shards and temp files that the manifest here now does not
    name: an older snapshot's that a newer one replaced, or an aborted one's.

    What the manifest names is read here, not passed in, so a clean-up that runs late
    never removes a newer commit's files. Files of the operations in ``protect`` (in
    progress here: see ``live_claims``) stay too, and only files whose names nemo-ckpt
    makes are touched. Returns the names removed.
    """
    folder = as_folder(directory)
    keep = manifest_shard_files(folder)
    stems = [_operation_stem(op) for op in protect]
    removed = [name for name in folder.names()
               if _is_ours(name) and name not in keep
               and not any(name.lstrip(".").startswith(s) for s in stems)]
    folder.remove(removed)
    return removed


def _operation_stem(operation_id: str) -> str:
    """The prefix of every shard name of ``operation_id`` (temp files add a dot)."""
    return shard_file_name(operation_id, "x").rsplit("-x-", 1)[0] + "-"


_SNAPSHOT_ID = re.compile(rb'"snapshot_id"\s*:\s*"((?:[^"\\]|\\.)*)"')


def manifest_snapshot_id(directory: Folder | Path) -> str | None:
    """The snapshot id of the manifest in ``directory`` (the environment folder), None
    if there is none. Reads only the manifest's head, where the id sits."""
    folder = as_folder(directory)
    try:
        head = folder.read(MANIFEST_NAME, 4096)
    except (FileNotFoundError, NotARegularFileError):  # no manifest we could have written
        return None
    where = folder.describe(MANIFEST_NAME)
    match = _SNAPSHOT_ID.search(head)
    if match is not None:
        return str(load_stored_json(b'"' + match.group(1) + b'"', where, len(head) + 2))
    try:
        return str(load_stored_json(folder.read(MANIFEST_NAME, MAX_MANIFEST_BYTES + 1),
                                    where, MAX_MANIFEST_BYTES)["snapshot_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_snapshot_files(directory: Folder | Path, snapshot_id: str) -> bool:
    """Remove every shard, temp file and claim of snapshot ``snapshot_id`` (aborted),
    unless the manifest here names it: committed is final. Returns whether it is the
    committed snapshot (then nothing is removed but its claim)."""
    folder = as_folder(directory)
    try:
        if manifest_snapshot_id(folder) == snapshot_id:
            return True
        stem = _operation_stem(snapshot_id)
        folder.remove([name for name in folder.names() if name.startswith(stem)
                       or (name.startswith("." + stem) and TMP_MARK in name)])
        return False
    finally:
        # Whatever failed above: the operation has ended, and a claim it left would
        # refuse or protect others for nothing until seen abandoned. (Files it failed
        # to remove are garbage to the next commit's clean-up.)
        release_claim(folder, snapshot_id)
