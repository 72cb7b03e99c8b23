"""The sandboxes a sandbox provider made for a holder's sessions (NeMo Gym's, through
``nemo_ckpt.integrations.nemo_gym``), each marked on its node so that it is removed
exactly once whatever happens to its rollout (blocking).

A provider marks a sandbox before it makes it and unmarks it after it removed it
(``Gym close``). The holder releases the sandbox of a session that leaves it for good
(RL retires or forgets it, or its worker closes it): it removes the sandbox and its mark.
A new holder of the instance removes every sandbox still marked (``remove_left``): they
belonged to sessions of a dead incarnation (a restore makes each continued attempt's
sandbox anew, under another name, and marks it when the rollout's was). Removing what
is gone already is a no-op, so a removal that ran twice (a provider's close and the
holder's release) is harmless.

    <sandbox_root>/.nemo-ckpt/<namespace>/.provided/<instance>/<capture key>
        {"directory": "<sandbox_root>/<name>"}  or  {"container": "<name>"},
        with "rollout": its rollout id

A mark is read as hostile input: only a directory directly inside ``sandbox_root`` (not
a link, not nemo-ckpt's own folder) or a plain container name is removed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from nemo_ckpt.sandboxes.directories import PRIVATE_DIR
from nemo_ckpt.storage.names import safe_name_part

__all__ = ["ProvidedSandboxes", "provided_label", "PROVIDED_LABEL"]

log = logging.getLogger("nemo_ckpt.holder")
_CONTAINER = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}")
_MAX_MARK_BYTES = 4096
# The label a provider's container carries (``docker run --label``): its job and holder.
PROVIDED_LABEL = "nemo-ckpt.provided"


def provided_label(namespace: str, instance_id: str) -> str:
    """``--label``'s value for a container made for a session on ``instance_id``."""
    return f"{PROVIDED_LABEL}={safe_name_part(namespace)}.{safe_name_part(instance_id)}"


class ProvidedSandboxes:
    """The marks of one instance's provided sandboxes under ``sandbox_root``."""

    def __init__(self, sandbox_root: str | os.PathLike[str], namespace: str,
                 instance_id: str) -> None:
        self.root = Path(os.path.abspath(sandbox_root))
        self.folder = (self.root / PRIVATE_DIR / safe_name_part(namespace) / ".provided"
                       / safe_name_part(instance_id))

    def _mark_of(self, capture_key: str) -> Path:
        return self.folder / safe_name_part(capture_key)

    def mark(self, capture_key: str, *, directory: str | os.PathLike[str] | None = None,
             container: str | None = None, rollout_id: str | None = None) -> None:
        """Mark the sandbox of ``capture_key``'s session (of ``rollout_id``), before it
        is made."""
        what: dict[str, str | None] = {"directory": os.fspath(directory)} \
            if directory is not None else {"container": container}
        what["rollout"] = rollout_id
        self.folder.mkdir(parents=True, exist_ok=True)
        mark = self._mark_of(capture_key)
        tmp = mark.with_name(f".{mark.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(what))
        os.replace(tmp, mark)

    def unmark(self, capture_key: str) -> None:
        self._mark_of(capture_key).unlink(missing_ok=True)

    def is_marked(self, capture_key: str) -> bool:
        return self._mark_of(capture_key).exists()

    def marked(self) -> list[str]:
        """The names of the marks (safe capture keys), sorted."""
        if not self.folder.is_dir():
            return []
        return sorted(p.name for p in self.folder.iterdir() if not p.name.startswith("."))

    def rollouts(self) -> set[str]:
        """The rollouts whose sandboxes are marked (a restore continuing one marks its
        sandbox in turn)."""
        found = set()
        for name in self.marked():
            try:
                what = json.loads((self.folder / name).read_bytes()[:_MAX_MARK_BYTES])
            except (OSError, ValueError):
                continue
            rollout = what.get("rollout") if isinstance(what, dict) else None
            if isinstance(rollout, str):
                found.add(rollout)
        return found

    def release(self, capture_key: str, remove_container: Callable[[str], None] | None
                ) -> bool:
        """Remove the sandbox marked for ``capture_key`` and its mark; False if none is
        marked, or it was gone already. ``remove_container`` removes a container
        (None: containers are not this node's to remove, the mark stays)."""
        mark = self._mark_of(capture_key)
        try:
            raw = mark.read_bytes()[:_MAX_MARK_BYTES + 1]
        except FileNotFoundError:
            return False
        return self._remove(mark.name, raw, remove_container)

    def remove_left(self, remove_container: Callable[[str], None] | None) -> int:
        """Remove every sandbox still marked (a dead incarnation's); returns how many."""
        count = 0
        for name in self.marked():
            try:
                raw = (self.folder / name).read_bytes()[:_MAX_MARK_BYTES + 1]
            except FileNotFoundError:
                continue
            if self._remove(name, raw, remove_container):
                count += 1
        return count

    def _remove(self, name: str, raw: bytes, remove_container: Callable[[str], None] | None
                ) -> bool:
        """Remove what the mark ``name`` (its bytes ``raw``) names, then the mark: True
        if it named a sandbox this holder may remove."""
        mark = self.folder / name
        try:
            what = json.loads(raw) if len(raw) <= _MAX_MARK_BYTES else None
        except ValueError:
            what = None
        directory = what.get("directory") if isinstance(what, dict) else None
        container = what.get("container") if isinstance(what, dict) else None
        if isinstance(directory, str):
            path = Path(os.path.abspath(directory))
            if path.parent != self.root or path.name == PRIVATE_DIR or path.is_symlink():
                log.warning("%s: mark %s names %s, not a sandbox directly inside %s; left "
                            "as it is", self.folder, name, directory, self.root)
                mark.unlink(missing_ok=True)
                return False
            gone = not path.exists()  # removed already (a close that died unmarking)
            shutil.rmtree(path, ignore_errors=True)
            mark.unlink(missing_ok=True)
            return not gone
        elif isinstance(container, str) and _CONTAINER.fullmatch(container):
            if remove_container is None:
                return False
            remove_container(container)
        else:
            log.warning("%s: mark %s names no sandbox (%r); removed", self.folder, name,
                        raw[:200])
            mark.unlink(missing_ok=True)
            return False
        mark.unlink(missing_ok=True)
        return True
