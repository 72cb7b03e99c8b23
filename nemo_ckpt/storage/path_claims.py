"""Claims on a checkpoint folder: which operations are in progress there.

Operations in progress hold a *claim* on the folder (``.claim-<operation>.json``: its
owner, a ttl and a beat it renews, judged on the reader's own clock:
``nemo_ckpt.storage.claims``), so that a commit's clean-up leaves another operation's files alone
(``nemo_ckpt.storage.cleanup``) and a second job's snapshot into the same folder is refused
instead of cleaned away.

Where the folder enforces conditional writes (``Folder.enforces_conditions``: a local
folder, a bucket whose server honours ``If-None-Match`` / ``If-Match``), a claim is
created only if absent and renewed only if unchanged since it was read, and it records
the manifest's version when first written: the commit (``write_manifest``) replaces only
that manifest, so of two jobs that both passed the claims' check, the second to commit
is refused. Elsewhere the claims stay advisory.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from nemo_ckpt.errors import CheckpointPathBusyError, CheckpointPathError, OperationAbortedError
from nemo_ckpt.storage.checkpoint_folder import as_folder
from nemo_ckpt.storage.claims import (
    MAX_CLAIM_BYTES,
    Claim,
    ClaimWatch,
    decode_claim,
    encode_claim,
    write_claim,
)
from nemo_ckpt.storage.folder import ABSENT, Folder, remove_if_holds
from nemo_ckpt.storage.manifest import MANIFEST_NAME
from nemo_ckpt.storage.names import safe_name_part

__all__ = ["CLAIM_PREFIX", "REMOVAL_PREFIX", "PathClaim", "advisory_claims_warning",
           "claim_beat", "claim_for_reading", "claim_of", "claim_path", "drop_abandoned",
           "live_claims", "read_claims", "release_claim"]

CLAIM_PREFIX = ".claim-"
# The operation ids of removals (``nemo_ckpt.catalog.listing``), so a refusal says what is going on.
REMOVAL_PREFIX = "remove-"
# An operation in progress in a checkpoint folder (``nemo_ckpt.storage.claims``).
PathClaim = Claim


def _claim_name(operation_id: str) -> str:
    return f"{CLAIM_PREFIX}{safe_name_part(operation_id)}.json"


def read_claims(directory: Folder | Path) -> list[PathClaim]:
    """Every claim in ``directory`` (one gone since the listing, or not a claim at all,
    is skipped). A claim that cannot be read raises ``CheckpointPathError``: skipped, it
    could let a clean-up remove the files of the operation it protects."""
    folder = as_folder(directory)
    claims: list[PathClaim] = []
    for name in folder.names():
        if not (name.startswith(CLAIM_PREFIX) and name.endswith(".json")):
            continue
        try:
            data = folder.read(name, MAX_CLAIM_BYTES + 1)
        except FileNotFoundError:
            continue
        except OSError as exc:
            where = folder.describe(name)
            raise CheckpointPathError(where, f"cannot read the claim {where}: "
                                             f"{exc.strerror or exc}") from exc
        try:
            claims.append(decode_claim(data))
        except (ValueError, KeyError, TypeError):
            continue
    return claims


def live_claims(directory: Folder | Path, owner: str, watch: ClaimWatch,
                ours: Collection[str], incarnation: str = "") -> set[str]:
    """The operations whose files must stay: ``ours`` (this incarnation's operations
    open now), and every other claim ``watch`` has not seen unchanged for its ttl:
    another owner's, or one of this owner's other incarnations (Ray may have declared a
    coordinator dead that runs again; a successor's claims are not its leftovers). Only
    a claim of this very incarnation outside ``ours`` protects nothing: its operation
    ended here."""
    folder = as_folder(directory)
    claims = read_claims(folder)
    live = {c.operation for c in watch.live(folder.describe(), claims)}
    return {c.operation for c in claims
            if c.operation in ours or (c.operation in live and (
                c.owner != owner or not incarnation or c.incarnation != incarnation))}


def claim_beat(directory: Folder | Path, operation_id: str) -> str | None:
    """The beat of ``operation_id``'s claim as it is now, None when there is none."""
    claim = claim_of(directory, operation_id)
    return None if claim is None else claim.beat


def claim_of(directory: Folder | Path, operation_id: str) -> PathClaim | None:
    """``operation_id``'s claim as it is now, None when there is none (one with an
    empty beat when it is not a claim any writer of ours made)."""
    folder = as_folder(directory)
    try:
        return decode_claim(folder.read(_claim_name(operation_id), MAX_CLAIM_BYTES + 1))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return PathClaim(operation_id, "", 0.0, "")
    except OSError as exc:
        where = folder.describe(_claim_name(operation_id))
        raise CheckpointPathError(where, f"cannot read the claim {where}: "
                                         f"{exc.strerror or exc}") from exc


def claim_path(directory: Folder | Path, operation_id: str, owner: str, watch: ClaimWatch,
               ttl_s: float, incarnation: str = "", beat: str | None = None,
               renewing: Collection[str] | None = None) -> None:
    """Claim ``directory`` for ``operation_id`` for ``ttl_s`` seconds; calling it again
    renews the claim. Refuses with ``CheckpointPathBusyError`` while another owner's
    claim is live: one ``watch`` has not seen unchanged for its ttl (so a claim seen for
    the first time refuses; keep one watch per job). This owner's own operations need
    no refusal: its holders run one at a time, and clean-up spares the ones open.
    ``renewing``, the beats the caller wrote it with: a renewal, refused with
    ``OperationAbortedError`` when the claim is gone or another's (a successor that
    took the caller for dead aborted the operation: its claim must not come back)."""
    folder = as_folder(directory)
    name = _claim_name(operation_id)
    # Read before the claims: a write in between makes the conditional write refuse.
    version = folder.version(name)
    found = read_claims(folder)
    mine = next((c for c in found if c.operation == operation_id), None)
    if renewing is not None and (mine is None or mine.beat not in renewing):
        raise _fenced(operation_id)
    claims = [c for c in found if c.operation != operation_id]
    left = watch.observe(folder.describe(), claims)
    for claim in claims:
        if claim.owner != owner and left[claim.operation] > 0 \
                and claim.operation.startswith(REMOVAL_PREFIX):
            raise CheckpointPathBusyError(
                f"{folder.describe()} is in use by {claim.operation} of {claim.owner}: the "
                f"snapshot there is being removed (nemo-ckpt rm, remove_snapshot or "
                f"keep_last); retry in a moment (a removal whose process died is taken as "
                f"abandoned once this job has seen its claim unchanged for "
                f"{left[claim.operation]:.0f}s more)")
        if claim.owner != owner and left[claim.operation] > 0:
            raise CheckpointPathBusyError(
                f"{folder.describe()} is in use by {claim.operation} of {claim.owner}: two "
                f"jobs must not write snapshots into one checkpoint path; give each job "
                f"its own path (a claim whose job died is taken as abandoned once this "
                f"job has seen it unchanged for {left[claim.operation]:.0f}s more)")
    base = (folder.version(MANIFEST_NAME) or ABSENT) if mine is None else mine.base
    data, _ = encode_claim(operation_id, owner, ttl_s, incarnation, beat, base)
    try:
        write_claim(folder, name, data, ABSENT if mine is None or version is None else version)
    except FileExistsError:
        if renewing is not None:
            raise _fenced(operation_id) from None
        raise CheckpointPathBusyError(
            f"{folder.describe()} was claimed for {operation_id} by another writer at the "
            f"same moment: two jobs must not write snapshots into one checkpoint path; "
            f"give each job its own path") from None


def _fenced(operation_id: str) -> OperationAbortedError:
    return OperationAbortedError(
        f"{operation_id} was aborted by another coordinator of this job while this one "
        f"was taken for dead (its node stalled?); its claim is not renewed")


def claim_for_reading(directory: Folder | Path, operation_id: str, owner: str, ttl_s: float,
                      incarnation: str = "") -> None:
    """Claim ``directory`` while ``operation_id`` reads the snapshot committed there (a
    restore); calling it again renews the claim. Never refused: a committed snapshot is
    final, so reading it conflicts with no writer (a job restarted after its cluster died
    must restore past the claims its old snapshot left); the claim makes a removal
    (``nemo_ckpt.catalog.listing``) refuse meanwhile."""
    data, _ = encode_claim(operation_id, owner, ttl_s, incarnation)
    as_folder(directory).write_bytes(_claim_name(operation_id), data, sync=False)


def release_claim(directory: Folder | Path, operation_id: str) -> None:
    """Drop the claim of ``operation_id``, if any."""
    as_folder(directory).remove([_claim_name(operation_id)])


def drop_abandoned(directory: Folder | Path, claims: Collection[PathClaim]) -> list[str]:
    """Remove each of ``claims`` (judged abandoned by a ``ClaimWatch``) if it is still
    the write that was judged: one renewed since (a new beat) stays, as does another
    writer's that replaced it. Returns the operations whose claims were removed."""
    folder = as_folder(directory)
    dropped: list[str] = []
    for claim in claims:
        name = _claim_name(claim.operation)
        try:
            data = folder.read(name, MAX_CLAIM_BYTES + 1)
            current = decode_claim(data)
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue
        if (current.owner, current.beat) == (claim.owner, claim.beat) and \
                remove_if_holds(folder, name, (data,)):
            dropped.append(claim.operation)
    return dropped


def advisory_claims_warning(directory: Folder | Path) -> str | None:
    """What ``check_startup`` warns of once when ``directory``'s store does not enforce
    conditional writes (None when it does)."""
    folder = as_folder(directory)
    if folder.enforces_conditions():
        return None
    return (f"the store of {folder.describe()} does not enforce conditional writes "
            f"(If-None-Match), so its path claims are advisory: two jobs given the same "
            f"checkpoint path at the same moment can both snapshot there, and the later "
            f"commit replaces the other's; give each job its own path")
