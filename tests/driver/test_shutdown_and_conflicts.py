"""``shutdown()`` awaited or not, ``shutdown(wait=True)``, and the refusal of a restore
into a job whose old sessions still live, through the real driver, coordinator and
holders in-process (``actors.sim``, with Ray's delay in releasing a killed actor's name)."""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
from nemo_ckpt.errors import BackendUnavailableError, RestoreConflictError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.testing.data_plane import StaticCut
from nemo_ckpt.transport import Runtime
from tests.harness import World
from tests.sandboxes.test_sandbox_sessions import sandbox_job

pytestmark = pytest.mark.timeout(180)
NAME_RELEASE_S = 2.0  # how long Ray keeps a killed actor's name here


@pytest.fixture
def job(tmp_path: Path) -> Any:
    j = sandbox_job(tmp_path)
    j.sim.death_delay = lambda actor: (0.5, NAME_RELEASE_S - 0.5)
    try:
        yield j
    finally:
        j.close()


async def _sessions_and_a_snapshot(job: World, path: Path) -> None:
    """A session on every holder, and a snapshot of them at ``path``."""
    await job.ckpt.ensure_holders()
    live: dict[str, set[Ep]] = {}
    for instance in sorted(job.holders()):
        episode = Ep(f"{instance}-r0", 0)
        await (await job.client(instance)).open(episode, b"s0")
        live[instance] = {episode}
    async with job.ckpt.snapshot(path) as snap:
        assert snap is not None
        await snap.check_against_cut(StaticCut(live, set()))


def _new_driver(job: World) -> RayEnvironmentCheckpoint:
    """The driver of a restarted job: the same namespace, the old job's actors alive."""
    driver = job.sim.new_actor("driver-2", "driver", "node-0")
    return RayEnvironmentCheckpoint(job.config, job.sim.transport(driver, job.config))


