"""A restore's claim on the snapshot folder it reads (``actors.coordinator.restore``): written
at once and renewed until the restore ends, so that no removal takes the files meanwhile
(``nemo_ckpt.storage.path_claims``). Apart from ``actors.coordinator.folders``, which makes
it, so that the states that carry it (``actors.coordinator.states``) import nothing that
imports them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nemo_ckpt.errors import NemoCkptError
from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.path_claims import release_claim
from nemo_ckpt.transport import Runtime

__all__ = ["ReadClaim"]

log = logging.getLogger("nemo_ckpt.coordinator")


class ReadClaim:
    """A restore's claim on the folder it reads, written at once and renewed until
    ``release``."""

    def __init__(self, runtime: Runtime, directory: Folder, operation_id: str,
                 write: Callable[[], Awaitable[None]], period_s: Callable[[], float]) -> None:
        self._runtime = runtime
        self._directory = directory
        self._operation_id = operation_id
        self._write = write
        self._period_s = period_s
        self._first = self._writing = self._start_write()
        self._renewing = asyncio.ensure_future(self._renew())
        self._released = False

    def _start_write(self) -> asyncio.Future[None]:
        """A write, left to run to its end (its thread does) whoever stops waiting."""
        writing = asyncio.ensure_future(self._write())
        writing.add_done_callback(lambda f: f.cancelled() or f.exception())
        return writing

    async def written(self) -> None:
        """Wait for the first write; one that failed is logged, not raised."""
        try:
            await asyncio.shield(self._first)
        except (OSError, NemoCkptError) as exc:
            log.warning("%s: reads %s without a claim (%s); a removal there is not "
                        "refused meanwhile", self._operation_id, self._directory.describe(),
                        exc)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self._period_s())
            self._writing = self._start_write()
            try:
                await asyncio.shield(self._writing)
            except (OSError, NemoCkptError) as exc:
                log.warning("%s: could not renew its claim on %s: %s", self._operation_id,
                            self._directory.describe(), exc)

    async def release(self) -> None:
        """Stop renewing and remove the claim; a second call does nothing. A write under
        way runs on in its thread: removed before it lands, the claim would come back
        and outlive the restore (simulation seed 3277)."""
        if self._released:
            return
        self._released = True
        self._renewing.cancel()
        await asyncio.wait([self._writing])
        with contextlib.suppress(OSError, NemoCkptError):
            await self._runtime.run_blocking(release_claim, self._directory,
                                             self._operation_id)
