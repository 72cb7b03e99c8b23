"""Sessions' containers through real Ray actors on the session's cluster, on this
machine's podman: a holder killed while it writes a snapshot with containers (the
previous snapshot stands and restores), a holder killed mid-restore (nothing of the
attempt is left, its successor removes the containers it made, the retry restores),
and a driver killed inside its restore (the holders drop what it made)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt.catalog.verification import verify_snapshot
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.errors import BackendUnavailableError, TurnOutcomeUnknownError
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.snapshot_files import read_manifest
from tests.conftest import kill_a_driver_inside
from tests.container_runtime import Setup, ensure
from tests.containers.test_containers import (
    SERVER,
    ask,
    assert_nothing_mounted_or_networked,
    containers_named,
)

pytestmark = pytest.mark.timeout(240)
INSTANCES = ("holder-0", "holder-1")


@pytest.fixture(scope="module")
def runtime() -> Iterator[Setup]:
    setup = ensure()
    yield setup
    assert_nothing_mounted_or_networked(Podman(env=setup.env))


@pytest.fixture
def podman(runtime: Setup) -> Iterator[Podman]:
    client = Podman(env=runtime.env)
    yield client
    for name in containers_named(client, "nemo-ckpt-"):
        client.remove(name)


@pytest.fixture
async def ckpt(cluster: Any, namespace: str, tmp_path: Path, runtime: Setup
               ) -> AsyncIterator[RayEnvironmentCheckpoint]:
    config = CheckpointConfig(allow_unchecked_snapshots=True, namespace=namespace,
                              checkpoint_root=tmp_path / "ckpt",
                              sandbox_root=tmp_path / "sandboxes", containers=True,
                              container_env=runtime.env, drain_timeout_s=1.0, lease_s=6.0,
                              phase_timeout_s=30.0, persist_timeout_s=60.0)
    (tmp_path / "sandboxes").mkdir()
    checkpoint = RayEnvironmentCheckpoint(config)
    try:
        yield checkpoint
    finally:
        checkpoint.shutdown()


async def _play(ckpt: RayEnvironmentCheckpoint, podman: Podman, runtime: Setup,
                turns: int) -> dict[str, str]:
    """A session with a container per holder, ``turns`` turns each; their containers."""
    made = {}
    for inst in INSTANCES:
        name = f"nemo-ckpt-test-{uuid.uuid4().hex[:10]}"
        podman.run("run", "-d", "--name", name, runtime.image, "/bin/sh", "-c", SERVER)
        made[inst] = name
        client = await SessionClient.connect(inst, namespace=ckpt.config.namespace)
        await client.open(Ep(f"{inst}-r", 0), b"", container=name)
        await _turns(ckpt, podman, inst, 0, turns)
    return made


async def _turns(ckpt: RayEnvironmentCheckpoint, podman: Podman, inst: str, attempt: int,
                 turns: int) -> None:
    client = await SessionClient.connect(inst, namespace=ckpt.config.namespace)
    for _ in range(turns):
        async with client.turn(Ep(f"{inst}-r", attempt)) as turn:
            assert turn.container is not None
            n = ask(podman, turn.container)
            turn.complete(f"t{n}".encode(), b"s")


async def _counts(ckpt: RayEnvironmentCheckpoint, podman: Podman) -> dict[str, int]:
    """Each continued session's next answer from its restored container's memory."""
    out = {}
    for inst in INSTANCES:
        client = await SessionClient.connect(inst, namespace=ckpt.config.namespace)
        record = await client.get(Ep(f"{inst}-r", 1))
        assert record.container is not None
        out[inst] = ask(podman, record.container)
    return out


async def _restored_counts(config: CheckpointConfig, path: Path, podman: Podman
                           ) -> dict[str, int]:
    """A fresh job restores ``path`` (every instance's session continued) and says each
    restored container's next count."""
    fresh = RayEnvironmentCheckpoint(config)
    try:
        async with fresh.restored(path) as restored:
            assert {i for i, _, _ in restored.continued_attempts} == set(INSTANCES)
        return await _counts(fresh, podman)
    finally:
        fresh.shutdown()


def _crash(podman: Podman, made: dict[str, str]) -> None:
    for name in made.values():
        podman.remove(name)


async def test_a_holder_killed_while_it_writes_containers_leaves_the_previous_snapshot(
        ckpt: RayEnvironmentCheckpoint, podman: Podman, runtime: Setup,
        tmp_path: Path) -> None:
    await ckpt.ensure_holders()
    made = await _play(ckpt, podman, runtime, 2)
    path = tmp_path / "ckpt" / "latest"
    async with ckpt.snapshot(path):
        pass
    first = read_manifest(path)
    for inst in INSTANCES:  # the next snapshot has new memory and files to write
        await _turns(ckpt, podman, inst, 0, 1)
    victim = ray.get_actor(HOLDER_NAME_PREFIX + "holder-1", namespace=ckpt.config.namespace)
    await victim.inject_delay.remote("persist", 2.0)
    with pytest.raises(BackendUnavailableError):
        async with ckpt.snapshot(path):
            await asyncio.sleep(0.5)
            ray.kill(victim, no_restart=True)
    assert read_manifest(path) == first  # the previous snapshot stands, whole
    assert verify_snapshot(path).ok
    ckpt.shutdown()
    _crash(podman, made)

    assert await _restored_counts(ckpt.config, path, podman) == {"holder-0": 3, "holder-1": 3}


async def test_a_holder_killed_mid_restore_leaves_no_container_and_the_retry_restores(
        ckpt: RayEnvironmentCheckpoint, podman: Podman, runtime: Setup,
        tmp_path: Path) -> None:
    await ckpt.ensure_holders()
    made = await _play(ckpt, podman, runtime, 3)
    path = tmp_path / "ckpt" / "step-1"
    async with ckpt.snapshot(path):
        pass
    ckpt.shutdown()
    _crash(podman, made)
    restored_prefix = f"nemo-ckpt-{ckpt.config.namespace}-"

    fresh = RayEnvironmentCheckpoint(ckpt.config)
    try:
        await fresh.ensure_holders()
        victim = ray.get_actor(HOLDER_NAME_PREFIX + "holder-1",
                               namespace=ckpt.config.namespace)
        await victim.inject_delay.remote("commit_restore", 5.0)

        async def kill_when_made() -> None:  # once both holders made their containers
            while len(containers_named(podman, restored_prefix)) < 2:
                await asyncio.sleep(0.1)
            ray.kill(victim, no_restart=True)

        killer = asyncio.ensure_future(kill_when_made())
        with pytest.raises(BackendUnavailableError):
            async with fresh.restored(path):
                pass
        await killer
        # holder-0's container went with the abort; the dead holder-1's is left for
        # its successor, which removes it before it restores.
        async with fresh.restored(path) as restored:
            assert {i for i, _, _ in restored.continued_attempts} == set(INSTANCES)
        live = []
        for inst in INSTANCES:
            client = await SessionClient.connect(inst, namespace=ckpt.config.namespace)
            record = await client.get(Ep(f"{inst}-r", 1))
            live.append(record.container)
        assert containers_named(podman, restored_prefix) == sorted(live)
        assert await _counts(fresh, podman) == {"holder-0": 4, "holder-1": 4}
    finally:
        fresh.shutdown()


async def test_a_driver_killed_inside_its_restore_leaves_no_container_behind(
        ckpt: RayEnvironmentCheckpoint, podman: Podman, runtime: Setup, cluster: Any,
        tmp_path: Path) -> None:
    await ckpt.ensure_holders()
    made = await _play(ckpt, podman, runtime, 2)
    path = tmp_path / "ckpt" / "step-1"
    async with ckpt.snapshot(path):
        pass
    _crash(podman, made)
    restored_prefix = f"nemo-ckpt-{ckpt.config.namespace}-"
    # The running job's sessions are in the way of a restore: drop them first.
    ckpt.shutdown()
    fresh = RayEnvironmentCheckpoint(ckpt.config)
    try:
        await fresh.ensure_holders()
        kill_a_driver_inside(cluster.address, ckpt.config, "restored", path)
        assert len(containers_named(podman, restored_prefix)) == 2  # made, not live
        deadline = asyncio.get_running_loop().time() + ckpt.config.lease_s + 20
        while containers_named(podman, restored_prefix) and \
                asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
        assert containers_named(podman, restored_prefix) == []  # the lease lapsed: removed
        assert {h.state for h in await fresh.holders()} == {HolderState.RUNNING}
        async with fresh.restored(path) as restored:
            assert len(restored.continued_attempts) == 2
        assert await _counts(fresh, podman) == {"holder-0": 3, "holder-1": 3}
    finally:
        fresh.shutdown()


async def test_a_holder_killed_while_it_records_a_container_at_a_turns_commit(
        ckpt: RayEnvironmentCheckpoint, podman: Podman, runtime: Setup,
        tmp_path: Path) -> None:
    """Killed inside the recording (CRIU's dump, the scan, the restore in place): the
    turn fails, the session goes with its holder, and the last snapshot brings the
    container back as it was then."""
    await ckpt.ensure_holders()
    made = await _play(ckpt, podman, runtime, 2)
    path = tmp_path / "ckpt" / "step-1"
    async with ckpt.snapshot(path):
        pass
    name = made["holder-1"]
    podman.run("exec", name, "sh", "-c", "mkdir /work/many && cd /work/many && "
               "for i in $(seq 1 3000); do echo $i > f$i; done")
    client = await SessionClient.connect("holder-1", namespace=ckpt.config.namespace)
    client.resolve_s = 3.0  # its holder is dead for good: say so soon
    victim = ray.get_actor(HOLDER_NAME_PREFIX + "holder-1", namespace=ckpt.config.namespace)
    with pytest.raises((BackendUnavailableError, TurnOutcomeUnknownError)):
        async with client.turn(Ep("holder-1-r", 0)) as turn:
            assert ask(podman, name) == 3
            turn.complete(b"t3", b"s")
            asyncio.get_running_loop().call_later(0.3, ray.kill, victim)
    ckpt.shutdown()
    _crash(podman, made)

    assert await _restored_counts(ckpt.config, path, podman) == {"holder-0": 3, "holder-1": 3}


async def test_a_driver_killed_inside_a_snapshot_leaves_containers_running_on(
        ckpt: RayEnvironmentCheckpoint, podman: Podman, runtime: Setup, cluster: Any,
        tmp_path: Path) -> None:
    await ckpt.ensure_holders()
    made = await _play(ckpt, podman, runtime, 2)
    path = tmp_path / "ckpt" / "step-1"
    kill_a_driver_inside(cluster.address, ckpt.config, "snapshot", path)
    deadline = asyncio.get_running_loop().time() + ckpt.config.lease_s + 20
    while {h.state for h in await ckpt.holders()} != {HolderState.RUNNING}:
        assert asyncio.get_running_loop().time() < deadline, "holders still paused"
        await asyncio.sleep(0.5)
    assert not (path / "environment" / "manifest.json").exists()
    for inst in INSTANCES:  # the sessions and their containers run on, memory and all
        await _turns(ckpt, podman, inst, 0, 1)
        assert ask(podman, made[inst]) == 4
    async with ckpt.snapshot(path) as snap:
        assert snap is not None and snap.captured_rollouts == 2
