"""The object-store series of the snapshot benchmark (``python -m benchmarks.snapshot_bench
--object-store``): snapshots into an ``s3://`` bucket of a local S3-compatible server
(SeaweedFS, started for the run by ``tests.s3_server``), against the client
library's own put and get of the same bytes to the same server, and against a snapshot
into a local folder, in one run.

Per point (4 holders, one per simulated node; sessions of random bytes):

- ``persist``: the snapshot's bytes over its persist (the slowest holder's shard upload,
  the ``persist_seconds`` metric), against the library's own ``obstore.put`` of one object
  of each shard's size, all at once: from one plain actor per node (``node_put``: as
  many processes on the same nodes as there are holders; the targets use it) and from
  threads of this one process (``put``);
- ``exit``: the block ends -> ``snapshot()`` returns (shards, then the manifest object);
- ``restore``: the bytes over ``restored()`` entered -> exited into fresh holders
  (manifest, every shard read and verified, sessions installed), against ``obstore.get``
  of each shard object, all at once, the same two ways (``node_get``, ``get``), and
  from new actors (``fresh_node_get``: a restore reads into new processes). A baseline
  from actors is timed from this process, one Ray call included. ``restore_read`` is
  the bytes over the slowest holder's shard reads in the restore (fetched, verified,
  decoded: ``last_restore_metrics["read_seconds"]``);
- ``paused``: ``snapshot()`` called -> the last holder's turn gate seen open again
  (``GateProbe``), into the bucket and into a local folder, alternately per repetition.

The server, the holders and this process share the machine's cores: the baselines run
on the same machine in the same run, so the ratios compare like with like.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import obstore
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from benchmarks.common import (
    bench_config,
    format_table,
    median,
    probed_snapshot,
    restore_once,
    target,
)
from nemo_ckpt import RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.manifest import Manifest
from nemo_ckpt.storage.snapshot_files import read_manifest

# (sessions over 4 holders, state bytes per session)
POINTS = ((1_000, 64 * 1024), (4_000, 64 * 1024), (10_000, 1024))
QUICK_POINTS = ((1_000, 64 * 1024),)
OPEN_BATCH = 500
MB = 1e6


async def _populate(clients: Sequence[SessionClient], sessions: int, state_bytes: int) -> None:
    """Sessions of random bytes (a stored object that compresses would flatter the
    server), spread evenly over the holders, ``OPEN_BATCH`` per ``open_many``."""
    pool = os.urandom(state_bytes + 65536)
    per = -(-sessions // len(clients))
    ranges = [range(j * per, min(sessions, (j + 1) * per)) for j in range(len(clients))]
    for lo in range(0, per, OPEN_BATCH):
        await asyncio.gather(*(
            client.open_many(
                (EnvironmentEpisode(f"obj-{k:07d}", 0),
                 pool[(k * 4099) % 65536:(k * 4099) % 65536 + state_bytes])
                for k in own[lo:lo + OPEN_BATCH])
            for client, own in zip(clients, ranges, strict=True) if own[lo:lo + OPEN_BATCH]))


def _shard_sizes(url: str) -> dict[str, int]:
    manifest: Manifest = read_manifest(url)
    return {s.file: s.bytes for s in manifest.shards}


def bare_put(url: str, sizes: Sequence[int]) -> float:
    """Seconds for ``obstore.put`` of one object per size, all in parallel."""
    folder: Any = environment_folder(url)
    store = folder.store
    payloads = [os.urandom(n) for n in sizes]
    keys = [folder.key(f"bare-put-{uuid.uuid4().hex[:8]}-{i}") for i in range(len(sizes))]
    with ThreadPoolExecutor(len(sizes)) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda a: obstore.put(store, a[0], a[1]), zip(keys, payloads,
                                                                   strict=True)))
        elapsed = time.perf_counter() - t0
    obstore.delete(store, keys)
    return elapsed


def bare_get(url: str, names: Sequence[str]) -> float:
    """Seconds for ``obstore.get`` of each named object, whole, all in parallel."""
    folder: Any = environment_folder(url)
    store = folder.store
    with ThreadPoolExecutor(len(names)) as pool:
        t0 = time.perf_counter()
        got = list(pool.map(lambda n: obstore.get(store, folder.key(n)).bytes(), names))
        elapsed = time.perf_counter() - t0
    del got
    return elapsed


@ray.remote(num_cpus=0)
class BareClient:
    """The library alone on one node: a put and a get, nothing of nemo-ckpt around them
    but the folder's client (the same S3Store settings the holders use)."""

    def __init__(self) -> None:
        self._payload = b""

    def make(self, size: int) -> None:
        """The next put's payload, made outside the timed call (a capture's is ready)."""
        self._payload = os.urandom(size)

    def put(self, url: str, name: str) -> None:
        folder: Any = environment_folder(url)
        obstore.put(folder.store, folder.key(name), self._payload)
        self._payload = b""

    def get(self, url: str, name: str) -> int:
        folder: Any = environment_folder(url)
        return len(obstore.get(folder.store, folder.key(name)).bytes())

    def delete(self, url: str, names: list[str]) -> None:
        folder: Any = environment_folder(url)
        obstore.delete(folder.store, [folder.key(n) for n in names])


