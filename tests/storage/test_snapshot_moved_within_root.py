"""A committed snapshot restores after its folder is renamed within the checkpoint root, on
a folder and on a bucket: NeMo RL takes its snapshot into a temporary directory and renames
it once the backend has resumed (issue 36)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import obstore
import pytest

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt.cli.main import main
from nemo_ckpt.storage.location import ObjectLocation, parse_location
from nemo_ckpt.storage.object_folder import ObjectFolder
from nemo_ckpt.testing import StaticCut
from tests.s3_server import BUCKET, S3Server

pytestmark = pytest.mark.timeout(180)

LIVE = {"holder-0": Ep("a", 0), "holder-1": Ep("b", 2)}
RESTORED = {"holder-0": ((b"a:t0", b"a:t1"), b"s1"), "holder-1": ((b"b:t0", b"b:t1"), b"s1")}


def config(namespace: str, root: Path | str) -> CheckpointConfig:
    return CheckpointConfig(namespace=namespace, checkpoint_root=root, drain_timeout_s=1.0,
                            lease_s=6.0, phase_timeout_s=10.0, persist_timeout_s=30.0)


@pytest.fixture
async def jobs(cluster: Any, namespace: str) -> AsyncIterator[list[RayEnvironmentCheckpoint]]:
    """The checkpoints a test makes (the job before its crash, the restarted one),
    shut down after it."""
    made: list[RayEnvironmentCheckpoint] = []
    try:
        yield made
    finally:
        for ckpt in made:
            ckpt.shutdown()


async def snapshot_then_restore_renamed(jobs: list[RayEnvironmentCheckpoint],
                                        namespace: str, root: str,
                                        rename: Any) -> dict[str, tuple[tuple[bytes, ...], bytes]]:
    """Play two turns per rollout, snapshot into ``root/tmp-step-3``, kill the job,
    ``rename`` it to ``root/step-3``, restore from there in a new job; each instance's
    restored (turns' replies, state)."""
    first = RayEnvironmentCheckpoint(config(namespace, root))
    jobs.append(first)
    await first.ensure_holders()
    for inst, ep in LIVE.items():
        c = await SessionClient.connect(inst, namespace=namespace)
        await c.open(ep, b"s")
        for t in range(2):
            async with c.turn(ep) as turn:
                turn.complete(f"{ep.rollout_id}:t{t}".encode(), f"s{t}".encode(),
                              [f"{ep.capture_key}/row{t}"])
    async with first.snapshot(f"{root}/tmp-step-3") as snap:
        assert snap is not None
        await snap.check_against_cut(StaticCut(
            {i: {ep} for i, ep in LIVE.items()},
            {f"{ep.capture_key}/row{t}" for ep in LIVE.values() for t in range(2)}))
    await first.shutdown(wait=True)  # the job dies
    rename(f"{root}/tmp-step-3", f"{root}/step-3")

    fresh = RayEnvironmentCheckpoint(config(namespace, root))
    jobs.append(fresh)
    async with fresh.restored(f"{root}/step-3") as restored:
        assert restored.continued_attempts == {(i, ep.rollout_id, ep.attempt)
                                               for i, ep in LIVE.items()}
        assert restored.staging_keys == {f"{ep.capture_key}/row{t}"
                                         for ep in LIVE.values() for t in range(2)}
    got: dict[str, tuple[tuple[bytes, ...], bytes]] = {}
    for inst, ep in LIVE.items():
        c = await SessionClient.connect(inst, namespace=namespace)
        (s,) = await c.sessions()
        assert s.episode == ep.next_attempt()
        got[inst] = (tuple(s.turns), s.state)
    return got


def ls_and_verify_name_the_new_path(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"1 committed snapshot(s) under {root}, newest first"
    assert out.splitlines()[2].split()[-1] == f"{root}/step-3"
    assert main(["verify", f"{root}/step-3"]) == 0
    assert "tmp-step-3" not in capsys.readouterr().out


async def test_a_snapshot_restores_after_its_folder_is_renamed_within_the_root(
        jobs: list[RayEnvironmentCheckpoint], namespace: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "ckpt")
    got = await snapshot_then_restore_renamed(
        jobs, namespace, root, lambda old, new: Path(old).rename(new))
    assert got == RESTORED
    assert not (tmp_path / "ckpt" / "tmp-step-3").exists()
    ls_and_verify_name_the_new_path(root, capsys)


def move_prefix(old: str, new: str) -> None:
    """Rename a "folder" of a bucket as a user would with their tools: copy every object
    under the old prefix to the new one, then delete the old ones."""
    old_at, new_at = parse_location(old), parse_location(new)
    assert isinstance(old_at, ObjectLocation) and isinstance(new_at, ObjectLocation)
    store = ObjectFolder(old_at).store
    keys = [meta["path"] for batch in obstore.list(store, prefix=old_at.prefix + "/")
            for meta in batch]
    assert keys  # the snapshot's shards and manifest
    for key in keys:
        obstore.copy(store, key, new_at.prefix + key[len(old_at.prefix):])
    obstore.delete(store, keys)


async def test_a_snapshot_in_a_bucket_restores_after_its_prefix_is_moved_within_the_root(
        jobs: list[RayEnvironmentCheckpoint], namespace: str, s3_server: S3Server,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = f"s3://{BUCKET}/renamed/{uuid.uuid4().hex[:8]}"
    got = await snapshot_then_restore_renamed(jobs, namespace, root, move_prefix)
    assert got == RESTORED
    ls_and_verify_name_the_new_path(root, capsys)
