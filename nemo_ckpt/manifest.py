"""The snapshot manifest: what one committed environment snapshot holds.

On disk::

    <checkpoint_path>/environment/manifest.json   # written last: present means complete
    <checkpoint_path>/environment/<shard files>   # msgpack, one or more per holder

The manifest is JSON, validated by the pydantic models below. It carries each shard's
byte length and content hash, so a restore verifies every byte before it installs anything.

Format versions: 2 (written) names each shard's hash with its algorithm, XXH3-128 by
default; 1 (still read) carried a bare SHA-256 per shard, read as ``sha256:<hex>``.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "FORMAT_VERSION",
    "CONTENT_HASH_PATTERN",
    "SUPPORTED_FORMAT_VERSIONS",
    "ENVIRONMENT_DIR",
    "MANIFEST_NAME",
    "ShardEntry",
    "RolloutEntry",
    "Manifest",
    "is_plain_file_name",
    "upgrade_v1",
    "shard_file_name",
]

FORMAT_VERSION: Literal[2] = 2
SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2})
ENVIRONMENT_DIR = "environment"
MANIFEST_NAME = "manifest.json"
SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".msgpack"

# "<algorithm>:<hex digest>"; storage.content_hasher knows each algorithm.
CONTENT_HASH_PATTERN = r"^(xxh3-128:[0-9a-f]{32}|sha256:[0-9a-f]{64})$"

_SAFE_PART = re.compile(r"[^A-Za-z0-9_.-]")


def is_plain_file_name(name: str) -> bool:
    """Whether ``name`` names a file directly inside its folder, on any platform."""
    if not name or name in (".", ".."):
        return False
    if "/" in name or "\\" in name or "\x00" in name:
        return False
    return PurePosixPath(name).name == name and PureWindowsPath(name).name == name


def shard_file_name(snapshot_id: str, instance_id: str, index: int = 0) -> str:
    """The file name of a holder's ``index``-th shard in snapshot ``snapshot_id``.

    Names carry the snapshot id, so a new snapshot written into a folder that holds an
    older one never overwrites the older one's shards before its manifest commits.
    """
    sid = _SAFE_PART.sub("_", snapshot_id)
    inst = _SAFE_PART.sub("_", instance_id)
    return f"{SHARD_PREFIX}{sid}-{inst}-{index:04d}{SHARD_SUFFIX}"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ShardEntry(_Model):
    """One shard file of the snapshot."""

    file: str = Field(description="Plain file name inside the environment folder.")
    bytes: int = Field(ge=0, description="Exact byte length of the file.")
    content_hash: str = Field(
        pattern=CONTENT_HASH_PATTERN,
        description="The file's hash as '<algorithm>:<hex digest>' (xxh3-128 or sha256).")
    instance_id: str = Field(min_length=1, description="The instance whose sessions it holds.")
    sessions: int = Field(ge=0, description="How many sessions it holds.")


class RolloutEntry(_Model):
    """One captured rollout: where it lives and what it references."""

    instance_id: str = Field(min_length=1, description="The instance that captured it.")
    rollout_id: str = Field(min_length=1, description="The rollout's base id.")
    attempt: int = Field(ge=0, description="The attempt that was captured.")
    turns: int = Field(ge=0, description="Turns committed when it was captured.")
    staging_keys: list[str] = Field(description="Staging rows it references, sorted.")
    shard: str = Field(description="The shard file that holds its session.")


class Manifest(_Model):
    """A committed environment snapshot. Written last; its presence means complete."""

    format_version: Literal[1, 2] = Field(description="Version of this on-disk format.")
    snapshot_id: str = Field(min_length=1, description="Id carried by every phase.")
    created_at: datetime = Field(description="When the snapshot was committed (UTC).")
    instances: list[str] = Field(
        description="Every instance that took part, including those that held nothing."
    )
    shards: list[ShardEntry] = Field(description="Every shard file of the snapshot.")
    rollouts: list[RolloutEntry] = Field(description="Every captured rollout.")
    restarted_rollouts: int = Field(ge=0, description="Rollouts held but not captured.")
    metrics: dict[str, float] = Field(description="The snapshot's metrics, as logged.")

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        files = Counter(s.file for s in self.shards)
        if dup := sorted(f for f, n in files.items() if n > 1):
            raise ValueError(f"shard files listed twice: {dup}")
        rollouts = Counter(r.rollout_id for r in self.rollouts)
        if dup := sorted(r for r, n in rollouts.items() if n > 1):
            raise ValueError(f"rollouts listed twice: {dup}")
        shard_of = {s.file: s for s in self.shards}
        per_shard: Counter[str] = Counter()
        for r in self.rollouts:
            shard = shard_of.get(r.shard)
            if shard is None:
                raise ValueError(f"rollout {r.rollout_id!r} names unknown shard {r.shard!r}")
            if shard.instance_id != r.instance_id:
                raise ValueError(
                    f"rollout {r.rollout_id!r} of {r.instance_id} sits in shard {r.shard!r} "
                    f"of {shard.instance_id}"
                )
            per_shard[r.shard] += 1
        for s in self.shards:
            if s.sessions != per_shard[s.file]:
                raise ValueError(
                    f"shard {s.file!r} says {s.sessions} sessions but {per_shard[s.file]} "
                    f"rollouts name it"
                )
        if missing := sorted({s.instance_id for s in self.shards} - set(self.instances)):
            raise ValueError(f"shards of instances not listed in instances: {missing}")
        return self


def upgrade_v1(data: Any) -> Any:
    """A version-1 manifest's JSON data in the version-2 shape (its version kept): v1
    named each shard's SHA-256 ``sha256``; v2 says ``content_hash: "sha256:<hex>"``.
    Anything else is returned as it is, for validation to refuse."""
    if not (isinstance(data, dict) and data.get("format_version") == 1
            and isinstance(data.get("shards"), list)):
        return data
    shards = []
    for shard in data["shards"]:
        if isinstance(shard, dict) and "sha256" in shard:
            shard = dict(shard)
            shard["content_hash"] = f"sha256:{shard.pop('sha256')}"
        shards.append(shard)
    return {**data, "shards": shards}
