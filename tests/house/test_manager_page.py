"""docs/MANAGER.md stays whole: every field of ``RolloutCheckpointConfig``,
``ManagedSnapshot``, ``RestoreHandover``, ``ContinuedRollout`` and ``RestartedRollout``
has its row, no row names a field they lack, and every event the manager emits through
``on_event`` is listed (found in its source, so a new one fails here until documented)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from nemo_ckpt import (
    ContinuedRollout,
    ManagedSnapshot,
    RestartedRollout,
    RestoreHandover,
    RolloutCheckpointConfig,
)
from nemo_ckpt.manager.handover import RESTART_REASONS

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "MANAGER.md").read_text()


def rows(heading: str, after: str = "") -> list[str]:
    """The first column of the first table below ``heading`` (and below the line
    ``after`` in that section, if given)."""
    start = PAGE.index(f"\n## {heading}\n")
    end = PAGE.find("\n## ", start + 1)
    text = PAGE[start:end if end != -1 else None]
    if after:
        text = text[text.index(after):]
    table = re.search(r"^\|[^\n]*\|\n\|[-| ]+\|\n((?:\|[^\n]*\|\n?)+)", text, flags=re.M)
    assert table, f"no table under {heading!r} {after!r}"
    return re.findall(r"^\| `(\w+)` \|", table.group(1), flags=re.M)


def emitted_events() -> set[str]:
    sources = (ROOT / "nemo_ckpt" / "manager").glob("*.py")
    return {event for path in sources
            for event in re.findall(r"_on_event\(\s*\"(\w+)\"", path.read_text())}


@pytest.mark.parametrize(("heading", "after", "fields"), [
    ("RolloutCheckpointConfig", "", list(RolloutCheckpointConfig.model_fields)),
    ("ManagedSnapshot", "", [f.name for f in dataclasses.fields(ManagedSnapshot)]),
    ("RestoreHandover", "", [f.name for f in dataclasses.fields(RestoreHandover)]),
    ("RestoreHandover", "\n`ContinuedRollout`:",
     [f.name for f in dataclasses.fields(ContinuedRollout)]),
    ("RestoreHandover", "\n`RestartedRollout` (",
     [f.name for f in dataclasses.fields(RestartedRollout)]),
])
def test_every_field_of_the_managers_types_has_its_row_and_no_row_is_stale(
        heading: str, after: str, fields: list[str]) -> None:
    assert rows(heading, after) == fields


def test_every_event_the_manager_emits_is_listed_and_no_other() -> None:
    emitted = emitted_events()
    assert {"committed", "renamed", "removing"} <= emitted  # the search finds them
    assert set(rows("Events")) == emitted


def test_every_restart_reason_is_explained_on_the_page() -> None:
    for reason in RESTART_REASONS:
        assert f"`{reason}`:" in PAGE, reason
