"""What the manager writes beside each snapshot it takes: ``rollout_checkpoint.json`` in
the checkpoint folder, written inside the barrier before the environment's manifest (so
a committed snapshot always has it), read on a budget like any stored data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from nemo_ckpt.errors import ManifestInvalidError
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.stored_json import StoredJsonError, load_stored_json

__all__ = ["RECORD_FILE", "ManagedRecord", "read_record", "write_record"]

RECORD_FILE = "rollout_checkpoint.json"
# A fingerprint is a handful of fields: more is a claim, not a record we wrote.
_MAX_BYTES = 256 * 1024


class ManagedRecord(BaseModel):
    """One managed snapshot's facts: the trainer step it anchors to (None for a periodic
    one) and the fingerprint of the job that took it; for one taken at a stop, that it
    was, and its trainer checkpoint or why it has none. Written without the fields at
    their defaults, so a periodic snapshot's record reads as before."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1] = 1
    anchor_step: int | None = Field(default=None, ge=0)
    fingerprint: dict[str, JsonValue]
    final: bool = False
    trainer_checkpoint: str | None = Field(default=None, max_length=4096)
    unanchored_why: str | None = Field(default=None, max_length=4096)


def write_record(checkpoint_path: str, record: ManagedRecord) -> None:
    folder = folder_at(checkpoint_path)
    folder.prepare()
    # The format always; the rest without defaults (an older reader forbids new fields).
    fields = {"format": record.format, **record.model_dump(mode="json",
                                                            exclude_defaults=True)}
    folder.write_bytes(RECORD_FILE, json.dumps(fields).encode())


def read_record(checkpoint_path: str | Path) -> ManagedRecord | None:
    """The record, None where the manager wrote none (a snapshot taken without it), or
    ``ManifestInvalidError`` of one line for one that does not read (not a regular
    file, too large, nested too deeply, not a record)."""
    folder = folder_at(checkpoint_path)
    if RECORD_FILE not in folder.names():
        return None
    where = folder.describe(RECORD_FILE)
    try:
        data = folder.read(RECORD_FILE, limit=_MAX_BYTES + 1)
    except FileNotFoundError:
        return None  # removed since the listing
    except OSError as exc:
        raise ManifestInvalidError(checkpoint_path, f"cannot read {where}: "
                                                    f"{exc.strerror or exc}") from None
    try:
        return ManagedRecord.model_validate(load_stored_json(data, where, _MAX_BYTES))
    except StoredJsonError as exc:
        raise ManifestInvalidError(checkpoint_path, str(exc)) from None
    except ValidationError as exc:
        raise ManifestInvalidError(
            checkpoint_path, f"{where} does not read: it is not a rollout record "
                             f"({exc.error_count()} error(s), the first: "
                             f"{exc.errors()[0]['msg']})") from None
