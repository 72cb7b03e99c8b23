"""Logs that explain a pause: one structured line per phase, naming the slowest holder;
and a trace file the actors cannot open, said in one line per actor at startup."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.coordinator.actor import CheckpointCoordinator
from actors.ray_transport import RayTransport
from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt import EnvironmentEpisode as Ep
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
    assert set(lines) == {"begin_snapshot", "finish_writes"}
    capture = lines["begin_snapshot"]
    assert capture["operation"] == "snap-log" and capture["slowest"] == "holder-2"
    assert set(capture["holders"]) == {"holder-0", "holder-1", "holder-2"}
    assert capture["holders"]["holder-2"] >= 0.4 > capture["holders"]["holder-0"]
    assert begun.captures and all("errors" not in line for line in lines.values())


async def test_a_trace_file_the_actors_cannot_open_is_a_startup_warning_naming_it(
    cluster: Any, namespace: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Case 14 of issue 50: the actors died in their constructors, and ``check_startup``
    failed after 45-53 s as a retriable "coordinator unreachable" naming neither."""
    only_here = tmp_path / "driver-node-only"
    only_here.mkdir()
    spans = only_here / "spans.jsonl"
    ckpt = RayEnvironmentCheckpoint(CheckpointConfig(
        namespace=namespace, checkpoint_root=tmp_path / "ckpt", trace_file=spans))
    shutil.rmtree(only_here)  # the driver has it open; the actors' nodes lack the folder
    try:
        with caplog.at_level(logging.WARNING, logger="nemo_ckpt"):
            await asyncio.wait_for(ckpt.check_startup(), 60)
        infos = await ckpt.ensure_holders()
    finally:
        ckpt.shutdown()
    said = [r.getMessage() for r in caplog.records
            if r.name == "nemo_ckpt" and "writes no spans" in r.getMessage()]
    assert len(said) == len(infos) + 1  # each holder, and the coordinator
    for line in said:
        assert f"CheckpointConfig.trace_file {spans} cannot be opened" in line
        assert "No such file or directory" in line and "\n" not in line
    assert any(line.startswith("check_startup: the coordinator writes no spans")
               for line in said)
