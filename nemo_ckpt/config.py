"""Options of the Ray runtime: one pydantic model, validated at construction."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
    model_validator,
)

from nemo_ckpt.errors import CheckpointPathError
from nemo_ckpt.storage.location import LocalLocation, parse_location
from nemo_ckpt.trees.limits import SandboxLimits, TreeBudget

__all__ = ["CheckpointConfig", "HOLDER_NAME_PREFIX", "LEASE_MARGIN", "DRIVER_FIELDS",
           "ADOPTED_FIELDS", "config_differences"]

HOLDER_NAME_PREFIX = "nemo_ckpt_holder:"
# Of a lease, the part kept free for a renewal to travel and be handled: the drain, one
# renewal period and this margin must fit in a lease.
LEASE_MARGIN = 0.1
_LIMITS = SandboxLimits()


def _as_location(value: object) -> Union[Path, str]:
    # In place of pydantic's own Path validation, which would turn a URL into a local
    # folder: a folder becomes a Path, a URL stays text, in Python and from JSON alike.
    if not isinstance(value, (str, Path)):
        raise ValueError(f"expected a folder or an s3:// or az:// URL, got {type(value).__name__}")
    try:
        location = parse_location(value)
    except CheckpointPathError as exc:
        raise ValueError(str(exc)) from None
    return location.path if isinstance(location, LocalLocation) else str(location)


# A folder (Path) or an object-store URL (str); serialized as text either way.
LocationField = Annotated[Union[Path, str], PlainValidator(_as_location),
                          PlainSerializer(str, return_type=str),
                          WithJsonSchema({"type": "string"})]


class CheckpointConfig(BaseModel):
    """How ``RayEnvironmentCheckpoint`` finds its actors and how long each phase may take."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = Field(
        "nemo_ckpt", min_length=1,
        description="Ray namespace of the coordinator and the holders; one per job.")
    coordinator_name: str = Field(
        "nemo_ckpt_coordinator", min_length=1,
        description="Name of the coordinator actor inside the namespace.")
    checkpoint_root: Optional[LocationField] = Field(
        None,
        description="Folder, or s3://bucket/prefix or az://container/prefix URL, under "
                    "which checkpoint paths live; check_startup verifies every holder can "
                    "write it and the driver can read it (shared).")
    drain_timeout_s: float = Field(
        5.0, gt=0, allow_inf_nan=False,
        description="How long a pause waits for turns in flight; sessions still mid-turn "
                    "after it are not captured and restart after a crash.")
    lease_s: float = Field(
        30.0, gt=0, allow_inf_nan=False,
        description="A paused holder resumes by itself when its lease is not renewed "
                    "within this many seconds (a driver or coordinator that died).")
    lease_renew_interval_s: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False,
        description="How often the driver renews the lease while the snapshot context "
                    "is open; defaults to a third of lease_s.")
    phase_timeout_s: float = Field(
        30.0, gt=0, allow_inf_nan=False,
        description="Deadline of each control call to a holder (pause, capture, resume, "
                    "restore steps) beyond the phase's own work.")
    persist_timeout_s: float = Field(
        600.0, gt=0, allow_inf_nan=False,
        description="Deadline for a holder to write its shards, counted from the end of "
                    "the caller's block.")
    turn_timeout_s: float = Field(
        1800.0, gt=0, allow_inf_nan=False,
        description="A turn in flight longer than this is aborted by its holder (its "
                    "worker is presumed dead or stuck), so a lost worker never holds a "
                    "session for ever; the time its holder is paused for a snapshot or a "
                    "restore does not count. Set it above your longest tool call.")
    max_state_bytes: int = Field(
        64 << 20, gt=0,
        description="Largest environment state or turn record a session may hold; larger "
                    "ones are refused with StateTooLargeError.")

    sandbox_root: Optional[Path] = Field(
        None,
        description="Folder, at the same path on every node, under which sessions' sandbox "
                    "directories live (SessionClient.open(..., directory=...)); restores "
                    "make continued attempts' directories here. Needs checkpoint_root: the "
                    "directories' files are kept once in <checkpoint_root>/blobs for every "
                    "snapshot under it.")
    sandbox_max_file_bytes: int = Field(
        _LIMITS.file_bytes, gt=0,
        description="Largest sandbox file a turn may leave, in bytes stored (a sparse "
                    "file counts its data, not its holes); a larger one refuses the turn's "
                    "commit with SandboxError. The default (1 GiB) fits a repository's "
                    "largest files, a small model's weights or a dataset shard.")
    sandbox_max_bytes: int = Field(
        _LIMITS.sandbox_bytes, gt=0,
        description="Most bytes one sandbox's files may hold (stored, as above); more "
                    "refuse the turn's commit with SandboxError. The default (8 GiB) fits "
                    "a large repository checkout with its build outputs and dependencies.")
    sandbox_max_files: int = Field(
        _LIMITS.files, gt=0,
        description="Most entries (files, directories and links) one sandbox may hold; "
                    "more refuse the turn's commit with SandboxError. The default "
                    "(200,000) fits a large repository with its dependencies installed.")
    sandbox_read_max_entries: Optional[int] = Field(
        None, gt=0,
        description="Most entries one stored sandbox tree may expand to when it is read "
                    "(a restore, the blob store's collection), a subtree counting at each "
                    "place that names it; more refuse the read with SandboxError (the tree "
                    "may be crafted: a few objects can name 2^30 directories). By default "
                    "sandbox_max_files, what a turn's scan may record. nemo-ckpt verify, "
                    "inspect, diff and gc use the default limits.")
    sandbox_read_max_bytes: Optional[int] = Field(
        None, gt=0,
        description="Most bytes of files one stored sandbox tree may claim when it is "
                    "read, as above; by default sandbox_max_bytes.")
    sandbox_restore_setid: bool = Field(
        False,
        description="Let a restore recreate setuid and setgid files as captured; by "
                    "default their setuid and setgid bits are dropped (the sandbox is "
                    "written by model-generated code, and the holder may run as root).")

    containers: bool = Field(
        False,
        description="Sessions may own a container on their node's podman "
                    "(SessionClient.open(container=...)): recorded at each turn's commit "
                    "(its filesystem changes against its image and, where CRIU works, its "
                    "processes' memory) and created again on restore. Needs sandbox_root "
                    "(the node cache) and checkpoint_root (the blob store); check_startup "
                    "checks podman on every node and warns where CRIU does not work.")
    container_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables the holders run podman with, beside their "
                    "own (e.g. CONTAINERS_CONF, or a PATH that finds CRIU 4.x for runc).")

    trace_file: Optional[Path] = Field(
        None,
        description="Absolute file every process of the job (the driver, the coordinator, "
                    "each holder) appends its finished OpenTelemetry spans to, one JSON "
                    "line each (nemo_ckpt.tracing); it needs opentelemetry-api and "
                    "opentelemetry-sdk in every process. A regular file only (made if "
                    "missing): a FIFO, a device or a symbolic link is refused with "
                    "TraceFileError at construction; an actor that cannot open it runs "
                    "without spans and check_startup warns. None: spans go to whatever "
                    "tracer provider each process has (none: nothing is recorded).")

    allow_unchecked_snapshots: bool = Field(
        False,
        description="Commit a snapshot whose block never called "
                    "snapshot.check_against_cut(cut). Leave it off with RL's ledger: an "
                    "unchecked snapshot may hold rollouts RL does not expect, and is "
                    "refused with UncheckedSnapshotError. Turn it on only for a backend "
                    "used without a data-plane cut (tests, a standalone environment "
                    "service).")

    holder_turn_slots: int = Field(
        10_000, gt=0,
        description="Session calls (turns waiting at a paused holder's gate included) a "
                    "holder runs at once; more wait in Ray's queue. Control calls (pause, "
                    "release, renewals, persist, abort) have slots of their own, so a "
                    "full turn queue never delays a snapshot.")

    relay_min_holders: int = Field(
        128, ge=2,
        description="From this many holders on, the coordinator reaches them through "
                    "relays, one per group of about the square root of their number, each "
                    "calling its group from its own node, instead of calling every holder "
                    "itself (benchmarks/README.md, \"Fan-out model\").")

    max_retired_marks: int = Field(
        100_000, gt=0,
        description="Retire marks a holder keeps (one per retired rollout, until RL "
                    "forgets it), and the coordinator for the holders it starts; beyond "
                    "this the oldest go, and a zombie worker of that rollout could open "
                    "it again.")

    @model_validator(mode="after")
    def _roots_are_absolute(self) -> CheckpointConfig:
        # Each node would resolve a relative folder against its own working directory.
        for name in ("checkpoint_root", "sandbox_root", "trace_file"):
            value = getattr(self, name)
            if isinstance(value, Path) and not value.is_absolute():
                raise ValueError(
                    f"{name} {str(value)!r} is relative: the holders on other nodes would "
                    f"resolve it against their own working directories; pass an absolute "
                    f"path (os.path.abspath)")
        return self

    @model_validator(mode="after")
    def _sandboxes_have_a_store(self) -> CheckpointConfig:
        if self.sandbox_root is not None and self.checkpoint_root is None:
            raise ValueError(
                "sandbox_root needs checkpoint_root: sandboxes' files are kept in a blob "
                "store under it, shared by every snapshot there; set checkpoint_root and "
                "snapshot to paths below it")
        return self

    @model_validator(mode="after")
    def _deadlines_can_work(self) -> CheckpointConfig:
        need = self.drain_timeout_s + self.renew_interval_s + LEASE_MARGIN * self.lease_s
        if need >= self.lease_s:
            raise ValueError(
                f"drain_timeout_s ({self.drain_timeout_s}) + the lease renewal period "
                f"({self.renew_interval_s:g}) + a margin of {LEASE_MARGIN:.0%} of lease_s "
                f"must be shorter than lease_s ({self.lease_s}), or a holder's lease "
                f"lapses while a long turn drains; raise lease_s")
        if self.renew_interval_s * 2 > self.lease_s:
            raise ValueError(
                f"lease_renew_interval_s ({self.renew_interval_s}) must be at most half "
                f"of lease_s ({self.lease_s}), so one late renewal does not lapse a lease")
        return self

    @property
    def sandbox_limits(self) -> SandboxLimits:
        """What a turn's scan of a sandbox may record."""
        return SandboxLimits(self.sandbox_max_file_bytes, self.sandbox_max_bytes,
                             self.sandbox_max_files)

    @property
    def tree_budget(self) -> TreeBudget:
        """What one read of a stored sandbox tree may expand to."""
        return TreeBudget(self.sandbox_read_max_entries or self.sandbox_max_files,
                          self.sandbox_read_max_bytes or self.sandbox_max_bytes)

    @property
    def renew_interval_s(self) -> float:
        """The lease renewal period in effect."""
        return self.lease_renew_interval_s or self.lease_s / 3


# A job's actors outlive its driver: a restarted driver finds them by name, made with
# the config of whoever created them. What each field is to them:
# - read by the driver alone: never compared;
DRIVER_FIELDS = frozenset({"allow_unchecked_snapshots", "lease_renew_interval_s"})
# - the coordinator's deadlines, read afresh by every operation: the newest driver's
#   are adopted (each operation hands the holders its own drain and lease);
ADOPTED_FIELDS = frozenset({"drain_timeout_s", "lease_s", "phase_timeout_s",
                            "persist_timeout_s"})
# - everything else (where checkpoints and sandboxes live, the holders' limits) was
#   built into running actors: a difference is refused (``ConfigMismatchError``).


def config_differences(theirs: CheckpointConfig, ours: CheckpointConfig,
                       fields: frozenset[str] | None = None) -> dict[str, tuple[object, object]]:
    """The fields (of ``fields``, or all) whose values differ: name -> (theirs, ours)."""
    names = CheckpointConfig.model_fields.keys() if fields is None else fields
    return {name: (getattr(theirs, name), getattr(ours, name)) for name in sorted(names)
            if getattr(theirs, name) != getattr(ours, name)}
