"""The driver's side: ``RayEnvironmentCheckpoint`` (the contract over Ray actors,
``checkpoint``), the skeleton its snapshot and restore share (``operation``), a snapshot
as it runs one (``snapshot_operation``) and the snapshot it yields (``snapshot``), its
link to the coordinator (``link``), the startup checks (``startup``) and its own handles
on the holders (``holder_handles``)."""

from nemo_ckpt.driver.checkpoint import RayEnvironmentCheckpoint, ray_transport
from nemo_ckpt.driver.snapshot import RaySnapshot

__all__ = ["RayEnvironmentCheckpoint", "RaySnapshot", "ray_transport"]
