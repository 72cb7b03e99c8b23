"""What the rollout checkpoint manager removes under its root: the snapshots retention
drops (never one reached through a link), the leftovers an interrupted snapshot or
removal left (a folder it named, holding no committed manifest, swept under a removal's
claim so another manager's snapshot in progress is never taken), and a failed
snapshot's folder tidied. Which snapshots retention keeps is ``retention`` (pure);
``RolloutCheckpointManager`` (``rollout_manager``) holds one ``ManagedRemovals`` and
calls it under its lock.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from nemo_ckpt.catalog.listing import claim_for_removal, remove_snapshot
from nemo_ckpt.errors import CheckpointPathBusyError, NemoCkptError
from nemo_ckpt.manager.config import RolloutCheckpointConfig
from nemo_ckpt.manager.contract import ManagedSnapshot, RlHalf
from nemo_ckpt.manager.record import RECORD_FILE
from nemo_ckpt.manager.retention import retained
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.location import LocalLocation, join_location, parse_location
from nemo_ckpt.storage.manifest import MANIFEST_NAME

__all__ = ["ManagedRemovals", "Owner", "SNAPSHOT_PREFIX"]

log = logging.getLogger("nemo_ckpt")

# The folders the manager names under the root begin so: its sweep looks at no other.
SNAPSHOT_PREFIX = "rollout-"


class Owner(Protocol):
    """What the removals read of their manager, as it is at each call (a caller may
    give the manager another ``rl`` between snapshots)."""

    config: RolloutCheckpointConfig
    rl: RlHalf


class ManagedRemovals:
    """The manager's removals under ``owner.config.root`` (see the module docstring).

    Args:
        owner: The manager: its ``config`` (root, ``keep_latest_k``) and RL's half,
            whose ``remove`` takes RL's files of a snapshot.
        blocking: Runs file work off the loop (the manager's).
        clock: The monotonic clock claims are judged on.
        on_event: Called with ``("removing", path)`` before retention removes one.
    """

    def __init__(self, owner: Owner, blocking: Callable[..., Awaitable[Any]],
                 clock: Callable[[], float], on_event: Callable[[str, str], None]) -> None:
        self._owner = owner
        self._blocking = blocking
        self._clock = clock
        self._on_event = on_event
        # Links under the root the sweep has warned of (once each).
        self._links_warned: set[str] = set()

    async def retain(self, found: list[ManagedSnapshot], trainer_step: int | None
                     ) -> list[str]:
        """Remove every snapshot of ``found`` (the managed ones, newest first) but those
        retention keeps, then the leftovers the sweep may take. Returns the paths
        removed; a removal that fails is left for the next retention."""
        keep = retained(found, self._owner.config.keep_latest_k, trainer_step)
        removed = []
        for snap in found:
            if snap.path not in keep:
                if _through_link(self._owner.config.root, snap.path):
                    # Only what the manager made is its to remove: never through a link.
                    log.warning("rollout retention leaves %s: it is reached through a "
                                "symbolic link under %s; remove it by hand if it is yours",
                                snap.path, self._owner.config.root)
                    continue
                self._on_event("removing", snap.path)
                try:
                    await self._blocking(remove_snapshot, snap.path, self._owner.config.root)
                except (OSError, NemoCkptError) as exc:  # busy, say: the next one retries
                    log.warning("rollout retention could not remove %s (%s); the next "
                                "retention retries", snap.path, exc)
                    continue
                await self.tidy(snap.path)
                removed.append(snap.path)
        for path in await self._blocking(self.leftovers, {s.path for s in found}):
            if await self.sweep(path):
                removed.append(path)
        if removed:
            log.info("rollout retention removed %d snapshot(s): %s", len(removed),
                     ", ".join(removed))
        return removed

    async def sweep(self, path: str) -> bool:
        """Remove the leftover at ``path`` as ``tidy`` does, under a removal's claim on
        its folder (``claim_for_removal``): refused while any operation's claim there is
        live (another manager's snapshot on this root, still writing), and then left for
        a later retention. Whether it was removed."""
        try:
            release = await self._blocking(claim_for_removal, path, self._clock)
        except CheckpointPathBusyError:
            log.info("rollout retention leaves %s: an operation in progress claims it",
                     path)
            return False
        except (OSError, NemoCkptError) as exc:
            log.warning("rollout retention could not look at %s (%s); the next retention "
                        "retries", path, exc)
            return False
        try:
            # Under the claim, no snapshot commits here: one committed since the listing
            # is no leftover.
            if await self._blocking(_holds_manifest, path):
                return False
            await self._owner.rl.remove(path)
            await self._blocking(_drop_record, path)
        except (OSError, NemoCkptError) as exc:
            log.warning("could not tidy %s (%s); the next retention retries", path, exc)
            return False
        finally:
            try:
                await self._blocking(release)
            except (OSError, NemoCkptError) as exc:  # seen abandoned in time
                log.warning("could not release the claim on %s (%s)", path, exc)
        await self._blocking(_remove_empty_folders, path)
        return True

    async def tidy(self, path: str) -> None:
        """Remove RL's half, the record and the folder of a snapshot that is not (or no
        longer) committed; best effort, as the next retention sweeps what is left."""
        try:
            await self._owner.rl.remove(path)
            await self._blocking(_drop_record_and_folder, path)
        except (OSError, NemoCkptError) as exc:
            log.warning("could not tidy %s (%s); the next retention retries", path, exc)

    def leftovers(self, committed: set[str]) -> list[str]:
        """Folders the manager named that hold no committed snapshot: what a snapshot
        or a removal cut short left, or a snapshot in progress (this manager's lock
        keeps its own out; ``sweep`` leaves others'). On a filesystem only real folders
        directly under the root: a link there is left alone, with a warning."""
        root = folder_at(self._owner.config.root)
        local = isinstance(parse_location(self._owner.config.root), LocalLocation)
        left = []
        for name in root.subfolders():
            path = join_location(self._owner.config.root, name)
            if not name.startswith(SNAPSHOT_PREFIX) or path in committed:
                continue
            if local:
                try:
                    mode = os.lstat(path).st_mode
                except FileNotFoundError:
                    continue
                if stat.S_ISLNK(mode):
                    if path not in self._links_warned:
                        self._links_warned.add(path)
                        log.warning("rollout retention leaves %s alone: a symbolic link "
                                    "where the manager makes only folders; remove the "
                                    "link itself if it is not wanted", path)
                    continue
                if not stat.S_ISDIR(mode):
                    continue
            if not _holds_manifest(path):
                left.append(path)
        return left


def _holds_manifest(path: str) -> bool:
    return MANIFEST_NAME in folder_at(join_location(path, "environment")).names()


def _through_link(root: str, path: str) -> bool:
    """Whether ``path``, below ``root`` on a filesystem, is reached through a link."""
    if not isinstance(parse_location(path), LocalLocation):
        return False
    here, base = Path(path), Path(root)
    while here != base and base in here.parents:
        if here.is_symlink():
            return True
        here = here.parent
    return False


def _drop_record(path: str) -> None:
    folder = folder_at(path)
    if RECORD_FILE in folder.names():
        folder.remove([RECORD_FILE])


def _drop_record_and_folder(path: str) -> None:
    _drop_record(path)
    _remove_empty_folders(path)


def _remove_empty_folders(path: str) -> None:
    location = parse_location(path)
    if isinstance(location, LocalLocation):
        for empty in (location.path / "environment", location.path):
            try:
                os.rmdir(empty)  # only if empty: never RL's files
            except OSError:
                pass
