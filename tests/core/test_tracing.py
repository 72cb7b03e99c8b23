"""Tracing (``nemo_ckpt.tracing``) in-process: a snapshot and a restore each one trace
whose phases nest under the driver's span, an error recorded on its span, nothing of
OpenTelemetry imported without it, and a trace file that is not a regular file refused
at the driver's construction. A trace file the actors cannot open, on real Ray:
``tests/ray_cluster/test_observability.py``. The trace file of a run on real Ray, spans of one
trace from the driver, the coordinator and the holders:
``tests/examples/test_demo.py::assert_one_trace_per_operation_across_processes``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
from nemo_ckpt.errors import SnapshotNotFoundError, TraceFileError
from tests.harness import World

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """The spans this process finishes while this module runs (an SDK provider is set
    once per process; the exporter keeps nothing after the module)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    exporter.clear()
    yield exporter
    exporter.clear()


def _by_name(found: Any) -> dict[str, list[Any]]:
    named: dict[str, list[Any]] = {}
    for s in found:
        named.setdefault(s.name, []).append(s)
    return named


def test_a_snapshot_is_one_trace_with_each_holders_phases_under_the_coordinators(
        tmp_path: Path, spans: InMemorySpanExporter) -> None:
    job = World(tmp_path)
    try:
        async def run() -> None:
            live = await job.populate()
            await job.snapshot(tmp_path / "step-1", live)

        job.run(run())
    finally:
        job.close()
    named = _by_name(spans.get_finished_spans())
    (root,) = named["nemo_ckpt.snapshot"]
    assert root.parent is None
    (begin,) = named["nemo_ckpt.snapshot.begin"]
    (commit,) = named["nemo_ckpt.commit"]
    assert begin.parent.span_id == root.context.span_id
    assert commit.parent.span_id == root.context.span_id
    assert len(named["nemo_ckpt.pause"]) == 3  # one per holder, under the begin
    assert {p.parent.span_id for p in named["nemo_ckpt.pause"]} == {begin.context.span_id}
    pauses = {p.context.span_id for p in named["nemo_ckpt.pause"]}
    for child in ("nemo_ckpt.drain", "nemo_ckpt.capture"):
        assert {s.parent.span_id for s in named[child]} == pauses, child
    assert {s.parent.span_id for s in named["nemo_ckpt.persist"]} == {begin.context.span_id}
    everything = [s for group in named.values() for s in group]
    assert {s.context.trace_id for s in everything} == {root.context.trace_id}
    assert sum(s.attributes["nemo_ckpt.sessions"] for s in named["nemo_ckpt.capture"]) == 6
    assert commit.attributes["nemo_ckpt.bytes"] > 0
    assert {s.attributes["nemo_ckpt.outcome"] for s in everything} == {"ok"}


def test_a_failed_restore_records_its_error_on_the_span_where_it_failed(
        tmp_path: Path, spans: InMemorySpanExporter) -> None:
    job = World(tmp_path)
    try:
        async def run() -> None:
            async with job.ckpt.restored(tmp_path / "nothing-here"):
                raise AssertionError("restored a path without a snapshot")

        with pytest.raises(SnapshotNotFoundError):
            job.run(run())
    finally:
        job.close()
    named = _by_name(spans.get_finished_spans())
    (prepare,) = named["nemo_ckpt.restore.prepare"]
    (root,) = named["nemo_ckpt.restore"]
    for span in (prepare, root):
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes["nemo_ckpt.outcome"] == "failed"
        assert [e.attributes["exception.type"] for e in span.events
                if e.name == "exception"] == ["nemo_ckpt.errors.SnapshotNotFoundError"]
    assert prepare.parent.span_id == root.context.span_id


def test_without_opentelemetry_nothing_of_it_is_imported_and_a_snapshot_works(
        tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
        from pathlib import Path
        from nemo_ckpt import tracing
        from tests.harness import World
        job = World(Path({str(tmp_path)!r}))
        async def run():
            live = await job.populate()
            await job.snapshot(Path({str(tmp_path / "step-1")!r}), live)
        job.run(run())
        job.close()
        assert not tracing.enabled()
        loaded = [m for m in sys.modules if m.startswith("opentelemetry.")]
        print("loaded:", loaded)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded: []" in done.stdout
    assert (tmp_path / "step-1" / "environment" / "manifest.json").is_file()


def refusal(path: Path) -> str:
    """The one line the driver's construction refuses ``path`` as a trace file with."""
    with pytest.raises(TraceFileError,
                       match=rf"^CheckpointConfig.trace_file {re.escape(str(path))} is ") as e:
        RayEnvironmentCheckpoint(CheckpointConfig(trace_file=path))
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.timeout(15)
def test_a_fifo_as_trace_file_is_refused_at_construction_without_waiting_for_a_reader(
        tmp_path: Path) -> None:
    fifo = tmp_path / "spans.jsonl"
    os.mkfifo(fifo)
    assert "is a FIFO" in refusal(fifo)  # no reader: a blocking open waited for ever
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert "is a FIFO" in refusal(fifo)  # a reader: opened, refused by what it is
    finally:
        os.close(reader)


def test_a_symlinked_trace_file_is_refused_and_its_target_never_written(
        tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.jsonl"
    link = tmp_path / "spans.jsonl"
    link.symlink_to(target)
    assert "is a symbolic link" in refusal(link)
    assert not target.exists()
    target.write_text("")
    assert "is a symbolic link" in refusal(link)
    assert target.read_text() == ""


def test_a_device_as_trace_file_is_refused(tmp_path: Path) -> None:
    assert "is a device" in refusal(Path("/dev/null"))
