"""Sessions that own containers, through the real driver, coordinator and holders
in-process (``actors.sim``) on this machine's podman (``tests/container_runtime.py``):
recorded at each turn's commit, snapshotted into the root's blob store, created again by
a fresh job's restore with their files and their processes' memory; restart-only
sessions reported and started over."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.catalog.verification import verify_snapshot
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.containers.sandbox import ContainerSandboxes, RecordedContainer
from nemo_ckpt.errors import ContainerRuntimeError, StartupCheckError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.sandbox_backend import ContainerRef
from nemo_ckpt.session_record import EnvironmentClass
from nemo_ckpt.testing.data_plane import StaticCut
from tests.container_runtime import Setup, ensure
from tests.containers.test_containers import (
    SERVER,
    ask,
    assert_nothing_mounted_or_networked,
    containers_named,
    rewrite_dump,
)
from tests.harness import World

pytestmark = pytest.mark.timeout(180)

@pytest.fixture(scope="module")
def runtime() -> Iterator[Setup]:
    setup = ensure()
    yield setup
    podman = Podman(env=setup.env)
    left = containers_named(podman, "nemo-ckpt-")
    assert left == [], f"containers left behind: {left}"
    assert_nothing_mounted_or_networked(podman)


@pytest.fixture
def podman(runtime: Setup) -> Iterator[Podman]:
    """podman, and after the test every container it or the job made removed by name."""
    client = Podman(env=runtime.env)
    yield client
    for name in containers_named(client, "nemo-ckpt-"):
        client.remove(name)


def _job(tmp_path: Path, runtime: Setup, seed: int = 0, **options: Any) -> World:
    config = CheckpointConfig(**{
        "namespace": "job", "drain_timeout_s": 1.0, "lease_s": 30.0, "phase_timeout_s": 30.0,
        "persist_timeout_s": 60.0, "turn_timeout_s": 60.0,
        "checkpoint_root": tmp_path / "ckpt", "sandbox_root": tmp_path / "sandboxes",
        "containers": True, "container_env": runtime.env, **options})
    return World(tmp_path, nodes=2, config=config, seed=seed)


def _start(podman: Podman, runtime: Setup) -> str:
    """A worker's container running the counter server."""
    name = f"nemo-ckpt-test-{uuid.uuid4().hex[:10]}"
    podman.run("run", "-d", "--name", name, runtime.image, "/bin/sh", "-c", SERVER)
    return name


def _log(podman: Podman, container: str) -> str:
    return podman.text("exec", container, "cat", "/work/log")


async def _turns(job: World, podman: Podman, eps: dict[Ep, str], instance: str,
                 count: int) -> None:
    client = await job.client(instance)
    for ep in eps:
        if not ep.rollout_id.startswith(instance):
            continue
        for _ in range(count):
            async with client.turn(ep) as turn:
                container = turn.container
                assert container is not None
                n = ask(podman, container)
                podman.run("exec", container, "sh", "-c", f"echo turn-{n} >> /work/log")
                turn.complete(f"t{n}".encode(), f"s{n}".encode())


async def _one_per_holder(job: World, podman: Podman, runtime: Setup,
                          eps: dict[Ep, str], turns: int,
                          memory: str | None = None) -> dict[str, set[Ep]]:
    """On each holder, a session opened with a container of its own (``memory``, if
    given, in a ``ContainerRef``) and ``turns`` turns taken; the live set per holder."""
    await job.ckpt.ensure_holders()
    live: dict[str, set[Ep]] = {}
    for instance in sorted(job.holders()):
        ep = Ep(f"{instance}-r0", 0)
        eps[ep] = _start(podman, runtime)
        container = eps[ep] if memory is None else ContainerRef(eps[ep], memory=memory)
        record = await (await job.client(instance)).open(ep, b"s0", container=container)
        assert record.container == eps[ep]
        live[instance] = {ep}
        await _turns(job, podman, eps, instance, turns)
    return live


