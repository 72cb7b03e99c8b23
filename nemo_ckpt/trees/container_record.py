"""A container's state as recorded at a turn's commit, and as stored (a stored record
may come from anyone: every field is bounded and checked when it is read).

A container is its image (named by id, the digest of its configuration) and how it was
created (command, entrypoint, environment, working directory, user, whether podman ran
its init process as PID 1: ``--init``), plus what it
changed: its overlay upper directory as a sandbox tree (``nemo_ckpt.trees``: files,
directories, links, in the shared blob store), the paths it deleted from the image
(whiteouts), the image directories it replaced whole (opaque), and, where CRIU works,
its processes' memory (podman's checkpoint archive, without the filesystem, as one blob).

Stored as msgpack: ``{"v": 1, "image", "command", "entrypoint", "env", "workdir", "user",
"tree", "tree_size", "whiteouts", "opaque", "fifos", "memory", "memory_size",
"policy", "init"}``; ``fifos`` is
``[[path, mode], ...]``; a record without ``init`` (older) was made without it.

It lies below both backends: a snapshot's trees file carries it
(``nemo_ckpt.trees.snapshot_trees``), and what reads stored snapshots (verification, the
catalog, collection) finds a container's image and memory blob in it without the
container backend (``nemo_ckpt.containers``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgpack

from nemo_ckpt.errors import ContainerRuntimeError
from nemo_ckpt.trees.limits import MAX_DEPTH

__all__ = ["ContainerConfig", "ContainerRecord", "decode_record", "encode_record",
           "check_relative_path", "MAX_RECORD_BYTES"]

FORMAT = 1
MAX_RECORD_BYTES = 4 << 20  # a stored record longer than this is refused unread
MAX_ARGS = 4096  # command, entrypoint or environment entries
MAX_ARG_BYTES = 128 << 10
MAX_MARKS = 200_000  # whiteouts or opaque directories (a scan's entry limit)
MAX_PATH_BYTES = 4096
_IMAGE_ID = re.compile(r"^[0-9a-f]{64}$")
_DIGEST_BYTES = 16


@dataclass(frozen=True, slots=True)
class ContainerConfig:
    """How a container was created, enough to create its next attempt's."""

    image: str  # the image's full id: 64 hex digits
    command: tuple[str, ...]
    entrypoint: tuple[str, ...] | None
    env: tuple[str, ...]
    workdir: str
    user: str
    # Run under podman's own init process (``--init``): a flag only, never a path; the
    # binary is the one the restoring node's podman is configured with.
    init: bool = False


@dataclass(frozen=True, slots=True)
class ContainerRecord:
    """What is stored of one container (see the module docstring)."""

    config: ContainerConfig
    tree: bytes  # the upper directory's top tree object's digest
    tree_size: int
    whiteouts: tuple[str, ...]
    opaque: tuple[str, ...]
    fifos: tuple[tuple[str, int], ...]  # (path, mode bits)
    memory: bytes | None  # the checkpoint archive's digest, None when not captured
    memory_size: int
    # What the session needs of its memory (nemo_ckpt.sandbox_backend.MemoryPolicy).
    policy: str = "preferred"


def encode_record(record: ContainerRecord) -> bytes:
    c = record.config
    return msgpack.packb({
        "v": FORMAT, "image": c.image, "command": list(c.command),
        "entrypoint": None if c.entrypoint is None else list(c.entrypoint),
        "env": list(c.env), "workdir": c.workdir, "user": c.user,
        "tree": record.tree, "tree_size": record.tree_size,
        "whiteouts": list(record.whiteouts), "opaque": list(record.opaque),
        "fifos": [[p, m] for p, m in record.fifos],
        "memory": record.memory, "memory_size": record.memory_size,
        "policy": record.policy, "init": c.init,
    }, use_bin_type=True)


