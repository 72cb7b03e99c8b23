"""The seed contract's data types and the no-state backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_ckpt.interfaces import (
    EnvironmentEpisode,
    NoEnvironmentCheckpoint,
    RestoredEnvironmentRollouts,
)


def test_capture_key_is_bare_at_attempt_zero_and_suffixed_after() -> None:
    assert EnvironmentEpisode("roll", 0).capture_key == "roll"
    assert EnvironmentEpisode("roll", 2).capture_key == "roll-a2"
    assert EnvironmentEpisode("roll", 2).next_attempt() == EnvironmentEpisode("roll", 3)


@pytest.mark.parametrize("rollout_id, attempt, message", [
    ("", 0, "rollout_id must not be empty"),
    (None, 0, "rollout_id must not be empty"),
    ("r", -1, "attempt must be non-negative"),
    ("r", True, "attempt must be non-negative"),
    ("r", 1.0, "attempt must be non-negative"),
])
def test_invalid_episodes_are_refused(rollout_id: object, attempt: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EnvironmentEpisode(rollout_id, attempt)  # type: ignore[arg-type]


def test_restored_rollouts_default_to_nothing() -> None:
    assert RestoredEnvironmentRollouts() == RestoredEnvironmentRollouts(frozenset(), frozenset())


async def test_no_environment_checkpoint_yields_none_and_refuses_restore(tmp_path: Path) -> None:
    backend = NoEnvironmentCheckpoint()
    assert backend.holds_rollout_state is False
    await backend.check_startup()
    async with backend.snapshot(tmp_path) as snap:
        assert snap is None
    assert list(tmp_path.iterdir()) == [], "a backend without state writes nothing"
    with pytest.raises(RuntimeError, match="keeps none to restore") as err:
        async with backend.restored(tmp_path):
            pass
    assert str(tmp_path) in str(err.value)
    assert backend.is_unavailable(TimeoutError()) is False
