"""``check_startup``'s findings: a deployment that cannot recover (problems, which
refuse) and one whose recovery will be partial (warnings, logged). Each check is a
function of what the coordinator reported; only the storage check reads and removes
the probe files the holders wrote, from the driver's side."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.errors import NemoCkptError
from nemo_ckpt.phases import HolderInfo, HolderState
from nemo_ckpt.storage.checkpoint_folder import PROBE_DIR, folder_at
from nemo_ckpt.storage.location import LocalLocation, join_location, parse_location
from nemo_ckpt.storage.path_claims import advisory_claims_warning

__all__ = ["Findings", "deadline_findings", "holder_findings", "sandbox_findings",
           "storage_findings"]


@dataclass
class Findings:
    """What the checks found: problems refuse the deployment, warnings are logged."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def holder_findings(found: Findings, holders: list[HolderInfo], alive: set[str]) -> None:
    """Every alive node has a holder that answers; note holders busy or sharing a node."""
    hosted = {h.node_id for h in holders}
    for node in sorted(alive - hosted):
        found.problems.append(f"node {node} has no session holder that answers; its "
                              f"environment workers' sessions could not be saved")
    for h in holders:
        if h.sandboxes_removed_at_start:
            found.warnings.append(
                f"{h.instance_id} removed {h.sandboxes_removed_at_start} sandboxes an earlier "
                f"holder of its instance left (its sessions died with it; their rollouts "
                f"continue from the last snapshot, or start over)")
        if h.state is HolderState.STOPPED:
            found.warnings.append(f"{h.instance_id} is stopped: a stop snapshot parked its "
                                  f"sessions; restore from that snapshot to continue them")
        elif h.state is not HolderState.RUNNING:
            found.warnings.append(f"{h.instance_id} is {h.state.value} for {h.operation_id}")
        if h.trace_problem is not None:
            found.warnings.append(f"{h.instance_id} (node {h.node_id}) writes no spans: "
                                  f"{h.trace_problem}")
    per_node: dict[str, list[str]] = {}
    for h in holders:
        per_node.setdefault(h.node_id, []).append(h.instance_id)
    for node, insts in sorted(per_node.items()):
        if len(insts) > 1:
            found.warnings.append(f"node {node} hosts {len(insts)} instances ({insts}); "
                                  f"losing it loses all their rollouts at once")


def storage_findings(found: Findings, root: str, probes: dict[str, str]) -> None:
    """Every holder wrote a probe under ``root`` (``probes``: instance -> the probe's
    path, or ``"error: ..."``) that the driver reads back and removes: the root is
    shared. On a store, whether its claims are enforced or advisory."""
    for inst, result in sorted(probes.items()):
        if result.startswith("error: "):
            found.problems.append(f"{inst} cannot write under {root}: {result[7:]}")
            continue
        name = result.rsplit("/", 1)[-1]
        probes_folder = folder_at(join_location(root, PROBE_DIR))
        try:
            content = probes_folder.read(name).decode(errors="replace")
            probes_folder.remove([name])
        except (OSError, ValueError):
            found.problems.append(
                f"{inst} wrote {result} but the driver cannot read it: {root} is not "
                f"shared between the holders' nodes and the driver; use a shared "
                f"filesystem or a bucket every node and the driver reach")
            continue
        if not content.startswith(inst + " "):
            found.problems.append(f"{result} holds {content!r}, not {inst}'s probe")
    if isinstance(parse_location(root), LocalLocation):
        with contextlib.suppress(OSError):
            (Path(root) / PROBE_DIR).rmdir()
    elif not found.problems:
        try:
            advisory = advisory_claims_warning(folder_at(join_location(root, PROBE_DIR)))
        except (OSError, NemoCkptError) as exc:
            found.problems.append(f"the driver cannot write under {root}: {exc}")
        else:
            if advisory:
                found.warnings.append(advisory)


def sandbox_findings(found: Findings, probes: dict[str, str]) -> None:
    """Every holder can keep sandboxes' files under ``sandbox_root`` (``probes``:
    instance -> ``""``, or ``"error: ..."``)."""
    for _, result in sorted(probes.items()):
        if result:
            found.problems.append(result[7:])


def container_findings(found: Findings,
                       probes: dict[str, tuple[list[str], list[str]]]) -> None:
    """Every holder's node can record containers; where CRIU fails, a warning."""
    for _, (problems, warnings) in sorted(probes.items()):
        found.problems.extend(problems)
        found.warnings.extend(warnings)


def deadline_findings(found: Findings, config: CheckpointConfig) -> None:
    """Deadlines that cannot work together."""
    if config.phase_timeout_s < config.renew_interval_s:
        found.warnings.append(f"phase_timeout_s ({config.phase_timeout_s}) is shorter than "
                              f"the lease renewal period ({config.renew_interval_s})")
