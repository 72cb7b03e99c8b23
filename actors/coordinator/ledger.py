"""RL's ledger operations on every holder: attempts retired or forgotten
(``nemo_ckpt.protocol.coordinator_api.CoordinatorLedgerCalls``), the one room that calls
the holders' ``HolderLedgerCalls``."""

from __future__ import annotations

from actors.coordinator.holders import HolderRegistry
from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.protocol.calls import Call, call
from nemo_ckpt.protocol.holder_api import HolderControl
from nemo_ckpt.transport import Transport

__all__ = ["Ledger"]


class Ledger:
    """Retires and forgets attempts on every known holder."""

    def __init__(self, transport: Transport, holders: HolderRegistry) -> None:
        self._transport = transport
        self._holders = holders

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Retire these attempts on every holder, and on every holder started later
        (the marks are kept: ``RetireMarks``); returns the capture keys dropped."""
        self._holders.marks.retire(episodes)  # first: a holder started from now has them
        return await self._on_every_holder(call(HolderControl.retire, episodes))

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Forget these attempts on every holder, and for every holder started later;
        returns the capture keys dropped."""
        self._holders.marks.forget(episodes)
        return await self._on_every_holder(call(HolderControl.forget, episodes))

    def _require_registered(self, what: str) -> None:
        if not self._transport.is_registered_coordinator():
            raise BackendUnavailableError(
                f"{what} reached a nemo-ckpt coordinator that Ray declared dead and that "
                f"another has replaced; retry (the live coordinator takes it)")

    async def _on_every_holder(self, made: Call[list[str]]) -> list[str]:
        # RL retires an attempt per finished rollout: use the known holders, and pay for
        # a rediscovery only when there are none or one of them has gone. Only the
        # coordinator registered under the name rediscovers: one Ray declared dead that
        # runs again would reach the holders of a job restored since, and drop what it
        # restored (simulation seed 6063).
        holders = self._holders
        if not holders.handles:
            self._require_registered(made.method)
            await holders.ensure_holders()
        try:
            dropped = await holders.fan(holders.handles, made)
        except BackendUnavailableError:
            self._require_registered(made.method)
            await holders.ensure_holders()
            dropped = await holders.fan(holders.handles, made)
        # A holder the last discovery listed but did not hear from (its answer lost on
        # the way back) may be alive with sessions: it gets the call too, as far as it
        # answers; else a retired attempt's session would stay there and take its late
        # turns (simulation seeds 915 and 800749).
        silent = {i: h for i, h in holders.registered.items() if i not in holders.handles}
        if silent:
            dropped.update(await holders.fan(silent, made, tolerate_failures=True))
        return sorted(k for keys in dropped.values() for k in keys)