def test_a_container_session_continues_in_a_fresh_job_with_its_files_and_memory(
        tmp_path: Path, runtime: Setup, podman: Podman) -> None:
    path = tmp_path / "ckpt" / "step-1"
    job = _job(tmp_path, runtime)
    eps: dict[Ep, str] = {}
    try:
        async def first_run() -> dict[Ep, tuple[int, str]]:
            live = await _one_per_holder(job, podman, runtime, eps, 3)
            expected = {ep: (3, _log(podman, c)) for ep, c in eps.items()}
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut(live, set()))
            for instance in sorted(job.holders()):  # after the snapshot: lost in the crash
                await _turns(job, podman, eps, instance, 2)
            return expected

        expected = job.run(first_run())
    finally:
        job.close()
    for name in eps.values():  # the crash took the node: its containers, its disk
        podman.remove(name)
    shutil.rmtree(tmp_path / "sandboxes")
    assert verify_snapshot(path).ok

    fresh = _job(tmp_path, runtime, seed=1)
    try:
        async def restore() -> None:
            async with fresh.ckpt.restored(path) as restored:
                assert len(restored.continued_attempts) == 2
            for instance, rollout_id, attempt in restored.continued_attempts:
                client = await fresh.client(instance)
                ep = Ep(rollout_id, attempt + 1)
                record = await client.get(ep)
                assert record.container == f"nemo-ckpt-job-{ep.capture_key}"
                turns, log = expected[Ep(rollout_id, 0)]
                assert record.turns == tuple(f"t{n}".encode() for n in range(1, turns + 1))
                assert _log(podman, record.container) == log
                # Its server's counter continues from its memory at the snapshot.
                async with client.turn(ep) as turn:
                    assert turn.container == record.container
                    assert ask(podman, record.container) == turns + 1
                    turn.complete(b"t", b"s")

        fresh.run(restore())
    finally:
        fresh.close()


def test_a_restart_only_session_is_reported_restarting_and_not_restored(
        tmp_path: Path, runtime: Setup, podman: Podman) -> None:
    path = tmp_path / "ckpt" / "step-1"
    job = _job(tmp_path, runtime)
    try:
        async def run() -> None:
            await job.ckpt.ensure_holders()
            client = await job.client("holder-0")
            kept, remote = Ep("holder-0-kept", 0), Ep("holder-0-remote", 0)
            kept_record = await client.open(kept, b"s0")
            remote_record = await client.open(remote, b"s0", restart_only=True)
            assert kept_record.environment_class is EnvironmentClass.STATELESS
            assert remote_record.environment_class is EnvironmentClass.RESTART_ONLY
            for ep in (kept, remote):
                async with client.turn(ep) as turn:
                    turn.complete(b"t1", b"s1")
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None
                # RL expects both; the restart-only one is not an error, as a rollout
                # the backend could not capture.
                await snap.check_against_cut(StaticCut({"holder-0": {kept, remote}}, set()))
                assert snap.restarted_rollouts == 1
                assert snap.restarting()["holder-0"] == {remote}
                figures = snap.metrics(0.0)
                assert figures["restart_only_rollouts"] == 1
                assert figures["captured_rollouts"] == 1

        job.run(run())
    finally:
        job.close()
    fresh = _job(tmp_path, runtime, seed=1)
    try:
        async def restore() -> None:
            async with fresh.ckpt.restored(path) as restored:
                assert [(i, r) for i, r, _ in restored.continued_attempts] == [
                    ("holder-0", "holder-0-kept")]

        fresh.run(restore())
    finally:
        fresh.close()


