"""s3:// checkpoint paths through the Ray runtime, on the session's multi-node cluster and
its real S3-compatible server (tests/s3_server.py): every holder writes its
shard into the bucket, the coordinator commits the manifest there, and a restarted job
restores from it."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import ray

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.errors import NemoCkptError, StartupCheckError
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.snapshot_files import read_manifest, read_snapshot
from nemo_ckpt.testing import StaticCut
from tests.conftest import alive_node_ids
from tests.s3_server import BUCKET, S3Server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def root(s3_server: S3Server) -> str:
    return f"s3://{BUCKET}/ray/{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def s3_ckpt(cluster: Any, namespace: str, root: str) -> AsyncIterator[Any]:
    config = CheckpointConfig(allow_unchecked_snapshots=True,
                              namespace=namespace, checkpoint_root=root, drain_timeout_s=1.0,
                              lease_s=6.0, phase_timeout_s=10.0, persist_timeout_s=30.0)
    checkpoint = RayEnvironmentCheckpoint(config)
    try:
        yield checkpoint
    finally:
        checkpoint.shutdown()


async def play(ckpt: RayEnvironmentCheckpoint, inst: str, ep: Ep, turns: int,
               state: bytes = b"s0") -> None:
    c = await SessionClient.connect(inst, namespace=ckpt.config.namespace)
    await c.open(ep, state)
    for t in range(turns):
        async with c.turn(ep) as turn:
            turn.complete(f"{ep.rollout_id}:t{t}".encode(), state + bytes([t]),
                          [f"{ep.capture_key}/row{t}"])


async def sessions(ckpt: RayEnvironmentCheckpoint, inst: str) -> list[Any]:
    c = await SessionClient.connect(inst, namespace=ckpt.config.namespace)
    return list(await c.sessions())


async def test_check_startup_probes_the_bucket_from_every_node_and_the_driver(
        s3_ckpt: Any, s3_server: S3Server) -> None:
    await s3_ckpt.check_startup()
    assert len(await s3_ckpt.holders()) == len(alive_node_ids())
    root = s3_ckpt.config.checkpoint_root
    assert environment_folder(root).names() == []  # the probes removed themselves
    s3_server.kill()
    try:
        with pytest.raises(StartupCheckError) as error:
            await s3_ckpt.check_startup()
    finally:
        s3_server.start()
    lines = str(error.value).splitlines()[1:]
    for inst in ("holder-0", "holder-1", "holder-2"):
        line = next(line for line in lines if f"{inst} cannot write under {root}: " in line)
        assert line.endswith(f"no server answers at {s3_server.endpoint} for s3://{BUCKET}; "
                             f"check AWS_ENDPOINT_URL's host and port")


async def test_a_snapshot_into_a_bucket_restores_on_a_fresh_job_as_next_attempts(
        s3_ckpt: Any, root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    await s3_ckpt.ensure_holders()
    live = {"holder-0": [Ep("a", 0)], "holder-1": [Ep("b", 1)], "holder-2": [Ep("c", 0)]}
    for inst, eps in live.items():
        for ep in eps:
            await play(s3_ckpt, inst, ep, 2, state=os.urandom(3 << 20))
    path = f"{root}/step-1"
    async with s3_ckpt.snapshot(path) as snap:
        assert snap is not None
        rows = {f"{ep.capture_key}/row{t}" for eps in live.values() for ep in eps
                for t in range(2)}
        await snap.check_against_cut(StaticCut({i: set(e) for i, e in live.items()}, rows))
    before = {inst: await sessions(s3_ckpt, inst) for inst in live}
    loaded = read_snapshot(path)
    assert {i: loaded.sessions[i] for i in live} == before
    assert sorted(environment_folder(path).names()) == sorted(
        [*(shard_file_name(loaded.manifest.snapshot_id, i) for i in live), "manifest.json"])
    s3_ckpt.shutdown()  # the job dies

    fresh = RayEnvironmentCheckpoint(s3_ckpt.config)
    try:
        async with fresh.restored(path) as restored:
            assert restored.continued_attempts == {
                ("holder-0", "a", 0), ("holder-1", "b", 1), ("holder-2", "c", 0)}
        for inst, old in before.items():
            (new,) = await sessions(fresh, inst)
            (was,) = old
            assert new.episode == was.episode.next_attempt()
            assert (new.turns, new.state) == (was.turns, was.state)
    finally:
        fresh.shutdown()
    assert list(tmp_path.iterdir()) == []  # nothing local named after the URL


async def test_a_server_killed_mid_persist_fails_the_commit_and_the_previous_snapshot_restores(
        s3_ckpt: Any, root: str, s3_server: S3Server) -> None:
    await s3_ckpt.ensure_holders()
    await play(s3_ckpt, "holder-0", Ep("a", 0), 1, state=os.urandom(1 << 20))
    await play(s3_ckpt, "holder-1", Ep("b", 0), 1, state=os.urandom(1 << 20))
    path = f"{root}/ckpt"
    async with s3_ckpt.snapshot(path):
        pass
    first = read_manifest(path)
    await play(s3_ckpt, "holder-2", Ep("c", 0), 1, state=os.urandom(1 << 20))
    victim = ray.get_actor(HOLDER_NAME_PREFIX + "holder-1",
                           namespace=s3_ckpt.config.namespace)
    await victim.inject_delay.remote("persist", 1.0)  # its write starts after the kill
    try:
        with pytest.raises(NemoCkptError, match="could not write s3://"):
            async with s3_ckpt.snapshot(path):
                s3_server.kill()
    finally:
        s3_server.start()
    await victim.inject_delay.remote("persist", 0.0)
    assert {h.state for h in await s3_ckpt.holders()} == {HolderState.RUNNING}
    assert read_manifest(path) == first  # the previous snapshot stands
    s3_ckpt.shutdown()
    fresh = RayEnvironmentCheckpoint(s3_ckpt.config)
    try:
        async with fresh.restored(path) as restored:
            assert restored.continued_attempts == {("holder-0", "a", 0), ("holder-1", "b", 0)}
    finally:
        fresh.shutdown()