def decode_record(data: bytes, where: str) -> ContainerRecord:
    """A stored record, checked: ``ContainerRuntimeError`` naming ``where`` and the
    field for anything malformed or past a bound."""
    if len(data) > MAX_RECORD_BYTES:
        raise ContainerRuntimeError(f"the container record of {where} is {len(data)} "
                                    f"bytes, more than {MAX_RECORD_BYTES}: crafted?")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True,
                              max_array_len=MAX_MARKS, max_map_len=32,
                              max_str_len=MAX_ARG_BYTES, max_bin_len=64)
    except Exception as exc:  # msgpack raises several kinds for malformed input
        raise ContainerRuntimeError(f"the container record of {where} is not "
                                    f"readable: {exc}") from None
    if not isinstance(raw, dict) or raw.get("v") != FORMAT:
        raise ContainerRuntimeError(f"the container record of {where} is not format "
                                    f"{FORMAT}: written by a newer release, or damaged")

    def bad(field: str, why: str) -> ContainerRuntimeError:
        return ContainerRuntimeError(f"the container record of {where}: {field} {why}")

    image = raw.get("image")
    if not isinstance(image, str) or not _IMAGE_ID.match(image):
        raise bad("image", "is not an image id (64 hex digits)")
    command = _strings(raw.get("command"), "command", bad)
    entry = raw.get("entrypoint")
    entrypoint = None if entry is None else _strings(entry, "entrypoint", bad)
    env = _strings(raw.get("env"), "env", bad)
    if any("=" not in e for e in env):
        raise bad("env", "holds an entry without '='")
    workdir, user = raw.get("workdir"), raw.get("user")
    if not isinstance(workdir, str) or not workdir.startswith("/") \
            or len(workdir) > MAX_PATH_BYTES or "\x00" in workdir:
        raise bad("workdir", "is not an absolute path")
    if not isinstance(user, str) or len(user) > 256 or "\x00" in user:
        raise bad("user", "is not a user name")
    tree, tree_size = raw.get("tree"), raw.get("tree_size")
    if not isinstance(tree, bytes) or len(tree) != _DIGEST_BYTES \
            or type(tree_size) is not int or not 0 < tree_size <= MAX_RECORD_BYTES * 64:
        raise bad("tree", "is not a tree digest and length")
    marks = []
    for field in ("whiteouts", "opaque"):
        paths = _strings(raw.get(field), field, bad)
        for p in paths:
            problem = check_relative_path(p)
            if problem is not None:
                raise bad(field, f"names {p[:200]!r}: {problem}")
        marks.append(paths)
    fifos_raw = raw.get("fifos")
    if not isinstance(fifos_raw, list) or len(fifos_raw) > MAX_MARKS:
        raise bad("fifos", "is not a list of [path, mode]")
    fifos: list[tuple[str, int]] = []
    for item in fifos_raw:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and type(item[1]) is int and 0 <= item[1] <= 0o777):
            raise bad("fifos", "is not a list of [path, mode]")
        problem = check_relative_path(item[0])
        if problem is not None:
            raise bad("fifos", f"names {item[0][:200]!r}: {problem}")
        fifos.append((item[0], item[1]))
    memory, memory_size = raw.get("memory"), raw.get("memory_size")
    if memory is not None and (not isinstance(memory, bytes) or len(memory) != _DIGEST_BYTES):
        raise bad("memory", "is not a blob digest")
    if type(memory_size) is not int or memory_size < 0 \
            or (memory is None) != (memory_size == 0):
        raise bad("memory_size", "does not match memory")
    policy = raw.get("policy")
    if policy not in ("required", "preferred", "off"):
        raise bad("policy", "is not required, preferred or off")
    init = raw.get("init", False)
    if not isinstance(init, bool):
        raise bad("init", "is not true or false")
    return ContainerRecord(
        ContainerConfig(image, command, entrypoint, env, workdir, user, init),
        tree, tree_size, marks[0], marks[1], tuple(fifos), memory, memory_size, policy)


def check_relative_path(path: str) -> str | None:
    """None for a plain relative path (``a/b/c``: no empty, ``.`` or ``..`` part, no
    NUL, within the depth and length bounds), else what is wrong with it."""
    if not path or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return "empty or too long"
    parts = path.split("/")
    if len(parts) > MAX_DEPTH:
        return f"deeper than {MAX_DEPTH}"
    if any(p in ("", ".", "..") or "\x00" in p for p in parts):
        return "not a plain relative path"
    return None


def _strings(value: Any, field: str, bad: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_MARKS:
        raise bad(field, "is not a list of strings")
    if not all(isinstance(v, str) and "\x00" not in v for v in value):
        raise bad(field, "is not a list of strings")
    if field in ("command", "entrypoint", "env") and len(value) > MAX_ARGS:
        raise bad(field, f"has more than {MAX_ARGS} entries")
    return tuple(value)
