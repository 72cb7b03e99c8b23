"""The names a snapshot gives on disk, apart from the manifest's model: its shard and
trees files, and the directories a restore makes for sessions' sandboxes. A holder names
the files it writes and checks the ids it will restore by these alone.
"""

from __future__ import annotations

import hashlib
import re

__all__ = [
    "MAX_SANDBOX_ID_BYTES",
    "NAME_MAX",
    "SHARD_PREFIX",
    "SHARD_SUFFIX",
    "beside",
    "restored_name_problem",
    "safe_name_part",
    "sandbox_id_problem",
    "shard_file_name",
    "trees_file_name",
]

SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".msgpack"

_SAFE_PART = re.compile(r"[^A-Za-z0-9_.-]")


def safe_name_part(text: str) -> str:
    """``text`` with every character a file name should not hold replaced by ``_``."""
    return _SAFE_PART.sub("_", text)


# What a rollout's id becomes on disk when its session owns a sandbox: the directory a
# restore makes is named by the restored attempt's key, ``<id>-a<attempt>`` (escaped by
# ``safe_name_part``: one ASCII byte per character), or, beside one left in place, that
# and ``.<restore id>`` (at most ``RESTORE_SUFFIX_BYTES``). A file name holds at most
# ``NAME_MAX`` bytes; an id within ``MAX_SANDBOX_ID_BYTES`` leaves room for both
# suffixes at any attempt up to 20 digits (docs/DESIGN.md, "On disk").
NAME_MAX = 255
ATTEMPT_SUFFIX_BYTES = 22  # "-a" and 20 digits
RESTORE_SUFFIX_BYTES = 17  # "." and a 16-digit restore tag
MAX_SANDBOX_ID_BYTES = NAME_MAX - ATTEMPT_SUFFIX_BYTES - RESTORE_SUFFIX_BYTES  # 216
MAX_ATTEMPT = 10**20 - 1


def sandbox_id_problem(rollout_id: str, attempt: int) -> str | None:
    """Why a session of ``rollout_id`` (at ``attempt``) may not own a sandbox: the
    names its restores would make could not exist on disk; None when they can."""
    size = len(safe_name_part(rollout_id))
    if size > MAX_SANDBOX_ID_BYTES:
        return (f"rollout id {rollout_id[:40]!r}... is {size} bytes as a file name; at "
                f"most {MAX_SANDBOX_ID_BYTES} for a session with a sandbox directory (a "
                f"restore names the directory <id>-a<attempt>, within the {NAME_MAX}-byte "
                f"limit of a file name); use a shorter id")
    if attempt > MAX_ATTEMPT:
        return f"attempt {attempt} has more than 20 digits"
    return None


def restored_name_problem(key: str) -> str | None:
    """Why a restore cannot name the directory of capture key ``key`` (the restored
    attempt's): it and the suffix of a restore beside it pass ``NAME_MAX``."""
    size = len(safe_name_part(key)) + RESTORE_SUFFIX_BYTES
    if size > NAME_MAX:
        return (f"its restored directory would be named {key[:40]!r}... ({size} bytes "
                f"with a restore's suffix), past the {NAME_MAX}-byte limit of a file name")
    return None


def shard_file_name(snapshot_id: str, instance_id: str, index: int = 0) -> str:
    """The file name of a holder's ``index``-th shard in snapshot ``snapshot_id``.

    Names carry the snapshot id, so a new snapshot written into a folder that holds an
    older one never overwrites the older one's shards before its manifest commits.
    """
    sid = safe_name_part(snapshot_id)
    inst = safe_name_part(instance_id)
    return f"{SHARD_PREFIX}{sid}-{inst}-{index:04d}{SHARD_SUFFIX}"


def trees_file_name(snapshot_id: str, instance_id: str) -> str:
    """The file name of a holder's directory trees in snapshot ``snapshot_id``: a shard
    name, so that clean-up treats it as one."""
    return f"{SHARD_PREFIX}{safe_name_part(snapshot_id)}-{safe_name_part(instance_id)}" \
           f"-trees{SHARD_SUFFIX}"


def beside(key: str, restore_id: str) -> str:
    """The name of a restored sandbox beside one left in place: ``<key>.<restore id>``,
    or, when that passes ``NAME_MAX``, a 16-digit tag of the restore id in its place."""
    name = f"{safe_name_part(key)}.{safe_name_part(restore_id)}"
    if len(name) > NAME_MAX:
        tag = hashlib.blake2b(restore_id.encode("utf-8", "surrogatepass"),
                              digest_size=8).hexdigest()
        name = f"{safe_name_part(key)}.{tag}"
    return name
