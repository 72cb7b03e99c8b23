"""The Prometheus metrics, read back from the nodes' metrics agents as Prometheus would."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import ray

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
                if n == "ray_nemo_ckpt_holder_sessions"}

    def arrived(samples: list[tuple[str, dict[str, str], float]]) -> bool:
        return (all(total(samples, n) >= v for n, v in wanted.items())
                and total(samples, "ray_nemo_ckpt_failures_total", operation="snapshot",
                          kind="SnapshotMismatchError") >= 1
                and {"holder-0", "holder-1", "holder-2"} <= gauged(samples))

    samples: list[tuple[str, dict[str, str], float]] = []
    for _ in range(60):
        samples = scrape()
        if arrived(samples):
            break
        await asyncio.sleep(1)
    got = {n: total(samples, n) for n in wanted}
    assert all(got[n] >= v for n, v in wanted.items()), got
    assert total(samples, "ray_nemo_ckpt_failures_total", operation="snapshot",
                 kind="SnapshotMismatchError") >= 1
    assert {"holder-0", "holder-1", "holder-2"} <= gauged(samples)