def test_a_restore_into_live_old_sessions_names_every_holder_and_the_fix(
        job: World, tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "step-1"

    async def scenario() -> str:
        await _sessions_and_a_snapshot(job, path)
        fresh = _new_driver(job)
        with pytest.raises(RestoreConflictError) as refused:
            async with fresh.restored(path):
                pass
        return str(refused.value)

    message = job.run(scenario())
    holders = sorted(job.holders())
    assert len(holders) == 2
    assert f"live now on 2 holder(s), {', '.join(holders)}" in message
    for instance in holders:
        assert f"{instance}: cannot restore rollouts ['{instance}-r0']" in message
    assert "await RayEnvironmentCheckpoint(config).shutdown(wait=True)" in message


def test_shutdown_with_wait_returns_once_the_names_are_released_and_the_restore_then_succeeds(
        job: World, tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "step-1"

    async def scenario() -> tuple[list[str], float, list[str], int]:
        await _sessions_and_a_snapshot(job, path)
        fresh = _new_driver(job)
        transport = fresh._transport
        started = job.sim.loop.time()
        fresh.shutdown()
        right_after = transport.actor_names()  # killed, the names not yet released
        await fresh.shutdown(wait=True)
        waited = job.sim.loop.time() - started
        gone = transport.actor_names()
        async with fresh.restored(path) as restored:
            return right_after, waited, gone, len(restored.continued_attempts)

    right_after, waited, gone, continued = job.run(scenario())
    assert len(right_after) == 3  # the coordinator and two holders
    assert waited >= NAME_RELEASE_S - 1e-9 and gone == []  # virtual times' float sums
    assert continued == 2


def test_shutdown_with_wait_gives_up_naming_the_actors_still_registered(job: World) -> None:
    job.sim.death_delay = lambda actor: (0.5, 60.0)  # a node Ray cannot reach

    async def scenario() -> str:
        await job.ckpt.ensure_holders()
        with pytest.raises(BackendUnavailableError) as timed_out:
            await job.ckpt.shutdown(wait=True, timeout_s=5.0)
        return str(timed_out.value)

    message = job.run(scenario())
    assert "still registered 5s after the kill" in message
    assert "holder-" in message and "call shutdown(wait=True) again" in message


def test_await_shutdown_without_wait_sends_the_kill_and_returns_at_once(job: World) -> None:
    async def scenario() -> tuple[list[str], float, list[str]]:
        await job.ckpt.ensure_holders()
        transport = job.ckpt._transport
        before = transport.actor_names()
        started = job.sim.loop.time()
        await job.ckpt.shutdown()
        took = job.sim.loop.time() - started
        await asyncio.sleep(NAME_RELEASE_S)
        return before, took, transport.actor_names()

    before, took, after = job.run(scenario())
    assert len(before) == 3 and took == 0.0  # nothing waited for
    assert after == []  # the kill went with the call


def test_a_shutdown_left_unawaited_kills_the_namespace_and_warns_nothing(job: World) -> None:
    async def scenario() -> list[str]:
        await job.ckpt.ensure_holders()
        job.ckpt.shutdown(wait=True)  # not awaited: a script's last line
        gc.collect()  # where an unawaited coroutine would warn
        await asyncio.sleep(NAME_RELEASE_S)
        return job.ckpt._transport.actor_names()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert job.run(scenario()) == []
        gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []


class _GoneAfterTheKill:
    """A driver's transport whose cluster lost its control plane right after the kill:
    each look at the names blocks for its bound, as Ray's calls to a dead GCS do."""

    def __init__(self) -> None:
        self.runtime = Runtime()
        self.namespace = "gone-after-the-kill"
        self.kills: list[float | None] = []

    def kill_namespace(self, timeout_s: float | None = None) -> None:
        self.kills.append(timeout_s)

    def actor_names(self, timeout_s: float | None = None) -> list[str]:
        time.sleep(timeout_s or 0.0)
        raise BackendUnavailableError(f"Ray did not list the named actors within "
                                      f"{timeout_s:g}s")


def test_shutdown_waits_for_the_names_of_a_cluster_gone_after_the_kill_off_the_loop(
        ) -> None:
    """Issue 50, row 12: the control plane may go between the kill and the look at the
    names; ``shutdown(wait=True)`` looks off the event loop, whose other tasks run."""
    transport = _GoneAfterTheKill()
    ckpt = RayEnvironmentCheckpoint(CheckpointConfig(namespace=transport.namespace),
                                    transport)  # type: ignore[arg-type]

    async def scenario() -> tuple[str, int]:
        ticks: list[float] = []

        async def ticking() -> None:
            while True:
                await asyncio.sleep(0.01)
                ticks.append(time.monotonic())

        ticker = asyncio.ensure_future(ticking())
        try:
            with pytest.raises(BackendUnavailableError) as gave_up:
                await ckpt.shutdown(wait=True, timeout_s=0.5)
        finally:
            ticker.cancel()
        return str(gave_up.value), len(ticks)

    message, ticked = asyncio.run(scenario())
    assert transport.kills == [0.5]
    assert message.startswith("Ray did not list the named actors within "), message
    assert 0 < float(message.split("within ")[1].rstrip("s")) <= 0.5  # what was left
    assert ticked >= 2


_RAYLET_GONE = """
import asyncio, logging, os, signal, time
import ray
from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
from nemo_ckpt.errors import BackendUnavailableError

logging.basicConfig(level=logging.WARNING)
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
ckpt = RayEnvironmentCheckpoint(CheckpointConfig(namespace="raylet-gone"))
killed = []

async def ticking(ticks):
    while True:
        await asyncio.sleep(0.05)
        ticks.append(time.monotonic())

async def main():
    await ckpt.ensure_holders()  # its holders' handles are looked up in the background
    node = ray._private.worker._global_node
    # As a signal to the whole process group (timeout's, Slurm's) ends them; before the
    # lookup above ran, which then waits on the dead GCS.
    for kind in ("raylet", "gcs_server"):
        for info in node.all_processes.get(kind, []):
            os.kill(info.process.pid, signal.SIGKILL)
            info.process.wait()
    killed.append(time.monotonic())
    started = time.monotonic()
    ckpt.shutdown(timeout_s=2.0)  # a script's last line: it gives up, with one warning
    print(f"unawaited returned after {time.monotonic() - started:.1f}s", flush=True)
    ticks = []
    ticker = asyncio.ensure_future(ticking(ticks))
    started = time.monotonic()
    try:
        await ckpt.shutdown(wait=True, timeout_s=4.0)
    except BackendUnavailableError as exc:
        print(f"raised after {time.monotonic() - started:.1f}s: {exc}", flush=True)
    else:
        print("returned", flush=True)
    ticker.cancel()
    print(f"the loop ticked {len(ticks)} times while it waited", flush=True)

asyncio.run(main())
# Then the interpreter's exit, with Ray's own ray.shutdown() (some 15 s with the GCS gone).
print(f"asyncio.run returned {time.monotonic() - killed[0]:.1f}s after the kill", flush=True)
"""


@pytest.fixture(scope="module")
def raylet_gone(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A job of its own, on its own Ray, whose raylet and GCS are killed; then its
    driver's shutdown, left unawaited and awaited with ``wait=True``, and its exit."""
    import os
    import subprocess
    import sys

    script = tmp_path_factory.mktemp("raylet-gone") / "job.py"
    script.write_text(_RAYLET_GONE)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=150, env=env, start_new_session=True)


def test_shutdown_with_wait_after_the_raylet_died_raises_within_its_timeout(
        raylet_gone: Any) -> None:
    """Issue 50, row 12: signals sent to the whole process group end the local raylet and
    GCS too; ``await ckpt.shutdown(wait=True)`` then hung in Ray's
    ``list_named_actors`` until SIGKILL. Every call to Ray there is bounded by
    ``timeout_s``. An unawaited ``shutdown()`` gives up as long after, with one warning."""
    done = raylet_gone
    out = done.stdout
    assert "unawaited returned after" in out, out + done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "shutdown of namespace" in line]
    assert len(warned) == 1 and "Ray did not kill the namespace's actors within 2s" \
        in warned[0], done.stderr[-3000:]
    assert "raised after" in out, out + done.stderr[-3000:]
    assert "Ray did not kill the namespace's actors within 4s" in out, out
    assert "its GCS or this node's raylet is unreachable" in out, out
    seconds = float(out.split("raised after ")[1].split("s:")[0])
    assert seconds < 4.0 + 2.0, out  # the timeout, not Ray's own minute of retries


def test_shutdown_waits_on_a_dead_ray_off_the_event_loop(raylet_gone: Any) -> None:
    """Issue 50, row 12: while ``await ckpt.shutdown(wait=True)`` waits for a Ray whose
    GCS is gone, the loop's other tasks run (a ticker every 50 ms here; a preemption's
    signal handlers in a job); the call held the loop for all of its ``timeout_s``."""
    out = raylet_gone.stdout
    assert "raised after" in out, out + raylet_gone.stderr[-3000:]
    ticked = int(out.split("the loop ticked ")[1].split(" times")[0])
    assert ticked >= 2, out


def test_a_driver_whose_raylet_died_ends_its_asyncio_run_after_shutdown_and_exits_normally(
        raylet_gone: Any) -> None:
    """Issue 50, row 12: with the GCS gone, the driver's lookups of its holders' handles,
    stuck in the loop's default executor, held ``asyncio.run``'s end until Ray's own
    minute of reconnecting ended the process ("Failed to connect to GCS within 60
    seconds"). They run on daemon threads now: ``asyncio.run`` returns once shutdown's
    ``timeout_s`` (2 s, then 4 s) have passed, and the process exits 0."""
    done = raylet_gone
    assert "asyncio.run returned" in done.stdout, done.stdout + done.stderr[-3000:]
    seconds = float(done.stdout.split("asyncio.run returned ")[1].split("s after")[0])
    assert seconds < 2.0 + 4.0 + 4.0, done.stdout  # the timeouts, not Ray's minute
    assert done.returncode == 0, done.stderr[-3000:]
