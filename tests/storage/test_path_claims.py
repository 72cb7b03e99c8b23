"""Claims on a checkpoint folder (``nemo_ckpt.storage.path_claims``): a second job is refused a
live job's path, and takes over a dead job's only once it watched the claim unchanged for
its ttl on its own clock (issues 11, 23 and 29)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nemo_ckpt.errors import CheckpointPathBusyError
from nemo_ckpt.storage.checkpoint_folder import prepare_environment_dir
from nemo_ckpt.storage.claims import LEGACY_TTL_S, STALE_FACTOR, ClaimWatch
from nemo_ckpt.storage.path_claims import claim_path, live_claims, read_claims
from tests.storage.test_disk_format import FakeClock


def test_another_jobs_live_claim_refuses_a_snapshot_into_the_same_path(tmp_path: Path) -> None:
    # Case 11: two jobs snapshotting into one path are refused, not cleaned.
    directory = prepare_environment_dir(tmp_path)
    job_a, job_b = ClaimWatch(FakeClock(1_000.0)), ClaimWatch(FakeClock(5.0))
    claim_path(directory, "snap-a", "job-a@c1", job_a, ttl_s=60.0)
    claim_path(directory, "snap-a", "job-a@c1", job_a, ttl_s=60.0)  # a renewal
    with pytest.raises(CheckpointPathBusyError, match="in use by snap-a of job-a@c1") as info:
        claim_path(directory, "snap-b", "job-b@c2", job_b, ttl_s=60.0)
    assert not info.value.retriable
    claim_path(directory, "snap-a2", "job-a@c1", job_a, ttl_s=60.0, incarnation="i1")
    assert live_claims(directory, "job-b@c2", job_b, ours=()) == {"snap-a", "snap-a2"}
    # A claim this very incarnation wrote, of an operation it does not run now, ended
    # here: it protects nothing.
    assert live_claims(directory, "job-a@c1", job_a, ours=set(), incarnation="i1") \
        == {"snap-a"}


def test_a_claim_of_another_incarnation_of_the_same_job_protects_until_watched_stale(
        tmp_path: Path) -> None:
    """Issue 29, case 1: a coordinator Ray declared dead may run again beside its
    successor; neither's clean-up takes the other's claims for its own leftovers."""
    directory = prepare_environment_dir(tmp_path)
    clock = FakeClock(0.0)
    watch = ClaimWatch(clock)
    claim_path(directory, "snap-new", "job@c", ClaimWatch(), ttl_s=60.0, incarnation="new")
    assert live_claims(directory, "job@c", watch, ours=(), incarnation="old") == {"snap-new"}
    clock.advance(60.0 * STALE_FACTOR + 1)  # its successor died too, and stopped renewing
    assert live_claims(directory, "job@c", watch, ours=(), incarnation="old") == set()


def test_a_claim_is_taken_over_only_once_watched_unchanged_for_its_ttl_whatever_the_wall_clocks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 23, case 1: another host's clock has any offset; only the reader's own
    # monotonic clock, watching the claim's beat, decides.
    directory = prepare_environment_dir(tmp_path)
    job_a, clock_b = ClaimWatch(FakeClock(0.0)), FakeClock(0.0)
    job_b = ClaimWatch(clock_b)
    claim_path(directory, "snap-a", "job-a@c1", job_a, ttl_s=60.0)
    real_time = time.time
    for skew in (86_400.0, -86_400.0):  # the readers' wall clock a day ahead, a day behind
        monkeypatch.setattr(time, "time", lambda skew=skew: real_time() + skew)
        with pytest.raises(CheckpointPathBusyError, match="in use by snap-a of job-a@c1"):
            claim_path(directory, "snap-b", "job-b@c2", job_b, ttl_s=60.0)
    clock_b.advance(60.0)
    claim_path(directory, "snap-a", "job-a@c1", job_a, ttl_s=60.0)  # job-a renews: alive
    clock_b.advance(60.0)
    with pytest.raises(CheckpointPathBusyError, match="unchanged for 72s more"):
        claim_path(directory, "snap-b", "job-b@c2", job_b, ttl_s=60.0)  # seen anew
    assert live_claims(directory, "job-b@c2", job_b, ours=()) == {"snap-a"}
    clock_b.advance(60.0 * STALE_FACTOR - 1)  # job-a died: its beat stays
    with pytest.raises(CheckpointPathBusyError, match="unchanged for 1s more"):
        claim_path(directory, "snap-b", "job-b@c2", job_b, ttl_s=60.0)
    clock_b.advance(2.0)
    assert live_claims(directory, "job-b@c2", job_b, ours=()) == set()
    claim_path(directory, "snap-b", "job-b@c2", job_b, ttl_s=60.0)
    assert {c.operation for c in read_claims(directory)} == {"snap-a", "snap-b"}


def test_a_claim_an_older_nemo_ckpt_wrote_is_judged_by_watching_not_by_its_expiry(
        tmp_path: Path) -> None:
    directory = prepare_environment_dir(tmp_path)
    old = {"operation": "snap-old", "owner": "old-job@c0", "expires_at": 1.0}  # long past
    (directory / ".claim-snap-old.json").write_text(json.dumps(old))
    clock = FakeClock(0.0)
    watch = ClaimWatch(clock)
    with pytest.raises(CheckpointPathBusyError, match="in use by snap-old of old-job@c0"):
        claim_path(directory, "snap-b", "job-b@c2", watch, ttl_s=60.0)
    clock.advance(LEGACY_TTL_S * STALE_FACTOR - 1)
    old["expires_at"] = 2.0  # its job renewed it
    (directory / ".claim-snap-old.json").write_text(json.dumps(old))
    assert live_claims(directory, "job-b@c2", watch, ours=()) == {"snap-old"}
    clock.advance(LEGACY_TTL_S * STALE_FACTOR + 1)
    claim_path(directory, "snap-b", "job-b@c2", watch, ttl_s=60.0)
