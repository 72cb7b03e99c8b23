"""The Prometheus metrics, read back from the nodes' metrics agents as Prometheus would:
every sample labelled with its job's Ray namespace, so the tests of one session (each in
its own namespace) are told apart as two jobs would be."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.metrics import JOB_LABEL as JOB
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt import SessionClient
from nemo_ckpt.errors import SnapshotMismatchError
from nemo_ckpt.testing import StaticCut

pytestmark = pytest.mark.timeout(120)

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def scrape() -> list[tuple[str, dict[str, str], float]]:
    """Every sample every alive node's metrics agent exports now."""
    samples = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        url = f"http://{node['NodeManagerAddress']}:{port}/metrics"
        try:
            body = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        for line in body.splitlines():
            m = _SAMPLE.match(line)
            if m and m["name"].startswith("ray_nemo_ckpt_"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
                samples.append((m["name"], labels, float(m["value"])))
    return samples


def total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == want for k, want in labels.items()))


async def test_snapshot_restore_and_failure_metrics_are_exported(
    ckpt: Any, tmp_path: Path
) -> None:
    c = await SessionClient.connect("holder-0", namespace=ckpt.config.namespace)
    ep = Ep("metered", 0)
    await c.open(ep, b"x" * 1000)
    async with ckpt.snapshot(tmp_path / "ok") as snap:
        await snap.check_against_cut(StaticCut({"holder-0": {ep}}, set()))
    written = snap.metrics(0)["bytes_written"]
    with pytest.raises(SnapshotMismatchError):
        async with ckpt.snapshot(tmp_path / "bad") as snap:
            await snap.check_against_cut(StaticCut({}, set()))
    await ckpt.retire([ep])
    async with ckpt.restored(tmp_path / "ok"):
        pass

    # Ray's agents export every few seconds; wait until all of it has arrived.
    ns = ckpt.config.namespace
    wanted = {
        "ray_nemo_ckpt_snapshot_duration_seconds_count": 1,
        "ray_nemo_ckpt_snapshot_paused_seconds_count": 1,
        "ray_nemo_ckpt_snapshot_bytes_written_total": written,
        "ray_nemo_ckpt_captured_rollouts_total": 1,
        "ray_nemo_ckpt_restore_duration_seconds_count": 1,
        "ray_nemo_ckpt_restore_read_seconds_count": 1,
        "ray_nemo_ckpt_holder_drain_seconds_count": 3,
    }
    def gauged(samples: list[tuple[str, dict[str, str], float]]) -> set[str | None]:
        return {lab.get("instance") for n, lab, _ in samples
                if n == "ray_nemo_ckpt_holder_sessions" and lab.get(JOB) == ns}

    def arrived(samples: list[tuple[str, dict[str, str], float]]) -> bool:
        return (all(total(samples, n, **{JOB: ns}) >= v for n, v in wanted.items())
                and total(samples, "ray_nemo_ckpt_failures_total", operation="snapshot",
                          kind="SnapshotMismatchError", **{JOB: ns}) >= 1
                and {"holder-0", "holder-1", "holder-2"} <= gauged(samples))

    samples: list[tuple[str, dict[str, str], float]] = []
    for _ in range(60):
        samples = scrape()
        if arrived(samples):
            break
        await asyncio.sleep(1)
    got = {n: total(samples, n, **{JOB: ns}) for n in wanted}
    assert all(got[n] >= v for n, v in wanted.items()), str(got)
    assert total(samples, "ray_nemo_ckpt_failures_total", operation="snapshot",
                 kind="SnapshotMismatchError", **{JOB: ns}) >= 1
    assert {"holder-0", "holder-1", "holder-2"} <= gauged(samples)


async def test_a_jobs_failure_counters_and_holder_sessions_are_exported_from_its_start(
        ckpt: Any) -> None:
    ns = ckpt.config.namespace
    holders = {h.instance_id for h in await ckpt.holders()}
    c = await SessionClient.connect("holder-0", namespace=ns)
    for k in range(2):
        await c.open(Ep(f"counted-{k}", 0), b"s")

    def ours(samples: list[tuple[str, dict[str, str], float]], name: str
             ) -> dict[tuple[str, ...], float]:
        return {tuple(sorted((k, v) for k, v in lab.items() if k in ("operation", "kind",
                                                                      "instance"))): v
                for n, lab, v in samples if n == name and lab.get(JOB) == ns}

    want_failures = {(("kind", ""), ("operation", "snapshot")): 0.0,
                     (("kind", ""), ("operation", "restore")): 0.0}
    want_sessions = {(("instance", i),): 2.0 if i == "holder-0" else 0.0 for i in holders}
    want_sandboxes = {(("instance", i),): 0.0 for i in holders}  # sessions without one
    failures: dict[tuple[str, ...], float] = {}
    sessions: dict[tuple[str, ...], float] = {}
    sandboxes: dict[tuple[str, ...], float] = {}
    for _ in range(60):  # no snapshot, no failure: only the job's start and two opens
        samples = scrape()
        failures = ours(samples, "ray_nemo_ckpt_failures_total")
        sessions = ours(samples, "ray_nemo_ckpt_holder_sessions")
        sandboxes = ours(samples, "ray_nemo_ckpt_holder_sandboxes")
        if (failures, sessions, sandboxes) == (want_failures, want_sessions,
                                               want_sandboxes):
            break
        await asyncio.sleep(1)
    assert failures == want_failures
    assert sessions == want_sessions
    assert sandboxes == want_sandboxes
    assert ours(samples, "ray_nemo_ckpt_captured_rollouts_total") == {(): 0.0}
