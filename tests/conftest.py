"""Shared fixtures: one real multi-node Ray cluster for the whole session, and one real
S3-compatible server for the sessions whose tests ask for a bucket (``s3_server``).

The cluster (head plus two worker nodes, each its own raylet) starts on first use and
is shut down at the end of the session. Each test gets its own Ray namespace through
``ckpt`` and kills its actors afterwards, so tests never see each other's holders.
Tests that remove nodes add them back before they finish (``spare_node``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

WORKER_NODES = 2

# The modules that run containers on this machine's podman: each checks at its end that
# no container named nemo-ckpt-* is left and nothing is mounted, and test_container_sessions
# removes every such container after each test, so two of them must never run at once.
# Here and below, modules by file name, wherever under tests/ they live
# (tests/house/test_layout.py checks that each names one module).
PODMAN_MODULES = {"test_containers.py", "test_containers_ray.py", "test_container_sessions.py",
                  "test_container_demo.py", "test_nemo_gym_docker.py", "test_gym_demo.py"}


# The modules that take longest (minutes each on 2 cores), longest first: under xdist they
# start first, so that no worker is left with a long one while the other is idle (xdist
# would otherwise start the modules with the most tests first, and test_chaos.py last).
SLOWEST_MODULES = ("podman", "test_faults.py", "test_chaos.py", "test_demo.py",
                   "test_preemption_demo.py", "test_grpo_example.py", "test_ray_runtime.py",
                   "test_adapters.py", "test_gym_workers_example.py")


def _module_group(name: str) -> str:
    return "podman" if name in PODMAN_MODULES else name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, the slowest modules first (``SLOWEST_MODULES``); a run without ``-n``
    keeps pytest's order."""
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(_module_group(item.path.name), len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make test`` runs ``pytest -n 3 --dist loadfile`` (pytest-xdist): a module's tests
    on one worker, so its module-scoped fixtures start once, and the podman modules on the
    same worker, one after another, in the order the workers collected them (the slowest
    first). Each worker has its own session fixtures (a Ray cluster, S3 servers) on ports
    of their own. (xdist's own ``loadgroup`` marks do not group under pytest 9, whose node
    ids no longer come from the attribute xdist rewrites.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "podman" if module.rsplit("/", 1)[-1] in PODMAN_MODULES else module

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A SeaweedFS server on 127.0.0.1 (``tests/s3_server.py``), its bucket
    reachable through the ``AWS_*`` environment of this process and of every Ray worker
    started after it (``cluster`` starts it first when a test of the session asks for
    both)."""
    from tests.s3_server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3"))
    saved = {k: os.environ.get(k) for k in server.env()}
    server.start()
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def asks_for_a_bucket(items: list[pytest.Item]) -> bool:
    """Whether any of ``items`` uses ``s3_server``, directly or through a fixture."""
    return any("s3_server" in getattr(item, "fixturenames", ()) for item in items)


@pytest.fixture(scope="session", params=["seaweedfs", "rclone", "azurite"])
def object_store_server(request: pytest.FixtureRequest,
                        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Each object store the object-store tests run against in turn (the S3 servers of
    ``tests.s3_server.SERVERS``, and Azurite for ``az://``), started only for the tests
    that use it and stopped after them. Unlike ``s3_server`` it leaves the environment
    alone: a test points its client at it with ``server.env()``."""
    from tests.azurite_server import AzuriteServer
    from tests.s3_server import SERVERS

    if request.param == "seaweedfs":
        yield request.getfixturevalue("s3_server")
        return
    kind = AzuriteServer if request.param == "azurite" else SERVERS[request.param]
    server = kind(tmp_path_factory.mktemp(request.param))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A local multi-node Ray cluster, connected as this process's driver. Its workers
    reach ``s3_server`` through the environment they inherit from this process, read when
    they start: so the server starts before the cluster in a session that has a test
    asking for it, and not at all in one that has none."""
    import ray
    from ray.cluster_utils import Cluster

    if asks_for_a_bucket(request.session.items):
        request.getfixturevalue("s3_server")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # The node stats Ray's dashboard shows, gathered by each node's agent every 5 s by
    # default (a scan of every process): no test reads them, and on 2 cores a gathering
    # per minute leaves their CPU to the tests. The metrics our actors export go another
    # way (tests/ray_cluster/test_metrics.py).
    os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": False,
            # The log monitor tails every worker's log files to stream them to drivers
            # that ask (`log_to_driver`); none here does, and with hundreds of workers
            # per run it was a few percent of the suite's CPU on 2 cores.
            "include_log_monitor": False,
            # Detect a removed node in ~5 s instead of ~15 s; tighter than this, a node
            # of a loaded 2-core machine was seen declared dead while alive.
            "_system_config": {"health_check_period_ms": 1000,
                               "health_check_failure_threshold": 5,
                               "health_check_timeout_ms": 1000},
        },
    )
    for _ in range(WORKER_NODES):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def alive_node_ids() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def remove_node_and_wait(cluster: Any, node: Any, timeout_s: float = 30.0) -> None:
    """Kill a node and wait until Ray declares it dead, so that the next test does not
    schedule actors on a node that is gone but still listed alive."""
    import time

    cluster.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + timeout_s
    while node.node_id in alive_node_ids():
        if time.monotonic() > deadline:
            raise AssertionError(f"node {node.node_id} still alive {timeout_s}s after removal")
        time.sleep(0.2)


@pytest.fixture
def extra_node(cluster: Any) -> Iterator[Any]:
    """A worker node added for this test and removed (if still there) afterwards."""
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield node
    finally:
        if node in cluster.worker_nodes:
            remove_node_and_wait(cluster, node)


@pytest.fixture
def world(tmp_path: Any) -> Iterator[Any]:
    """An in-process job under virtual time (``tests.harness.World``)."""
    from tests.harness import World

    w = World(tmp_path)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def rooted_world(tmp_path: Any) -> Iterator[Any]:
    """``world`` with ``checkpoint_root`` at ``tmp_path / "ckpt"`` (made)."""
    from tests.harness import CONFIG, World

    (tmp_path / "ckpt").mkdir()
    w = World(tmp_path, config=CONFIG.model_copy(
        update={"checkpoint_root": tmp_path / "ckpt"}))
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def namespace() -> str:
    """A Ray namespace of this test's own."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def ckpt(cluster: Any, namespace: str, tmp_path: Any) -> AsyncIterator[Any]:
    """A RayEnvironmentCheckpoint in a fresh namespace, with short deadlines. It commits
    snapshots that no cut checked: these tests exercise the backend alone (the refusal of
    unchecked snapshots is tested in driver/test_fail_closed.py and
    ray_cluster/test_ray_runtime.py)."""
    from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint

    config = CheckpointConfig(allow_unchecked_snapshots=True,
                              namespace=namespace, checkpoint_root=tmp_path,
                              drain_timeout_s=1.0, lease_s=4.0, phase_timeout_s=10.0,
                              persist_timeout_s=30.0)
    checkpoint = RayEnvironmentCheckpoint(config)
    await checkpoint.ensure_holders()
    try:
        yield checkpoint
    finally:
        checkpoint.shutdown()


def kill_a_driver_inside(address: str, config: Any, block: str, path: Any,
                         timeout_s: float = 120.0) -> None:
    """Run a driver process that enters ``RayEnvironmentCheckpoint(config).<block>(path)``
    (``snapshot`` or ``restored``) on the cluster at ``address`` and dies inside it: no
    exit handler, no abort, no more lease renewals."""
    import subprocess
    import sys

    script = f"""
import asyncio, os, ray
from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
ray.init(address={address!r}, log_to_driver=False)
config = CheckpointConfig.model_validate_json({config.model_dump_json()!r})
async def main():
    async with RayEnvironmentCheckpoint(config).{block}({str(path)!r}):
        print("inside", flush=True)
        os._exit(3)
asyncio.run(main())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 3 and "inside" in proc.stdout, proc.stderr[-2000:]