def test_without_criu_a_container_needing_its_memory_is_restart_only_and_others_keep_files(
        tmp_path: Path, runtime: Setup, podman: Podman,
        caplog: pytest.LogCaptureFixture) -> None:
    no_criu = {**runtime.env, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}  # criu not on it
    assert Podman(env=no_criu).criu_problem() == "criu is not installed on this node"
    path = tmp_path / "ckpt" / "step-1"
    job = _job(tmp_path, runtime, container_env=no_criu)
    try:
        async def run() -> None:
            with caplog.at_level(logging.WARNING):
                await job.ckpt.check_startup()
            assert "process memory is not captured on this node" in caplog.text
            client = await job.client("holder-0")
            needs, files = Ep("holder-0-repl", 0), Ep("holder-0-files", 0)
            repl = _start(podman, runtime)
            with caplog.at_level(logging.WARNING):
                record = await client.open(needs, b"s0", container=ContainerRef(
                    repl, memory="required"))
            assert "is restart-only: its container" in caplog.text
            assert record.container == repl  # its worker still finds its container
            assert record.environment_class is EnvironmentClass.RESTART_ONLY
            files_container = _start(podman, runtime)
            opened = await client.open(files, b"s0", container=files_container)
            assert opened.environment_class is EnvironmentClass.CAPTURABLE
            async with client.turn(files) as turn:
                assert ask(podman, files_container) == 1
                podman.run("exec", files_container, "sh", "-c", "echo kept > /work/f")
                turn.complete(b"t1", b"s1")
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None
                await snap.check_against_cut(
                    StaticCut({"holder-0": {needs, files}}, set()))
                assert snap.restarting()["holder-0"] == {needs}

        job.run(run())
    finally:
        job.close()
    fresh = _job(tmp_path, runtime, seed=1, container_env=no_criu)
    try:
        async def restore() -> None:
            async with fresh.ckpt.restored(path) as restored:
                assert [r for _, r, _ in restored.continued_attempts] == ["holder-0-files"]
            client = await fresh.client("holder-0")
            record = await client.get(Ep("holder-0-files", 1))
            assert record.container is not None
            assert podman.text("exec", record.container, "cat", "/work/f") == "kept"
            assert ask(podman, record.container) == 1  # its command started afresh

        fresh.run(restore())
    finally:
        fresh.close()


def test_containers_off_or_no_podman_are_refused_saying_what_to_do(
        tmp_path: Path, runtime: Setup, podman: Podman) -> None:
    job = _job(tmp_path, runtime, containers=False)
    try:
        async def run() -> None:
            await job.ckpt.ensure_holders()
            client = await job.client("holder-0")
            with pytest.raises(ContainerRuntimeError,
                               match="CheckpointConfig.containers is off; turn it on"):
                await client.open(Ep("r", 0), b"", container="nemo-ckpt-test-absent")

        job.run(run())
    finally:
        job.close()
    (tmp_path / "empty").mkdir()
    nowhere = _job(tmp_path, runtime, container_env={"PATH": str(tmp_path / "empty")})
    try:
        async def check() -> None:
            with pytest.raises(StartupCheckError, match="`podman` is not installed"):
                await nowhere.ckpt.check_startup()

        nowhere.run(check())
    finally:
        nowhere.close()


def test_opening_a_session_with_a_container_that_does_not_exist_opens_nothing(
        tmp_path: Path, runtime: Setup, podman: Podman) -> None:
    job = _job(tmp_path, runtime)
    try:
        async def run() -> None:
            await job.ckpt.ensure_holders()
            client = await job.client("holder-0")
            with pytest.raises(ContainerRuntimeError, match="no such container"):
                await client.open(Ep("r", 0), b"", container="nemo-ckpt-test-absent")
            assert await client.sessions() == []

        job.run(run())
    finally:
        job.close()


