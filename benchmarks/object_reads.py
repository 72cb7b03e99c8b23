"""A shard's read from a bucket against a plain get, for each size and concurrency of the
ranged reads (``nemo_ckpt.storage.object_folder.RANGED_READS``), on both local S3
servers (``tests.s3_server``: SeaweedFS and rclone) in one run.

For each server and object size: obstore's plain ``get`` of the whole object (the
baseline), then ``ObjectFolder.read_chunks`` in 1 MiB chunks, as a restore reads a shard
(hashes not included), with each setting; medians of ``--repeats``, in alternating order
so the settings share the machine's load. Prints MB/s and each setting's ratio to the
plain get, and the current default's.

    python -m benchmarks.object_reads [--sizes 16,64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nemo_ckpt.storage.object_folder as object_folder
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.folder import Sink
from nemo_ckpt.storage.object_folder import ObjectFolder, RangedReads
from tests.s3_server import SERVERS

MiB = 1 << 20
CHUNK = MiB
SETTINGS = [RangedReads(size * MiB, concurrency, max(4, concurrency))
            for size in (2, 4, 8, 16) for concurrency in (1, 2, 4, 8)]


def timed(run: Callable[[], int]) -> float:
    start = time.perf_counter()
    n = run()
    return n / (time.perf_counter() - start) / 1e6


def measure(server_name: str, sizes: list[int], repeats: int
            ) -> dict[int, dict[str, list[float]]]:
    """MB/s per object size, per form (``get`` or a setting), one figure a repeat."""
    import obstore

    figures: dict[int, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-object-reads-") as tmp:
        server = SERVERS[server_name](Path(tmp))
        server.start()
        try:
            os.environ.update(server.env())
            folder = folder_at(server.url(f"reads-{server_name}"))
            assert isinstance(folder, ObjectFolder)
            for size_mb in sizes:
                name, length = f"shard-{size_mb}.msgpack", size_mb * MiB
                data = os.urandom(length)

                def fill(w: Sink, data: bytes = data) -> None:
                    w.write(data)

                folder.write_stream(name, fill)

                def get(name: str = name) -> int:
                    return len(obstore.get(folder.store, folder.key(name)).bytes())

                def chunks(setting: RangedReads, name: str = name,
                           length: int = length) -> int:
                    object_folder.RANGED_READS = setting
                    return sum(len(c) for c in folder.read_chunks(name, length, CHUNK))

                forms: dict[str, Callable[[], int]] = {"get": get}
                for s in SETTINGS:
                    forms[f"{s.size // MiB} MiB x {s.concurrency}"] = \
                        lambda s=s: chunks(s)  # type: ignore[misc]
                got: dict[str, list[float]] = {k: [] for k in forms}
                for r in range(repeats + 1):  # the first round warms up, not counted
                    order = list(forms) if r % 2 else list(reversed(forms))
                    for key in order:
                        mb_s = timed(forms[key])
                        if r:
                            got[key].append(mb_s)
                figures[size_mb] = got
        finally:
            object_folder.RANGED_READS = RangedReads()
            server.stop()
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,64", help="object sizes, MiB (a 4h x 1k x 64 KiB "
                                                     "shard is 16)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--servers", default="seaweedfs,rclone")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    default = RangedReads()
    mine = f"{default.size // MiB} MiB x {default.concurrency}"
    for server in args.servers.split(","):
        for size_mb, got in measure(server, sizes, args.repeats).items():
            base = statistics.median(got["get"])
            print(f"{server}, {size_mb} MiB: plain get {base:,.0f} MB/s; ranged reads, "
                  f"MB/s (ratio to the get), median of {args.repeats}:")
            rows = sorted(((statistics.median(v), k) for k, v in got.items() if k != "get"),
                          reverse=True)
            for mb_s, key in rows:
                mark = "  <- the default" if key == mine else ""
                print(f"  {key:>12}  {mb_s:7,.0f}  ({mb_s / base:.2f}){mark}")
    print(f"default: {dataclasses.asdict(default)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
