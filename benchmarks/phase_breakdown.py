#!/usr/bin/env python3
"""Where a snapshot's and a restore's time goes, phase by phase (the evidence behind
benchmarks/README.md's bottleneck analysis).

It runs the coordinator's own code (``actors.coordinator.actor.CheckpointCoordinator``, a plain
asyncio class) inside this process instead of as an actor, and drives real holders on a
local multi-node cluster. Each holder phase (``begin_snapshot`` and ``finish_writes`` of
a snapshot, ``prepare_restore`` and ``commit_restore`` of a restore) is timed by the
coordinator's own phase log line (``benchmarks.common.PhaseLog``): the phase, its
slowest and its fastest holder. The rest of each coordinator call, its own work around
the holders (discovery, the folder and its claim, the manifest, the resume, clean-up),
is the call's time on this process's clock minus its phase's. Ray's pickling of the
values the coordinator actor would return to the driver is timed separately (the same
``ray.cloudpickle`` round trip). A second part times a shard's write and read paths
(``nemo_ckpt.storage.shards``) piece by piece in this process, with no Ray at all.

    python -m benchmarks.phase_breakdown --holders 4 --sessions 10000 --state-bytes 1024
    python -m benchmarks.phase_breakdown --shard-only --sessions 2500 --state-bytes 65536
    python -m benchmarks.phase_breakdown --object-store-server seaweedfs --sessions 1000 \
        --state-bytes 65536

With ``--object-store-server``, the snapshots go into a bucket of that local S3 server
(``tests.s3_server``) instead of a folder, and the coordinator's own calls to the store
around the holders (the manifest read, the read claim's write and release, the check
for moved blobs) are timed one by one; the folder-only parts (the direct splits) are
left out. Each restore's prepare also shows the CPU each kind of process (holders, the
S3 server, coordinators, this process, others) spent in it, from ``/proc``, against the
cores' capacity over its wall time: a prepare that uses it all waits for CPU, not I/O.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import ray
import ray.cloudpickle as cp

import actors.coordinator.folders
import actors.coordinator.restore
from actors.coordinator.actor import CheckpointCoordinator
from actors.ray_transport import RayTransport
from benchmarks.common import LocalCluster, MiB, PhaseLog, evict_from_page_cache, populate
from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.protocol.operations import new_operation_id as _new_id
from nemo_ckpt.session_record import SessionRecord, body_head, record_of, record_parts
from nemo_ckpt.storage.checkpoint_folder import environment_dir, prepare_environment_dir
from nemo_ckpt.storage.hashed_files import CONTENT_HASH, content_hasher, view_unpacker
from nemo_ckpt.storage.shards import read_shard, write_shard
from nemo_ckpt.storage.snapshot_files import read_manifest

_timings: dict[str, list[float]] = {}
# The coordinator's store calls in the restore under way, recorded after its call's line.
_store_calls: list[tuple[str, float]] = []


def new_operation_id(kind: str) -> str:
    return _new_id(kind, time.time(), uuid.uuid4().hex, 1)


def _record(key: str, seconds: float) -> None:
    _timings.setdefault(key, []).append(seconds * 1e3)


def _record_call(call: str, seconds: float, phase: str, lines: dict[str, dict[str, Any]]
                 ) -> None:
    """A coordinator call's time, its holder phase from the phase's log line, and the
    coordinator's own work around the phase (the call's time minus the phase's)."""
    _record(call, seconds)
    line = lines.get(phase)
    if line is None:  # the coordinator logged no such phase: nothing to split
        return
    holders = line["holders"].values()
    _record(f"  phase {phase} (log line)", line["seconds"])
    _record(f"    {phase}: slowest holder", max(holders))
    _record(f"    {phase}: fastest holder", min(holders))
    _record(f"  around {phase}: the coordinator's own work", seconds - line["seconds"])


