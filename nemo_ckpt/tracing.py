"""One trace per snapshot and restore, across the driver, the coordinator and each holder.

With OpenTelemetry's API installed (the ``otel`` extra), every snapshot and restore is
one trace: the driver's root span, the coordinator's phases under it, and each holder's
under those. Ray's own tracing hook is not used; the W3C ``traceparent`` of the span a
call belongs to is carried in the typed calls themselves (``begin_snapshot`` and
``prepare_restore`` of ``nemo_ckpt.protocol.coordinator_api``, ``begin`` and
``prepare_restore`` of ``nemo_ckpt.protocol.holder_api``) and kept with the operation's
record on each side for its later phases. Without the API, this module imports nothing
of it, and each span is a no-op.

The spans, in NeMo Gym's style:

    nemo_ckpt.snapshot                  driver: ``snapshot()`` or ``final_snapshot()``, whole
      nemo_ckpt.snapshot.begin          coordinator: claim, pause and capture on every holder
        nemo_ckpt.pause                 holder: the gate closed, the drain, the capture
          nemo_ckpt.drain               holder: turns in flight waited for
          nemo_ckpt.capture             holder: the sessions copied
      nemo_ckpt.persist                 holder: its shard written (under the begin's span)
      nemo_ckpt.commit                  coordinator: every shard durable, the manifest
    nemo_ckpt.restore                   driver: ``restored()``, whole
      nemo_ckpt.restore.prepare         coordinator: the manifest read, instances placed
        nemo_ckpt.prepare               holder: its shards read and verified
        nemo_ckpt.verify                coordinator: what the holders read checked
      nemo_ckpt.install                 holder: its sessions made live
      nemo_ckpt.restore.commit          coordinator

Attributes under ``nemo_ckpt.``: ``operation.id``, ``instance``, ``sessions``, ``bytes``,
``phase``, ``path``, and ``outcome`` (``ok`` or ``failed``); an error is recorded on its
span with an ERROR status. ``CheckpointConfig.trace_file`` has every process of the job
append each finished span to one file as a JSON line (``write_spans_to``; it needs the
SDK, ``opentelemetry-sdk``). The file is a regular file or nothing: a FIFO, a device or a
symbolic link is refused at once with ``TraceFileError`` (never waited on, never
followed); the driver raises it, and an actor that cannot open the file keeps running
without it and says so (``check_startup`` warns naming the file and the cause).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from typing import Any, cast

from nemo_ckpt.errors import TraceFileError

__all__ = ["enabled", "open_trace_file", "set_attributes", "span", "traceparent",
           "write_spans_or_say_why", "write_spans_to"]

# None: not looked for yet; False: the API is not installed; else (trace, propagator).
_api: Any = None
_writing: set[str] = set()  # the trace files this process writes to
_lock = threading.Lock()


def _otel() -> Any:
    global _api
    if _api is None:
        try:
            found = importlib.util.find_spec("opentelemetry") is not None
        except ValueError:  # blocked in sys.modules
            found = False
        if not found:
            _api = False
        else:
            try:
                from opentelemetry import trace
                from opentelemetry.trace.propagation.tracecontext import (
                    TraceContextTextMapPropagator,
                )
            except ImportError:  # blocked, or a broken install: traced as absent
                _api = False
            else:
                _api = (trace, TraceContextTextMapPropagator())
    return _api


def enabled() -> bool:
    """Whether OpenTelemetry's API is installed (spans are made; an SDK records them)."""
    return bool(_otel())


@contextlib.contextmanager
def span(name: str, parent: str = "", **attributes: Any) -> Iterator[Any]:
    """A span named ``name`` around the block, the child of ``parent`` (a
    ``traceparent``) when given, else of the current span; each attribute is set under
    ``nemo_ckpt.``. Yields the span (None without the API)."""
    api = _otel()
    if not api:
        yield None
        return
    trace, propagator = api
    context = propagator.extract({"traceparent": parent}) if parent else None
    tracer = trace.get_tracer("nemo_ckpt")
    with tracer.start_as_current_span(name, context=context) as current:
        for key, value in attributes.items():
            if value is not None:
                current.set_attribute(f"nemo_ckpt.{key}", value)
        try:
            yield current
        except BaseException:
            current.set_attribute("nemo_ckpt.outcome", "failed")
            raise
        current.set_attribute("nemo_ckpt.outcome", "ok")


