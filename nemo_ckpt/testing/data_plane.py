"""A reference data plane for tests, examples and users' own integration tests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from nemo_ckpt.errors import StaleCutError
from nemo_ckpt.interfaces import EnvironmentEpisode

__all__ = ["StaticCut"]


class StaticCut:
    """A data-plane cut over a fixed ledger and set of staging rows.

    It is live until ``expire()``, as a real cut is live until its barrier section
    exits; afterwards every read raises ``StaleCutError``.
    """

    def __init__(
        self,
        expected: Mapping[str, Iterable[EnvironmentEpisode]],
        staging_keys: Iterable[str] = (),
        name: str = "cut",
    ) -> None:
        self._expected = MappingProxyType({i: frozenset(e) for i, e in expected.items()})
        self._staging_keys = frozenset(staging_keys)
        self._name = name
        self._live = True

    def expire(self) -> None:
        """End the cut, as the barrier section's exit does."""
        self._live = False

    def require_live(self) -> None:
        """Raise ``StaleCutError`` once the cut has expired."""
        if not self._live:
            raise StaleCutError(
                f"data-plane {self._name} is stale: its barrier section has exited, so "
                f"the data plane may have changed since; take the check inside "
                f"`async with barrier.checkpoint() as cut:`"
            )

    def expected_episodes(self) -> Mapping[str, frozenset[EnvironmentEpisode]]:
        """RL's ledger at the cut, per instance."""
        self.require_live()
        return self._expected

    def staging_keys(self) -> frozenset[str]:
        """The staging rows at the cut."""
        self.require_live()
        return self._staging_keys
