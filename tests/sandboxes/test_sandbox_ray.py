"""Sandbox directories through real Ray actors on the session's multi-node cluster: a
directory restored onto another node after its node died, and a holder killed while it
writes a sandbox snapshot's blobs (the previous snapshot stands and restores)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import ray

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt.catalog.verification import verify_snapshot
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.snapshot_files import read_manifest
from nemo_ckpt.testing.toy_env import directory_listing
from tests.conftest import alive_node_ids, remove_node_and_wait

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def sandbox_ckpt(cluster: Any, namespace: str, tmp_path: Path
                       ) -> AsyncIterator[RayEnvironmentCheckpoint]:
    config = CheckpointConfig(allow_unchecked_snapshots=True,
                              namespace=namespace, checkpoint_root=tmp_path / "ckpt",
                              sandbox_root=tmp_path / "sandboxes", drain_timeout_s=1.0,
                              lease_s=6.0, phase_timeout_s=10.0, persist_timeout_s=30.0)
    checkpoint = RayEnvironmentCheckpoint(config)
    try:
        yield checkpoint
    finally:
        checkpoint.shutdown()


async def _open_and_play(ckpt: RayEnvironmentCheckpoint, inst: str, ep: Ep,
                         turns: int) -> Path:
    """A session owning a small repository, ``turns`` turns that change it."""
    assert ckpt.config.sandbox_root is not None
    d = Path(ckpt.config.sandbox_root) / "work" / ep.capture_key
    (d / "src").mkdir(parents=True)
    (d / "src" / "main.py").write_text("v0\n")
    (d / "link").symlink_to("src/main.py")
    c = await SessionClient.connect(inst, namespace=ckpt.config.namespace)
    await c.open(ep, b"s0", directory=d)
    for t in range(turns):
        async with c.turn(ep) as turn:
            assert turn.directory is not None
            (turn.directory / f"out-{t}").write_bytes(bytes([t]) * 1000)
            (turn.directory / "src" / "main.py").write_text(f"v{t + 1}\n")
            turn.complete(f"t{t}".encode(), f"s{t + 1}".encode())
    return d


async def test_a_directory_comes_back_on_another_node_after_its_node_died(
        cluster: Any, sandbox_ckpt: RayEnvironmentCheckpoint, tmp_path: Path) -> None:
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    await sandbox_ckpt.ensure_holders()
    infos = {h.node_id: h.instance_id for h in await sandbox_ckpt.holders()}
    inst = infos[node.node_id]
    d = await _open_and_play(sandbox_ckpt, inst, Ep("r", 0), 3)
    expected = directory_listing(d)
    path = tmp_path / "ckpt" / "step-1"
    async with sandbox_ckpt.snapshot(path):
        pass
    sandbox_ckpt.shutdown()
    remove_node_and_wait(cluster, node)
    shutil.rmtree(tmp_path / "sandboxes")  # the node's disk went with it

    fresh = RayEnvironmentCheckpoint(sandbox_ckpt.config)
    try:
        async with fresh.restored(path) as restored:
            assert restored.continued_attempts == {(inst, "r", 0)}
        placed = {h.instance_id: h.node_id for h in await fresh.holders()}
        assert placed[inst] != node.node_id and placed[inst] in alive_node_ids()
        c = await SessionClient.connect(inst, namespace=fresh.config.namespace)
        record = await c.get(Ep("r", 1))
        assert record.directory == str(tmp_path / "sandboxes" / "r-a1")
        assert directory_listing(Path(record.directory)) == expected
        assert record.state == b"s3" and len(record.turns) == 3
    finally:
        fresh.shutdown()


async def test_a_holder_killed_while_it_writes_blobs_leaves_the_previous_snapshot_whole(
        sandbox_ckpt: RayEnvironmentCheckpoint, tmp_path: Path) -> None:
    await sandbox_ckpt.ensure_holders()
    dirs = {inst: await _open_and_play(sandbox_ckpt, inst, Ep(f"{inst}-r", 0), 2)
            for inst in ("holder-0", "holder-1")}
    path = tmp_path / "ckpt" / "latest"
    async with sandbox_ckpt.snapshot(path):
        pass
    first = read_manifest(path)
    expected = {inst: directory_listing(d) for inst, d in dirs.items()}
    for inst, d in dirs.items():  # the next snapshot has new files to write
        c = await SessionClient.connect(inst, namespace=sandbox_ckpt.config.namespace)
        async with c.turn(Ep(f"{inst}-r", 0)) as turn:
            (d / "big").write_bytes(b"z" * (4 << 20))
            turn.complete(b"t", b"s9")
    victim = ray.get_actor(HOLDER_NAME_PREFIX + "holder-1",
                           namespace=sandbox_ckpt.config.namespace)
    await victim.inject_delay.remote("persist", 2.0)
    with pytest.raises(BackendUnavailableError):
        async with sandbox_ckpt.snapshot(path):
            await asyncio.sleep(0.5)
            ray.kill(victim, no_restart=True)
    assert read_manifest(path) == first  # the previous snapshot stands
    assert verify_snapshot(path).ok  # every blob it references is there
    assert {h.state for h in await sandbox_ckpt.holders()} == {HolderState.RUNNING}
    sandbox_ckpt.shutdown()

    fresh = RayEnvironmentCheckpoint(sandbox_ckpt.config)
    try:
        async with fresh.restored(path) as restored:
            assert {i for i, _, _ in restored.continued_attempts} == {"holder-0", "holder-1"}
        for inst in dirs:
            c = await SessionClient.connect(inst, namespace=fresh.config.namespace)
            record = await c.get(Ep(f"{inst}-r", 1))
            assert record.directory is not None
            assert directory_listing(Path(record.directory)) == expected[inst]
    finally:
        fresh.shutdown()
