"""Which S3 client library nemo-ckpt writes through: obstore, s3fs (fsspec) and pyarrow.fs,
measured against one local SeaweedFS server (``tests.s3_server``) in one run.

For each library, with the same bytes (random, so nothing compresses):
- ``put 1x64MB`` and ``get 1x64MB``: one object, one call;
- ``put 4x16MB`` and ``get 4x16MB``: four objects at once, one thread each (as four
  holders write their shards);
- ``put 1KiB``: a small object's put latency (the manifest, a claim), the median of 20;
and whether it offers what the commit needs: an atomic single put, a conditional put,
a multipart upload that an exception aborts, ranged reads.

obstore is a dependency; the others are not. Install them beside it to run this:

    .venv/bin/pip install s3fs pyarrow
    .venv/bin/python -m benchmarks.object_store_libraries --repeats 5

or from a scratch virtualenv with the three (``pip install obstore s3fs pyarrow``), with
``.venv/bin`` on ``PATH`` for the server's binary.

A library that is not installed is reported as such and skipped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any


def _load_server_module() -> Any:
    # By its file: the server needs only the standard library (and obstore, which every
    # environment here has), not the package's Ray, so this runs from any virtualenv
    # that has the three libraries and the `weed` binary on PATH.
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tests" / "s3_server.py"
    spec = importlib.util.spec_from_file_location("s3_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_server = _load_server_module()
ACCESS_KEY, SECRET_KEY, BUCKET, S3Server = (_server.ACCESS_KEY, _server.SECRET_KEY,
                                            _server.BUCKET, _server.S3Server)

MB = 1e6
BIG = 64 << 20
PART = 16 << 20
SMALL = 1024


class Client:
    """A library's put and get of whole objects by key."""

    name = ""

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        raise NotImplementedError


class Obstore(Client):
    name = "obstore"

    def __init__(self, endpoint: str) -> None:
        import obstore
        from obstore.store import S3Store

        self.version = obstore.__version__
        self._obstore = obstore
        self._store = S3Store(BUCKET, endpoint=endpoint, access_key_id=ACCESS_KEY,
                              secret_access_key=SECRET_KEY, region="us-east-1",
                              virtual_hosted_style_request=False,
                              client_options={"allow_http": True})

    def put(self, key: str, data: bytes) -> None:
        self._obstore.put(self._store, key, data)

    def get(self, key: str) -> bytes:
        return bytes(self._obstore.get(self._store, key).bytes())


class S3fs(Client):
    name = "s3fs"

    def __init__(self, endpoint: str) -> None:
        import s3fs

        self.version = s3fs.__version__
        self._fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY,
                                     endpoint_url=endpoint,
                                     client_kwargs={"region_name": "us-east-1"})

    def put(self, key: str, data: bytes) -> None:
        self._fs.pipe_file(f"{BUCKET}/{key}", data)

    def get(self, key: str) -> bytes:
        return bytes(self._fs.cat_file(f"{BUCKET}/{key}"))


class Pyarrow(Client):
    name = "pyarrow.fs"

    def __init__(self, endpoint: str) -> None:
        import pyarrow
        from pyarrow import fs

        self.version = pyarrow.__version__
        host = endpoint.removeprefix("http://")
        self._fs = fs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                                   endpoint_override=host, scheme="http",
                                   region="us-east-1")

    def put(self, key: str, data: bytes) -> None:
        with self._fs.open_output_stream(f"{BUCKET}/{key}") as f:
            f.write(data)

    def get(self, key: str) -> bytes:
        with self._fs.open_input_stream(f"{BUCKET}/{key}") as f:
            return bytes(f.readall())


# What each offers the commit (from each library's documentation, at the versions run).
FEATURES = {
    "obstore": "atomic put; conditional put (mode='create' / 'update' with an etag); "
               "multipart writer aborted on an exception (open_writer); ranged and "
               "parallel ranged reads (get_range, get_ranges)",
    "s3fs": "atomic put (pipe_file); create-only put (pipe_file mode='create', "
            "If-None-Match); multipart through pipe_file's chunks or open('wb'); ranged "
            "reads (cat_file start/end); an asyncio library driven from threads here",
    "pyarrow.fs": "atomic put; no conditional put; multipart output stream; ranged reads "
                  "(open_input_file + read_at)",
}


def _timed(call: Callable[[], Any]) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def _all(pool: ThreadPoolExecutor, call: Callable[..., Any], *args: Any) -> None:
    list(pool.map(call, *args))


def measure(client: Client, repeats: int) -> dict[str, float]:
    big = os.urandom(BIG)
    parts = [os.urandom(PART) for _ in range(4)]
    small = os.urandom(SMALL)
    rows: dict[str, list[float]] = {k: [] for k in (
        "put 1x64MB", "get 1x64MB", "put 4x16MB", "get 4x16MB", "put 1KiB")}
    prefix = f"libs/{client.name}"
    client.put(f"{prefix}/warm", small)  # a connection, before the clock
    with ThreadPoolExecutor(4) as pool:
        for r in range(repeats):
            big_key, small_key = f"{prefix}/big{r}", f"{prefix}/small{r}"
            keys = [f"{prefix}/part{r}-{i}" for i in range(4)]
            rows["put 1x64MB"].append(BIG / MB / _timed(partial(client.put, big_key, big)))
            rows["get 1x64MB"].append(BIG / MB / _timed(partial(client.get, big_key)))
            rows["put 4x16MB"].append(4 * PART / MB / _timed(
                partial(_all, pool, client.put, keys, parts)))
            rows["get 4x16MB"].append(4 * PART / MB / _timed(
                partial(_all, pool, client.get, keys)))
            # Twenty in a row, the median: the server (SeaweedFS) answers the first
            # request after a big upload ~200 ms late, whichever library sends it.
            rows["put 1KiB"].append(statistics.median(
                _timed(partial(client.put, small_key, small)) * 1e3 for _ in range(20)))
    return {k: round(statistics.median(v), 1) for k, v in rows.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nemo-ckpt-libs-") as tmp:
        server = S3Server(Path(tmp))
        server.start()
        try:
            results = {}
            for make in (Obstore, S3fs, Pyarrow):
                try:
                    client = make(server.endpoint)
                except ImportError as exc:
                    print(f"{make.name}: not installed ({exc.name}); skipped")
                    continue
                print(f"{make.name} {client.version} ...", flush=True)
                results[f"{make.name} {client.version}"] = measure(
                    client, args.repeats)
        finally:
            server.stop()
    columns = ["put 1x64MB", "get 1x64MB", "put 4x16MB", "get 4x16MB", "put 1KiB"]
    print(f"\nmedians of {args.repeats}; MB/s, and ms for put 1KiB; SeaweedFS on 127.0.0.1, "
          f"{os.cpu_count()} CPUs")
    width = max(len(k) for k in results) if results else 10
    print(f"{'library':<{width}}  " + "  ".join(f"{c:>11}" for c in columns))
    for name, row in results.items():
        print(f"{name:<{width}}  " + "  ".join(f"{row[c]:>11}" for c in columns))
    print()
    for name, text in FEATURES.items():
        print(f"{name}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
