"""Logs that explain a pause: one structured line per phase, naming the slowest holder."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.coordinator import CheckpointCoordinator
from actors.ray_transport import RayTransport
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt import SessionClient
from nemo_ckpt.config import HOLDER_NAME_PREFIX

pytestmark = pytest.mark.timeout(90)


def phase_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage().split(" ", 1)[1]) for r in caplog.records
            if r.name == "nemo_ckpt.coordinator" and r.getMessage().startswith("nemo_ckpt {")]


async def test_each_phase_logs_its_holder_timings_and_names_the_slowest(
    ckpt: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c = await SessionClient.connect("holder-1", namespace=ckpt.config.namespace)
    await c.open(Ep("r", 0), b"s")
    slow = ray.get_actor(HOLDER_NAME_PREFIX + "holder-2", namespace=ckpt.config.namespace)
    await slow.inject_delay.remote("capture", 0.4)
    # The coordinator's logic, run in this process so its log lines reach caplog.
    coordinator = CheckpointCoordinator(ckpt.config, RayTransport(ckpt.config))
    caplog.set_level(logging.INFO, logger="nemo_ckpt.coordinator")
    begun = await coordinator.begin_snapshot("snap-log", str(tmp_path / "c"))
    await coordinator.commit_snapshot("snap-log", str(tmp_path / "c"), {}, 0)

    lines = {line["phase"]: line for line in phase_lines(caplog)}
    assert set(lines) == {"pause_capture", "finish_persist"}
    capture = lines["pause_capture"]
    assert capture["operation"] == "snap-log" and capture["slowest"] == "holder-2"
    assert set(capture["holders"]) == {"holder-0", "holder-1", "holder-2"}
    assert capture["holders"]["holder-2"] >= 0.4 > capture["holders"]["holder-0"]
    assert begun.captures and all("errors" not in line for line in lines.values())
