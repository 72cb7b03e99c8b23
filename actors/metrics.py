"""Prometheus metrics the coordinator and the holders publish through ``ray.util.metrics``.

Ray exports them from each node's metrics agent (``ray[default]``), prefixed ``ray_``.
Metric objects are created lazily inside the actor process that records them. Every
sample carries ``JOB_LABEL``, the job's Ray namespace (``CheckpointConfig.namespace``), so
two jobs on one cluster are told apart (``actors.ray_transport.RayMetrics`` adds it).
"""

from __future__ import annotations

import functools
from typing import Any

# Not "job": Prometheus sets ``job`` to the scrape target's name, and renames a scraped
# ``job`` label to ``exported_job`` (unless the scrape says ``honor_labels``).
JOB_LABEL = "ray_namespace"

# Seconds: a pause is milliseconds when healthy and tens of seconds when a drain waits.
_SECONDS_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 120.0, 600.0]


@functools.cache
def _metrics() -> dict[str, Any]:
    from ray.util.metrics import Counter, Gauge, Histogram

    return {
        "snapshot_duration": Histogram(
            "nemo_ckpt_snapshot_duration_seconds",
            description="Snapshot duration, from pause to commit and resume.",
            boundaries=_SECONDS_BUCKETS, tag_keys=(JOB_LABEL,)),
        "paused": Histogram(
            "nemo_ckpt_snapshot_paused_seconds",
            description="Seconds the holders stayed paused for one snapshot.",
            boundaries=_SECONDS_BUCKETS, tag_keys=(JOB_LABEL,)),
        "bytes_written": Counter(
            "nemo_ckpt_snapshot_bytes_written_total",
            description="Shard bytes written by committed snapshots.", tag_keys=(JOB_LABEL,)),
        "captured": Counter(
            "nemo_ckpt_captured_rollouts_total",
            description="Rollouts captured by committed snapshots.", tag_keys=(JOB_LABEL,)),
        "restarted": Counter(
            "nemo_ckpt_restarted_rollouts_total",
            description="Rollouts mid-turn at the drain deadline, left out of snapshots.",
            tag_keys=(JOB_LABEL,)),
        "failures": Counter(
            "nemo_ckpt_failures_total",
            description="Failed snapshots and restores, by operation and error kind.",
            tag_keys=(JOB_LABEL, "operation", "kind")),
        "restore_duration": Histogram(
            "nemo_ckpt_restore_duration_seconds",
            description="Restore duration, from reading the manifest to sessions live.",
            boundaries=_SECONDS_BUCKETS, tag_keys=(JOB_LABEL,)),
        "restore_read": Histogram(
            "nemo_ckpt_restore_read_seconds",
            description="A restore's slowest holder reading its shards: fetched, verified, "
                        "decoded into sessions.",
            boundaries=_SECONDS_BUCKETS, tag_keys=(JOB_LABEL,)),
        "drain": Histogram(
            "nemo_ckpt_holder_drain_seconds",
            description="Seconds a holder waited for turns in flight at a pause.",
            boundaries=_SECONDS_BUCKETS, tag_keys=(JOB_LABEL, "instance")),
        "sessions": Gauge(
            "nemo_ckpt_holder_sessions",
            description="Live sessions on a holder.", tag_keys=(JOB_LABEL, "instance")),
        "sandboxes": Gauge(
            "nemo_ckpt_holder_sandboxes",
            description="Live sessions' sandboxes (directories, containers) on a holder.",
            tag_keys=(JOB_LABEL, "instance")),
    }


def observe(name: str, value: float, tags: dict[str, str] | None = None) -> None:
    """Record ``value`` on histogram ``name``."""
    _metrics()[name].observe(value, tags=tags)


def inc(name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
    """Add ``value`` to counter ``name``. A zero makes its series exist at 0 (a
    counter absent until its first event reads as "no data", not as none)."""
    if value > 0:
        _metrics()[name].inc(value, tags=tags)
    elif value == 0:
        # Ray's inc refuses 0; the record it wraps takes it, and exports the series.
        _metrics()[name]._record(0, tags=tags)


def set_gauge(name: str, value: float, tags: dict[str, str] | None = None) -> None:
    """Set gauge ``name`` to ``value``."""
    _metrics()[name].set(value, tags=tags)
