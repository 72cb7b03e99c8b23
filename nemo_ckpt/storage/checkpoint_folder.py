"""Where a checkpoint's files go: the ``Folder`` at a path or URL, and the environment's
half of a checkpoint (``<checkpoint_path>/environment/``).

Files go through a ``Folder`` (``nemo_ckpt.storage.folder``; on a filesystem,
``nemo_ckpt.storage.local_folder``, in a bucket ``nemo_ckpt.storage.object_folder``), which makes
each appear whole once durable, or not at all. A path is a local folder, a URL a bucket's
prefix (``nemo_ckpt.storage.location``).
"""

from __future__ import annotations

from pathlib import Path

from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.local_folder import LocalFolder
from nemo_ckpt.storage.location import ObjectLocation, parse_location
from nemo_ckpt.storage.manifest import ENVIRONMENT_DIR

__all__ = ["PROBE_DIR", "as_folder", "environment_dir", "environment_folder", "folder_at",
           "prepare_environment_dir"]


def environment_dir(checkpoint_path: Path | str) -> Path:
    """The folder that holds the environment's half of a checkpoint."""
    return Path(checkpoint_path) / ENVIRONMENT_DIR


# Where check_startup's probes go, under the checkpoint root.
PROBE_DIR = ".nemo_ckpt_probe"


def folder_at(where: Path | str, *, probe: bool = False) -> Folder:
    """The ``Folder`` at a path or URL (``nemo_ckpt.storage.location``). A ``probe``'s folder
    fails fast: a bucket's client retries only briefly before saying nobody answers."""
    location = parse_location(where)
    if isinstance(location, ObjectLocation):
        from nemo_ckpt.storage.object_folder import ObjectFolder  # obstore only when used

        return ObjectFolder(location, probe=probe)
    return LocalFolder(location.path)


def environment_folder(checkpoint_path: Path | str) -> Folder:
    """The ``Folder`` that holds the environment's half of a checkpoint."""
    location = parse_location(checkpoint_path)
    if isinstance(location, ObjectLocation):
        from nemo_ckpt.storage.object_folder import ObjectFolder

        prefix = f"{location.prefix}/{ENVIRONMENT_DIR}" if location.prefix else ENVIRONMENT_DIR
        return ObjectFolder(ObjectLocation(location.scheme, location.bucket, prefix))
    return LocalFolder(environment_dir(location.path))


def as_folder(directory: Folder | Path | str) -> Folder:
    """``directory`` as a ``Folder``: a path is a local folder, a URL a bucket's prefix."""
    if isinstance(directory, (Path, str)):
        return folder_at(directory)
    return directory


def prepare_environment_dir(checkpoint_path: Path | str) -> Path:
    """Create ``<checkpoint_path>/environment`` if needed and return it."""
    folder = LocalFolder(environment_dir(checkpoint_path))
    folder.prepare()
    return folder.path