@contextlib.contextmanager
def _timed_store_calls() -> Iterator[None]:
    """The coordinator's blocking calls to the store during a restore, each timed under
    its own key (they run in its threads, so a call's time is its own)."""
    patched: list[tuple[Any, str, Any]] = []

    def wrap(module: Any, name: str, key: str) -> None:
        original = getattr(module, name)

        @functools.wraps(original)
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                _store_calls.append((key, time.perf_counter() - t0))

        patched.append((module, name, original))
        setattr(module, name, timed)

    wrap(actors.coordinator.restore, "read_manifest", "  store: read the manifest")
    wrap(actors.coordinator.restore, "moved_blob_store", "  store: check for moved blobs")
    wrap(actors.coordinator.folders, "claim_for_reading", "  store: write the read claim")
    wrap(actors.coordinator.folders, "release_claim", "  store: release the read claim")
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def _cpu_by_process() -> dict[int, tuple[float, str]]:
    """Every process's CPU seconds so far (user and system, ``/proc/<pid>/stat``) and
    what it is: a holder, a coordinator, the S3 server, this process, or other."""
    tick = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    out: dict[int, tuple[float, str]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        kind = ("holders" if "SessionHolder" in cmd else
                "coordinators" if "CheckpointCoordinator" in cmd else
                "S3 server" if cmd.endswith(("/weed", "/rclone")) else
                "this process" if int(entry) == me else "others")
        out[int(entry)] = ((int(fields[11]) + int(fields[12])) / tick, kind)
    return out


def _record_cpu(what: str, before: dict[int, tuple[float, str]],
                after: dict[int, tuple[float, str]], wall: float) -> None:
    """The CPU every kind of process spent during ``what`` (``_cpu_by_process`` before
    and after), against the CPU the machine had in that time: on a small machine a
    phase that waits on a busy CPU shows as wait, not as work."""
    spent: dict[str, float] = {}
    for pid, (seconds, kind) in after.items():
        spent[kind] = spent.get(kind, 0.0) + seconds - before.get(pid, (0.0, kind))[0]
    _record(f"  cpu during {what}: all processes", sum(spent.values()))
    _record(f"    cpu during {what}: the cores' capacity in its wall time",
            wall * (os.cpu_count() or 1))
    for kind in ("holders", "S3 server", "coordinators", "this process", "others"):
        _record(f"    cpu during {what}: {kind}", spent.get(kind, 0.0))


async def _cluster_part(args: argparse.Namespace, bucket: str | None) -> None:
    tag = uuid.uuid4().hex[:6]
    cfg = CheckpointConfig(allow_unchecked_snapshots=True,
                           namespace=f"breakdown-{tag}", lease_s=120.0, phase_timeout_s=120.0)
    cfg_r = CheckpointConfig(allow_unchecked_snapshots=True,
                             namespace=f"breakdown-{tag}-r", lease_s=120.0,
                             phase_timeout_s=120.0)
    ckpt = RayEnvironmentCheckpoint(cfg)
    ckpt_r = RayEnvironmentCheckpoint(cfg_r)
    work = Path(tempfile.mkdtemp(prefix="nemo-ckpt-breakdown-"))
    try:
        infos = await ckpt.ensure_holders()
        await ckpt_r.ensure_holders()
        instances = [i.instance_id for i in infos]
        t = await populate(cfg.namespace, instances, args.sessions, args.state_bytes, 0)
        print(f"{len(instances)} holders, {args.sessions} sessions x {args.state_bytes} B "
              f"(populated in {t:.1f} s)")
        coord = CheckpointCoordinator(cfg, RayTransport(cfg))
        coord_r = CheckpointCoordinator(cfg_r, RayTransport(cfg_r))
        with PhaseLog() as phases:
            for r in range(args.repeats + 1):  # the first is a warm-up
                if r == 1:
                    _timings.clear()
                sid = new_operation_id("snap")
                path = f"{bucket}/{tag}/s{r % 2}" if bucket else str(work / f"s{r % 2}")
                t0 = time.perf_counter()
                begun = await coord.begin_snapshot(sid, path)
                t1 = time.perf_counter()
                await coord.start_writes(sid)  # as the driver does at the yield
                committed = await coord.commit_snapshot(sid, path, {"x": 0.0}, 0)
                t2 = time.perf_counter()
                lines = phases.of(sid)
                _record_call("begin_snapshot (pause, capture; writes started)", t1 - t0,
                             "begin_snapshot", lines)
                _record_call("commit_snapshot (finish persist, manifest, resume)", t2 - t1,
                             "finish_writes", lines)
                _record("  holders' persist_seconds (max)", _persist_seconds(committed))
                for what, value in (("SnapshotBegun", begun),
                                    ("SnapshotCommitted", committed)):
                    ta = time.perf_counter()
                    blob = cp.dumps(value)
                    tb = time.perf_counter()
                    cp.loads(blob)
                    tc = time.perf_counter()
                    _record(f"ray pickle {what} ({len(blob) / 1e6:.2f} MB)", tb - ta)
                    _record(f"ray unpickle {what} in the driver", tc - tb)
                if args.fresh_restore_holders and r > 0:  # as a restarted job restores
                    ckpt_r.shutdown()
                    cfg_r = cfg_r.model_copy(update={"namespace": f"breakdown-{tag}-r{r}"})
                    ckpt_r = RayEnvironmentCheckpoint(cfg_r)
                    await ckpt_r.ensure_holders()
                    coord_r = CheckpointCoordinator(cfg_r, RayTransport(cfg_r))
                rid = new_operation_id("restore")
                with _timed_store_calls() if bucket else contextlib.nullcontext():
                    before = _cpu_by_process()
                    t0 = time.perf_counter()
                    prepared = await coord_r.prepare_restore(rid, path)
                    t1 = time.perf_counter()
                    after = _cpu_by_process()
                    await coord_r.commit_restore(rid)
                    t2 = time.perf_counter()
                lines = phases.of(rid)
                _record_call("prepare_restore (manifest, verify and load shards)", t1 - t0,
                             "prepare_restore", lines)
                _record_cpu("prepare_restore", before, after, t1 - t0)
                _record_call("commit_restore (sessions live)", t2 - t1, "commit_restore",
                             lines)
                for key, seconds in _store_calls:  # the claim's release is the commit's
                    _record(key, seconds)
                _store_calls.clear()
                await coord_r.forget([EnvironmentEpisode(rid_, att).next_attempt()
                                      for _i, rid_, att in prepared.continued_attempts])
        logged = sorted({line["phase"] for line in phases.lines})
        if not bucket:  # the splits read the folder's files directly
            await _entry_split(cfg.namespace, instances, args.repeats, work)
            await _restore_split(cfg, work / f"s{args.repeats % 2}", args.repeats)
        print(f"median of {args.repeats} (ms), min-max; phases logged: {', '.join(logged)}")
        for key, vals in _timings.items():
            print(f"  {key:<62} {statistics.median(vals):9.1f}   "
                  f"({min(vals):.1f}-{max(vals):.1f})")
    finally:
        with contextlib.suppress(Exception):
            ckpt.shutdown()
        with contextlib.suppress(Exception):
            ckpt_r.shutdown()
        shutil.rmtree(work, ignore_errors=True)


async def _entry_split(namespace: str, instances: list[str], repeats: int,
                       work: Path) -> None:
    """The holders' side of the pause, called directly (no coordinator): one ``begin``
    round (pause and capture in one call each) against a pause round then a capture
    round; the writes start afterwards in both. Alternating, same holders, sessions."""


    handles = [ray.get_actor(HOLDER_NAME_PREFIX + i, namespace=namespace) for i in instances]
    for r in range(2 * repeats):
        directory = str(prepare_environment_dir(work / f"split-{r}"))
        sid = f"snap-split-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        if r % 2 == 0:
            await asyncio.gather(*(h.begin.remote(sid, 5.0, 120.0, directory)
                                   for h in handles))
            _record("direct: begin round (pause + capture, 1 call)", time.perf_counter() - t0)
        else:
            await asyncio.gather(*(h.pause.remote(sid, 5.0, 120.0) for h in handles))
            t1 = time.perf_counter()
            await asyncio.gather(*(h.capture.remote(sid) for h in handles))
            t2 = time.perf_counter()
            _record("direct: pause round, then capture round", t2 - t0)
            _record("  direct: pause round", t1 - t0)
            _record("  direct: capture round", t2 - t1)
        await asyncio.gather(*(h.start_writes.remote(sid, directory) for h in handles))
        await asyncio.gather(*(h.finish_writes.remote(sid) for h in handles))
        await asyncio.gather(*(h.resume.remote(sid) for h in handles))
        shutil.rmtree(work / f"split-{r}", ignore_errors=True)


async def _restore_split(cfg: Any, path: Path, repeats: int) -> None:
    """A restore's read against the disk: the holders' ``prepare_restore`` called
    directly (no coordinator), with the shards evicted from the page cache or warm, into
    fresh holders or ones that restored before; and the same shards read by one process
    each at once, bare or through ``read_shard``, without Ray."""


    manifest = read_manifest(path)
    directory = environment_dir(path)
    shards = [directory / s.file for s in manifest.shards]
    for r in range(repeats):
        ckpt = RayEnvironmentCheckpoint(
            cfg.model_copy(update={"namespace": f"{cfg.namespace}-split-{r}"}))
        try:
            handles = {i.instance_id: ray.get_actor(HOLDER_NAME_PREFIX + i.instance_id,
                                                    namespace=ckpt.config.namespace)
                       for i in await ckpt.ensure_holders()}
            for k, warm in enumerate((False, False, True)):
                if not warm:
                    evict_from_page_cache(shards)
                rid = new_operation_id("restore")
                t0 = time.perf_counter()
                await asyncio.gather(*(h.prepare_restore.remote(
                    rid, str(directory), [s for s in manifest.shards if s.instance_id == i],
                    120.0) for i, h in handles.items()))
                label = "fresh holders" if k == 0 else "same holders"
                _record(f"direct: holders' prepare_restore, {label}, "
                        f"{'warm' if warm else 'evicted'}", time.perf_counter() - t0)
                await asyncio.gather(*(h.abort.remote(rid) for h in handles.values()))
        finally:
            ckpt.shutdown()
        with concurrent.futures.ProcessPoolExecutor(len(shards)) as pool:
            list(pool.map(_read_in_process, [("nothing", "", None)] * len(shards)))
            for how in ("bare read", "read_shard"):
                evict_from_page_cache(shards)
                t0 = time.perf_counter()
                list(pool.map(_read_in_process, [(how, str(directory), e)
                                                 for e in manifest.shards]))
                _record(f"no Ray: one process per shard, {how}, evicted",
                        time.perf_counter() - t0)


def _read_in_process(job: tuple[str, str, Any]) -> None:
    how, directory, entry = job

    if how == "nothing":  # starts the pool's processes before the clock
        return
    if how == "bare read":
        with open(Path(directory) / entry.file, "rb") as f:
            f.read()
    else:
        read_shard(Path(directory), entry)


def _persist_seconds(committed: Any) -> float:
    """The slowest holder's persist, from whichever shape the commit's answer has."""
    metrics = getattr(committed, "metrics", None)
    if isinstance(metrics, dict) and "persist_seconds" in metrics:
        return float(metrics["persist_seconds"])
    manifest = getattr(committed, "manifest", None)
    if manifest is not None:
        return float(manifest.metrics["persist_seconds"])
    return float("nan")


def _shard_part(args: argparse.Namespace) -> None:
    """One holder's shard, written and read piece by piece, no Ray."""
    n, size = args.sessions, args.state_bytes
    blob = os.urandom(size + 4096)
    records = [SessionRecord("holder-0", EnvironmentEpisode(f"rollout-{k:06d}", 0), (),
                             blob[k % 4096:k % 4096 + size]) for k in range(n)]
    work = Path(tempfile.mkdtemp(prefix="nemo-ckpt-shard-"))
    rows: dict[str, list[float]] = {}

    def rec(key: str, t: float) -> None:
        rows.setdefault(key, []).append(t * 1e3)

    try:
        for r in range(args.repeats):
            t = time.perf_counter()
            entry = write_shard(work, f"shard-{r}.msgpack", "holder-0", records)
            rec("write_shard (total)", time.perf_counter() - t)
            t = time.perf_counter()
            data = _encode(records)
            rec("  encode every record: index rows, turns, bodies (+ join)",
                time.perf_counter() - t)
            t = time.perf_counter()
            content_hasher().update(data)
            rec(f"  {CONTENT_HASH} of the shard (the content hash)", time.perf_counter() - t)
            t = time.perf_counter()
            hashlib.sha256(data).hexdigest()
            rec("  sha256 of the shard (format 1's hash)", time.perf_counter() - t)
            t = time.perf_counter()
            with open(work / "raw", "wb", buffering=0) as f:
                f.write(data)
                os.fsync(f.fileno())
            rec("  one write + fsync", time.perf_counter() - t)
            t = time.perf_counter()
            loaded = read_shard(work, entry)
            rec("read_shard (total)", time.perf_counter() - t)
            del loaded
            t = time.perf_counter()
            raw = (work / entry.file).read_bytes()
            rec("  read (one read of the whole file)", time.perf_counter() - t)
            t = time.perf_counter()
            content_hasher().update(raw)
            rec(f"  {CONTENT_HASH} of what was read", time.perf_counter() - t)
            t = time.perf_counter()
            _decode(raw, "holder-0")
            rec("  decode header, index and bodies + a SessionRecord each",
                time.perf_counter() - t)
            del raw
            for p in work.iterdir():
                p.unlink()
        mb = entry.bytes / 1e6
        print(f"one shard: {n} sessions x {size} B = {mb:.1f} MB; median of {args.repeats} "
              f"(ms) and MB/s:")
        for key, vals in rows.items():
            med = statistics.median(vals)
            rate = "" if "[no MB/s]" in key else f"{mb / (med / 1e3):8.0f} MB/s"
            print(f"  {key.replace(' [no MB/s]', ''):<64} {med:9.1f}   {rate}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _encode(records: list[Any]) -> bytes:
    """A shard's index and bodies as ``write_shard`` encodes them (no header, no hash)."""
    rows: list[bytes] = []
    bodies: list[bytes] = []
    for record in records:
        row, turns_blob, state = record_parts(record)
        rows.append(row)
        bodies += (body_head(turns_blob, len(state)), state)
    return (msgpack.Packer().pack_array_header(len(rows)) + b"".join(rows)
            + b"".join(bodies))


def _decode(data: bytes, instance_id: str) -> list[Any]:
    """Decode a shard's bytes as ``read_shard`` does once their hash matched: the header,
    the index, each session's ``[turns, state]``, then a SessionRecord per session."""
    unpacker = view_unpacker(memoryview(data))
    unpacker.unpack()  # the header
    rows = unpacker.unpack()
    records = []
    for row in rows:
        unpacker.read_array_header()
        start = unpacker.tell()
        unpacker.skip()
        turns_blob = data[start:unpacker.tell()]
        records.append(record_of(instance_id, row, turns_blob, unpacker.unpack()))
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--holders", type=int, default=4)
    p.add_argument("--sessions", type=int, default=10_000,
                   help="total over the holders (with --shard-only: in the one shard)")
    p.add_argument("--state-bytes", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shard-only", action="store_true",
                   help="only the in-process shard write/read breakdown, no cluster")
    p.add_argument("--object-store-server", choices=("seaweedfs", "rclone"),
                   help="snapshot into a bucket of this local S3 server, not a folder")
    p.add_argument("--fresh-restore-holders", action="store_true",
                   help="restore into new holders each time, as a restarted job does "
                        "(else into the same ones, their sessions forgotten in between)")
    args = p.parse_args()
    if args.shard_only:
        _shard_part(args)
        return 0

    server: Any = None
    workdir = Path(tempfile.mkdtemp(prefix="nemo-ckpt-breakdown-s3-"))
    cluster: LocalCluster | None = None
    try:
        bucket = None
        if args.object_store_server:
            from tests.s3_server import BUCKET, SERVERS

            # Before the cluster: its workers find the server through the AWS_* environment.
            server = SERVERS[args.object_store_server](workdir / "s3")
            server.start()
            os.environ.update(server.env())
            bucket = f"s3://{BUCKET}/breakdown"
        cluster = LocalCluster(2048 * MiB)
        cluster.grow_to(args.holders)
        asyncio.run(_cluster_part(args, bucket))
    finally:
        if cluster is not None:
            cluster.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
