"""What the coordinator's parts share: the job's config, the transport, the operation
table, the holder registry, the folder claims and the blob collector.
``actors.coordinator.actor`` makes one and routes to the parts that use it
(``actors.coordinator.lifecycle``, ``actors.coordinator.snapshot``, ``actors.coordinator.restore``).
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.coordinator.blobs import BlobCollector
from actors.coordinator.folders import ClaimedFolders
from actors.coordinator.holders import HolderRegistry
from actors.coordinator.operation_table import OperationTable
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.protocol.holder_api import HolderControl, holder_calls
from nemo_ckpt.transport import Actor, Transport

__all__ = ["CoordinatorParts"]


@dataclass
class CoordinatorParts:
    """The coordinator's state and parts, shared by its phase modules."""

    config: CheckpointConfig  # replaced when a driver's deadlines are adopted
    transport: Transport
    operations: OperationTable
    holders: HolderRegistry
    folders: ClaimedFolders
    blobs: BlobCollector

    def calls(self, holder: Actor, timeout: float | None = None) -> HolderControl:
        """Typed calls to one holder, with a control call's timeout unless given."""
        return holder_calls(self.transport, holder,
                            self.config.phase_timeout_s if timeout is None else timeout)

    @property
    def claim_ttl(self) -> float:
        """How long a claim or a hold stands without a renewal."""
        return self.config.lease_s * 2

    def count_failure(self, operation: str, error: BaseException | str) -> None:
        kind = error if isinstance(error, str) else type(error).__name__
        self.transport.runtime.metrics.inc("failures", 1.0,
                                           tags={"operation": operation, "kind": kind})