def _bare_clients(node_ids: Sequence[str]) -> list[Any]:
    return [BareClient.options(scheduling_strategy=NodeAffinitySchedulingStrategy(  # type: ignore[attr-defined]
        node_id=n, soft=False)).remote() for n in node_ids]


async def node_put(clients: Sequence[Any], url: str, sizes: Sequence[int]) -> float:
    """Seconds for one ``obstore.put`` per size, one per node's client, all at once. The
    payloads are made before the clock starts (each client puts what it just made)."""
    names = [f"node-put-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(sizes))]
    # An empty put first warms each client's connection, as the warm-up snapshot does.
    await asyncio.gather(*(c.put.remote(url, n) for c, n in zip(clients, names,
                                                                 strict=False)))
    await asyncio.gather(*(c.make.remote(s) for c, s in zip(clients, sizes, strict=True)))
    t0 = time.perf_counter()
    await asyncio.gather(*(c.put.remote(url, n) for c, n in zip(clients, names, strict=True)))
    elapsed = time.perf_counter() - t0
    await clients[0].delete.remote(url, names)
    return elapsed


async def node_get(clients: Sequence[Any], url: str, names: Sequence[str]) -> float:
    await asyncio.gather(*(c.get.remote(url, "manifest.json") for c in clients))  # warm
    t0 = time.perf_counter()
    await asyncio.gather(*(c.get.remote(url, n) for c, n in zip(clients, names, strict=True)))
    return time.perf_counter() - t0


async def fresh_node_get(node_ids: Sequence[str], url: str, names: Sequence[str]) -> float:
    """``node_get`` from new clients, one per node, as a restore reads into new holders:
    a process's first large reads fault in its heap's pages, which later reads reuse."""
    clients = _bare_clients(node_ids)
    try:
        return await node_get(clients, url, names)
    finally:
        for c in clients:
            ray.kill(c)


async def _bare_gets(clients: Sequence[Any], node_ids: Sequence[str], url: str,
                     names: Sequence[str]) -> dict[str, float]:
    return {"bare_get_ms": bare_get(url, names) * 1e3,
            "node_get_ms": await node_get(clients, url, names) * 1e3,
            "fresh_node_get_ms": await fresh_node_get(node_ids, url, names) * 1e3}


async def measure_point(sessions: int, state_bytes: int, repeats: int, bucket_root: str,
                        workdir: Path) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    ns = f"objbench-{tag}"
    config = bench_config(ns, 300.0)
    ckpt = RayEnvironmentCheckpoint(config)
    point_url = f"{bucket_root}/s{sessions}-b{state_bytes}-{tag}"
    local_dir = workdir / f"obj-local-{tag}"
    reps: list[dict[str, float]] = []
    bare: list[Any] = []
    try:
        infos = await ckpt.ensure_holders()
        clients = [await SessionClient.connect(instance_id=i.instance_id, namespace=ns)
                   for i in infos]
        node_ids = [i.node_id for i in infos]
        bare = _bare_clients(node_ids)
        await _populate(clients, sessions, state_bytes)
        # Unmeasured: one snapshot of each kind warms the clients, pools and paths.
        for warm in (f"{point_url}/warmup", local_dir / "warmup"):
            async with ckpt.snapshot(warm):  # type: ignore[arg-type]
                pass

        async def snapshot(where: Any) -> dict[str, float]:
            snap, times = await probed_snapshot(ckpt, clients, where)
            assert snap is not None and snap.captured_rollouts == sessions
            m = snap.metrics(times["entry_exit_ms"] / 1e3)
            return {"entry_ms": times["entry_ms"], "exit_ms": times["exit_ms"],
                    "paused_ms": times["paused_ms"], "persist_ms": m["persist_seconds"] * 1e3,
                    "bytes": m["bytes_written"]}

        for r in range(repeats):
            url = f"{point_url}/snap-{r}"
            order = ("s3", "local") if r % 2 == 0 else ("local", "s3")
            got: dict[str, dict[str, float]] = {}
            for kind in order:
                got[kind] = await snapshot(url if kind == "s3" else local_dir / f"snap-{r}")
            sizes = _shard_sizes(url)
            rep = {f"s3_{k}": v for k, v in got["s3"].items()}
            rep.update({f"local_{k}": v for k, v in got["local"].items()})
            rep["bare_put_ms"] = bare_put(url, list(sizes.values())) * 1e3
            rep["node_put_ms"] = await node_put(bare, url, list(sizes.values())) * 1e3
            # The bare get and the restore in alternating order: whichever reads first
            # may find the server's caches cold.
            if r % 2 == 1:
                rep.update(await _bare_gets(bare, node_ids, url, list(sizes)))
            for kind, where in (("s3", url), ("local", local_dir / f"snap-{r}")):
                rep.update({f"{kind}_{k}": v for k, v in (await restore_once(
                    config, f"{ns}-{kind}{r}", where, sessions, False)).items()})
            if r % 2 == 0:
                rep.update(await _bare_gets(bare, node_ids, url, list(sizes)))
            rep["shard_bytes"] = float(sum(sizes.values()))
            reps.append(rep)
            folder = environment_folder(url)
            folder.remove(folder.names())
    finally:
        for handle in bare:
            ray.kill(handle)
        with contextlib.suppress(Exception):
            ckpt.shutdown()
        shutil.rmtree(local_dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            folder = environment_folder(f"{point_url}/warmup")
            folder.remove(folder.names())
    return _record(sessions, state_bytes, reps)


def _record(sessions: int, state_bytes: int, reps: list[dict[str, float]]) -> dict[str, Any]:
    b = reps[0]["shard_bytes"]
    persist_mb_s = [r["s3_bytes"] / MB / (r["s3_persist_ms"] / 1e3) for r in reps]
    put_mb_s = [r["shard_bytes"] / MB / (r["bare_put_ms"] / 1e3) for r in reps]
    restore_mb_s = [r["shard_bytes"] / MB / (r["s3_restore_ms"] / 1e3) for r in reps]
    get_mb_s = [r["shard_bytes"] / MB / (r["bare_get_ms"] / 1e3) for r in reps]
    node_put_mb_s = [r["shard_bytes"] / MB / (r["node_put_ms"] / 1e3) for r in reps]
    node_get_mb_s = [r["shard_bytes"] / MB / (r["node_get_ms"] / 1e3) for r in reps]
    fresh_get_mb_s = [r["shard_bytes"] / MB / (r["fresh_node_get_ms"] / 1e3) for r in reps]
    read_mb_s = [r["shard_bytes"] / MB / (r["s3_restore_read_ms"] / 1e3) for r in reps]

    def ratio(a: Sequence[float], b: Sequence[float]) -> float:
        # Per repetition (the baseline ran beside it), then the median.
        return round(median([x / y for x, y in zip(a, b, strict=True)]), 3)

    out: dict[str, Any] = {
        "holders": 4, "sessions": sessions, "state_bytes": state_bytes, "bytes": int(b),
        "repeats": len(reps), "reps": reps,
        "persist_mb_s": round(median(persist_mb_s), 1),
        "bare_put_mb_s": round(median(put_mb_s), 1),
        "restore_mb_s": round(median(restore_mb_s), 1),
        "bare_get_mb_s": round(median(get_mb_s), 1),
        "node_put_mb_s": round(median(node_put_mb_s), 1),
        "node_get_mb_s": round(median(node_get_mb_s), 1),
        "fresh_node_get_mb_s": round(median(fresh_get_mb_s), 1),
        "persist_ratio_to_put": ratio(persist_mb_s, put_mb_s),
        "restore_ratio_to_get": ratio(restore_mb_s, get_mb_s),
        "persist_ratio_to_node_put": ratio(persist_mb_s, node_put_mb_s),
        "restore_ratio_to_node_get": ratio(restore_mb_s, node_get_mb_s),
        "restore_ratio_to_fresh_node_get": ratio(restore_mb_s, fresh_get_mb_s),
        "restore_read_mb_s": round(median(read_mb_s), 1),
        "restore_read_ratio_to_node_get": ratio(read_mb_s, node_get_mb_s),
        "restore_read_ratio_to_fresh_node_get": ratio(read_mb_s, fresh_get_mb_s),
    }
    for key in ("entry_ms", "exit_ms", "paused_ms", "persist_ms", "restore_ms",
                "restore_prepare_ms", "restore_read_ms"):
        for kind in ("s3", "local"):
            out[f"{kind}_{key}_median"] = round(median([r[f"{kind}_{key}"] for r in reps]), 1)
    out["paused_ratio_to_local"] = round(median(
        [r["s3_paused_ms"] / r["local_paused_ms"] for r in reps]), 3)
    return out


async def run_object_store(quick: bool, bucket_root: str, workdir: Path,
                           repeats: int, server: str = "SeaweedFS") -> dict[str, Any]:
    points = []
    for sessions, state_bytes in (QUICK_POINTS if quick else POINTS):
        print(f"object store: 4 holders x {sessions} sessions x {state_bytes} B into "
              f"{bucket_root} ...", flush=True)
        t = time.perf_counter()
        p = await measure_point(sessions, state_bytes, repeats, bucket_root, workdir)
        print(f"  done in {time.perf_counter() - t:.0f} s: persist {p['persist_mb_s']} MB/s "
              f"(node put {p['node_put_mb_s']}), restore {p['restore_mb_s']} MB/s (node get "
              f"{p['node_get_mb_s']}, fresh {p['fresh_node_get_mb_s']}; its shard reads "
              f"{p['restore_read_mb_s']}), paused "
              f"{p['s3_paused_ms_median']} ms (folder {p['local_paused_ms_median']})",
              flush=True)
        points.append(p)
    return {"points": points, "library": f"obstore {obstore.__version__}", "server": server}


# A pause into a bucket may not be longer than into a folder by more than this factor:
# the persist starts after the capture, so the pause should not see the medium at all.
PAUSE_SLACK = 1.25


def object_store_targets(series: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in series["points"]:
        point = (f"4h x {p['sessions']} x {p['state_bytes'] // 1024}KiB s3 "
                 f"({series.get('server', 'SeaweedFS')})")
        # The last: issue 26's, against a get into new processes, as a restore reads.
        for name in ("persist_ratio_to_node_put", "restore_ratio_to_node_get",
                     "restore_ratio_to_fresh_node_get"):
            out.append(target(name, point, p[name], p[name] >= 0.7, ">= 0.7"))
        out.append(target("paused_ratio_to_local (s3 / folder)", point,
                          p["paused_ratio_to_local"],
                          p["paused_ratio_to_local"] <= PAUSE_SLACK, f"<= {PAUSE_SLACK}"))
    return out


def format_object_store(series: dict[str, Any]) -> str:
    head = ["point", "MB", "persist", "node put", "put", "ratio", "restore", "node get",
            "get", "ratio", "paused s3", "folder", "ratio", "exit s3", "folder",
            "restore s3", "folder"]
    rows = [[f"4h x {p['sessions']} x {p['state_bytes'] // 1024}KiB",
             f"{p['bytes'] / MB:.0f}", str(p["persist_mb_s"]), str(p["node_put_mb_s"]),
             str(p["bare_put_mb_s"]), str(p["persist_ratio_to_node_put"]),
             str(p["restore_mb_s"]), str(p["node_get_mb_s"]), str(p["bare_get_mb_s"]),
             str(p["restore_ratio_to_node_get"]), str(p["s3_paused_ms_median"]),
             str(p["local_paused_ms_median"]), str(p["paused_ratio_to_local"]),
             str(p["s3_exit_ms_median"]), str(p["local_exit_ms_median"]),
             str(p["s3_restore_ms_median"]), str(p["local_restore_ms_median"])]
            for p in series["points"]]
    lines = [f"object store ({series['library']}, local {series.get('server', 'SeaweedFS')}; "
             f"medians; throughput in "
             f"MB/s, times in ms; ratios against the node baselines)"]
    lines += format_table(head, rows)
    return "\n".join(lines)