def set_attributes(current: Any, **attributes: Any) -> None:
    """Set attributes learned inside a span's block (``current`` may be None)."""
    if current is not None:
        for key, value in attributes.items():
            if value is not None:
                current.set_attribute(f"nemo_ckpt.{key}", value)


def traceparent() -> str:
    """The W3C ``traceparent`` of the current span, for a call to carry ("" without the
    API or outside any span)."""
    api = _otel()
    if not api:
        return ""
    carrier: dict[str, str] = {}
    api[1].inject(carrier)
    return carrier.get("traceparent", "")


def write_spans_to(path: str) -> None:
    """Append every span this process finishes to ``path``, one JSON line each
    (``name``, ``trace_id``, ``span_id``, ``parent_id``, ``pid``, times, attributes,
    status); once per path and process. Needs the SDK: ``ImportError`` saying what to
    install otherwise; ``TraceFileError`` when ``path`` is not a regular file this
    process can append to (``open_trace_file``)."""
    with _lock:
        if path in _writing:
            return
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        except ImportError as exc:
            raise ImportError(
                f"CheckpointConfig.trace_file ({path}) needs OpenTelemetry's SDK in every "
                f"process of the job: pip install 'nemo-ckpt[otel]' opentelemetry-sdk"
            ) from exc
        exporter = _JsonLines(path)  # the file first: a refused one sets up nothing
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):  # none set yet: ours
            provider = TracerProvider()
            trace.set_tracer_provider(provider)
        provider.add_span_processor(SimpleSpanProcessor(cast(Any, exporter)))
        _writing.add(path)


def write_spans_or_say_why(path: str | None) -> str | None:
    """For an actor: ``write_spans_to(path)`` (nothing when ``path`` is None), or the one
    line saying why it cannot. Spans are not recovery: an actor that cannot write them
    runs on without, and ``check_startup`` warns with this line (an actor that failed to
    start for it looked like an outage)."""
    if path is None:
        return None
    try:
        write_spans_to(path)
    except (TraceFileError, ImportError) as exc:
        return str(exc)
    return None


def open_trace_file(path: str) -> int:
    """A descriptor appending to ``path``, a regular file (made if missing), or
    ``TraceFileError`` in one line naming it. ``O_NONBLOCK``: a FIFO's open returns at
    once (a blocking one waits for a reader, for ever); ``O_NOFOLLOW``: a link is not
    followed to whatever it names; ``fstat`` refuses anything else not a regular file."""
    where = f"CheckpointConfig.trace_file {path}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TraceFileError(
                f"{where} is a symbolic link: spans are appended to a regular file only "
                f"and a link is not followed; name the file itself") from None
        if exc.errno == errno.ENXIO:  # a FIFO (or socket) with no reader
            raise TraceFileError(
                f"{where} is a FIFO or a socket, not a regular file: spans are appended "
                f"to a regular file only; name a file (it is made if missing)") from None
        raise TraceFileError(
            f"{where} cannot be opened for appending here: {exc.strerror or exc}; name a "
            f"file in a folder that exists and is writable on every node of the job (a "
            f"shared filesystem), or leave trace_file unset") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if (
            stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) else "not a regular file"
        raise TraceFileError(
            f"{where} is {kind}: spans are appended to a regular file only; name a file "
            f"(it is made if missing)")
    return fd


class _JsonLines:
    """A span exporter that appends each span as one JSON line: one ``write`` of an
    ``O_APPEND`` descriptor per line, so lines from many processes do not interleave."""

    def __init__(self, path: str) -> None:
        self._fd = open_trace_file(path)

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        for s in spans:
            parent = s.parent
            line = json.dumps({
                "name": s.name, "trace_id": f"{s.context.trace_id:032x}",
                "span_id": f"{s.context.span_id:016x}",
                "parent_id": None if parent is None else f"{parent.span_id:016x}",
                "pid": os.getpid(), "start_ns": s.start_time, "end_ns": s.end_time,
                "attributes": dict(s.attributes or {}),
                "status": s.status.status_code.name}, default=str)
            os.write(self._fd, (line + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        os.close(self._fd)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True
