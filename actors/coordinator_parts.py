"""What the coordinator's parts share: the job's config, the transport, the operation
table, the holder registry, the folder claims, the blob collector, and the calls that
open and abort an operation. ``actors.coordinator`` makes one and routes to the phase
modules (``actors.snapshots``, ``actors.restores``) that use it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from actors.blob_collector import BlobCollector
from actors.claimed_folders import ClaimedFolders
from actors.holder_registry import HolderRegistry
from actors.operation_states import Operation
from actors.operation_table import OperationTable
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.holder_api import HolderCalls
from nemo_ckpt.operations import Outcome
from nemo_ckpt.transport import Actor, Transport

__all__ = ["CoordinatorParts"]

OpT = TypeVar("OpT", bound=Operation)


@dataclass
class CoordinatorParts:
    """The coordinator's state and parts, shared by its phase modules."""

    config: CheckpointConfig  # replaced when a driver's deadlines are adopted
    transport: Transport
    operations: OperationTable
    holders: HolderRegistry
    folders: ClaimedFolders
    blobs: BlobCollector
    # Record a first call's operation (and watch its lease); end one and undo it.
    open: Callable[[Operation], Operation]
    abort: Callable[[Operation, Outcome], Awaitable[None]]

    def calls(self, holder: Actor, timeout: float | None = None) -> HolderCalls:
        """Typed calls to one holder, with a control call's timeout unless given."""
        return HolderCalls(self.transport, holder,
                           self.config.phase_timeout_s if timeout is None else timeout)

    def opened(self, op: OpT) -> OpT:
        self.open(op)
        return op

    @property
    def claim_ttl(self) -> float:
        """How long a claim or a hold stands without a renewal."""
        return self.config.lease_s * 2

    def count_failure(self, operation: str, error: BaseException | str) -> None:
        kind = error if isinstance(error, str) else type(error).__name__
        self.transport.runtime.metrics.inc("failures", 1.0,
                                           tags={"operation": operation, "kind": kind})