def test_a_container_that_needs_its_memory_is_not_restored_where_criu_does_not_work(
        tmp_path: Path, runtime: Setup, podman: Podman) -> None:
    path = tmp_path / "ckpt" / "step-1"
    job = _job(tmp_path, runtime)
    try:
        async def run() -> None:
            await job.ckpt.ensure_holders()
            client = await job.client("holder-0")
            ep = Ep("holder-0-repl", 0)
            await client.open(ep, b"s0", container=ContainerRef(
                _start(podman, runtime), memory="required"))
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut({"holder-0": {ep}}, set()))

        job.run(run())
    finally:
        job.close()
    no_criu = {**runtime.env, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    fresh = _job(tmp_path, runtime, seed=1, container_env=no_criu)
    try:
        async def restore() -> None:
            with pytest.raises(ContainerRuntimeError,
                               match="needs its processes' memory .*restore where CRIU works"):
                async with fresh.ckpt.restored(path):
                    pass
            client = await fresh.client("holder-0")
            assert await client.sessions() == []  # nothing went live

        fresh.run(restore())
    finally:
        fresh.close()
    assert containers_named(podman, "nemo-ckpt-job-") == []  # none of the refused restore


def test_a_stop_snapshot_removes_the_containers_and_a_restore_makes_them_again(
        tmp_path: Path, runtime: Setup, podman: Podman) -> None:
    path = tmp_path / "ckpt" / "final"
    job = _job(tmp_path, runtime)
    eps: dict[Ep, str] = {}
    try:
        async def run() -> None:
            live = await _one_per_holder(job, podman, runtime, eps, 2, memory="off")
            async with job.ckpt.final_snapshot(path) as snap:
                assert snap is not None and snap.captured_rollouts == 2
                await snap.check_against_cut(StaticCut(live, set()))
            assert containers_named(podman, "nemo-ckpt-") == [], "the stop removed them"
            for holder in job.holders().values():
                assert await holder.sessions() == []
                assert len(holder._parts.sandboxes) == 0
            async with job.ckpt.restored(path) as restored:
                assert len(restored.continued_attempts) == 2
            for instance, rollout_id, attempt in restored.continued_attempts:
                record = await (await job.client(instance)).get(Ep(rollout_id, attempt + 1))
                assert record.container is not None
                assert _log(podman, record.container) == "turn-1\nturn-2"

        job.run(run())
    finally:
        job.close()


def test_a_turn_whose_container_is_not_restored_after_its_recording_fails_and_names_its_rows(
        tmp_path: Path, runtime: Setup, podman: Podman, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 50 row 16: a turn whose commit cannot restore the container after its
    checkpoint fails saying the container stays stopped and what to do; the session
    keeps its last committed turn; the snapshot names the turn's rows as written by a
    turn that never committed, not as RL's data plane's leftovers."""
    armed: list[bool] = []

    class LosingDump(Podman):  # the dump is lost before the restore in place (real podman)
        def checkpoint(self, container: str, export: str, keep: bool) -> None:
            super().checkpoint(container, export, keep)
            if armed:
                folder = Path(self.inspect(container)["StaticDir"])
                (folder / "checkpoint" / "inventory.img").unlink()

    monkeypatch.setattr("nemo_ckpt.containers.backend.Podman", LosingDump)
    job = _job(tmp_path, runtime)
    try:
        async def run() -> None:
            await job.ckpt.ensure_holders()
            instances = sorted(job.holders())
            client = await job.client(instances[0])
            ep = Ep(f"{instances[0]}-r0", 0)
            name = _start(podman, runtime)
            await client.open(ep, b"s0", container=name)
            async with client.turn(ep) as turn:
                assert ask(podman, name) == 1
                turn.complete(b"t1", b"s1", ["row-1"])
            armed.append(True)
            with pytest.raises(ContainerRuntimeError, match="the turn is not committed and "
                               "the container stays stopped: close the session"):
                async with client.turn(ep) as turn:
                    assert ask(podman, name) == 2
                    turn.complete(b"t2", b"s2", ["row-2"])
            assert (await client.get(ep)).turns == (b"t1",)
            cut = StaticCut({i: ({ep} if i == instances[0] else set()) for i in instances},
                            {"row-1", "row-2"})
            with caplog.at_level(logging.WARNING):
                async with job.ckpt.snapshot(tmp_path / "ckpt" / "step-1") as snap:
                    assert snap is not None
                    await snap.check_against_cut(cut)
            assert "1 staging row(s) written by turns whose commit failed recording the " \
                   "session's sandbox" in caplog.text
            assert "row-2" in caplog.text and "RL's data plane" not in caplog.text

        job.run(run())
    finally:
        job.close()


def test_a_committed_snapshot_its_writer_crafted_never_reaches_the_host(
        tmp_path: Path, runtime: Setup, podman: Podman,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50 rows 1-4 through a committed snapshot: whoever writes the checkpoint root
    wrote it with podman's archive changed (OCI hooks, host pid files, a published port)
    and a deletion through a link to a host file; every hash in it is right. A fresh
    job's restore continues the container from its memory, and the host is untouched."""
    host = tmp_path / "host"
    host.mkdir()
    marker, victim = host / "hook-ran", host / "victim"
    pid_files = {field: host / field for field in ("conmonPidFile", "pid_file")}
    for path in [victim, *pid_files.values()]:
        path.write_text("the host's")
    hook = {"path": "/bin/sh", "args": ["sh", "-c", f"echo ran >> {marker}"]}

    class Crafting(Podman):  # the writer's podman: its exported archive changed
        def checkpoint(self, container: str, export: str, keep: bool) -> None:
            super().checkpoint(container, export, keep)
            data = Path(export).read_bytes()
            data = rewrite_dump(data, "spec.dump", lambda s: s.__setitem__("hooks", {
                kind: [hook] for kind in ("prestart", "createRuntime", "poststop")}))
            data = rewrite_dump(data, "config.dump", lambda c: c.update(
                {**{f: str(p) for f, p in pid_files.items()}, "newPortMappings": [
                    {"host_ip": "", "container_port": 80, "host_port": 18932,
                     "range": 1, "protocol": "tcp"}]}))
            Path(export).write_bytes(data)

    class CraftingRecords(ContainerSandboxes):  # ... and its record a deletion added
        def record(self, *args: Any, **kwargs: Any) -> RecordedContainer:
            got = super().record(*args, **kwargs)
            return dataclasses.replace(got, record=dataclasses.replace(
                got.record, whiteouts=got.record.whiteouts + ("work_esc/victim",)))

    monkeypatch.setattr("nemo_ckpt.containers.backend.Podman", Crafting)
    monkeypatch.setattr("nemo_ckpt.containers.backend.ContainerSandboxes", CraftingRecords)
    path = tmp_path / "ckpt" / "step-1"
    job = _job(tmp_path, runtime)
    eps: dict[Ep, str] = {}
    try:
        async def write() -> None:
            await job.ckpt.ensure_holders()
            instances = sorted(job.holders())
            client = await job.client(instances[0])
            ep = Ep(f"{instances[0]}-r0", 0)
            eps[ep] = name = _start(podman, runtime)
            podman.run("exec", name, "ln", "-s", str(host), "/work_esc")
            await client.open(ep, b"s0", container=name)
            await _turns(job, podman, eps, instances[0], 2)
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut(
                    {i: ({ep} if i == instances[0] else set()) for i in instances}, set()))

        job.run(write())
    finally:
        job.close()
    monkeypatch.undo()
    for name in eps.values():
        podman.remove(name)
    assert verify_snapshot(path).ok

    fresh = _job(tmp_path, runtime, seed=1)
    try:
        async def restore() -> None:
            async with fresh.ckpt.restored(path) as restored:
                assert len(restored.continued_attempts) == 1
            [(instance, rollout_id, attempt)] = restored.continued_attempts
            client = await fresh.client(instance)
            record = await client.get(Ep(rollout_id, attempt + 1))
            assert record.container is not None
            assert ask(podman, record.container) == 3  # from its memory
            assert podman.text("port", record.container) == ""
            podman.remove(record.container)

        fresh.run(restore())
    finally:
        fresh.close()
    assert not marker.exists()
    assert {p.name: p.read_text() for p in [victim, *pid_files.values()]} == {
        p.name: "the host's" for p in [victim, *pid_files.values()]}
