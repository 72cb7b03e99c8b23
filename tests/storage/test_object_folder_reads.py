"""Reads from a bucket accept what S3 servers send, and refuse what no object could be.

The server here is an HTTP server of this test's own that answers GETs the ways real
ones differ (rclone's ``serve s3`` answers every ranged GET with a 200 and the range),
and the ways a broken one fails (a body that stops short of its length). The same reads
against real servers: tests/storage/test_object_folder.py."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.cli.main import main as cli_main
from nemo_ckpt.errors import CheckpointPathError, ShardCorruptedError
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.snapshot_files import read_snapshot
from tests.storage.test_object_folder import session, write_snapshot

pytestmark = pytest.mark.timeout(60)

BUCKET = "odd"
RECORDS = [session("holder-0", "r0", state=b"x" * 5000), session("holder-0", "r1")]


class OddServer(ThreadingHTTPServer):
    """Objects by key, shards served with the oddity ``mode`` names: ``range-as-200``
    (a ranged GET answered 200 with the range, as rclone does), ``ranges`` (answered
    206, as S3 does), ``short`` (a body that ends before its Content-Length),
    ``short-range`` (ranges answered 206, every one after the first ending short),
    ``long`` (more bytes than were written)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.objects: dict[str, bytes] = {}
        self.mode = "range-as-200"
        self.gets = 0
        self.ranges = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: OddServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _object(self) -> bytes | None:
        key = self.path.split("?", 1)[0].removeprefix(f"/{BUCKET}/")
        data = self.server.objects.get(key)
        if data is not None and "/shard-" in key and self.server.mode == "long":
            data += b"\0" * 100
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
        return data

    def _headers(self, data: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", '"e"')
        self.send_header("Last-Modified", "Thu, 03 Dec 2026 12:00:00 GMT")
        self.end_headers()

    def do_HEAD(self) -> None:
        data = self._object()
        if data is not None:
            self._headers(data)

    def do_GET(self) -> None:
        self.server.gets += 1
        data = self._object()
        if data is None:
            return
        ranged = self.headers.get("Range")
        status = 200
        if ranged and self.server.mode in ("range-as-200", "ranges", "short-range"):
            start, _, end = ranged.removeprefix("bytes=").partition("-")
            whole = len(data)
            data = data[int(start):int(end) + 1 if end else None]
            if self.server.mode != "range-as-200":
                status = 206
                self.server.ranges += 1
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        if status == 206:
            self.send_header("Content-Range",
                             f"bytes {start}-{int(start) + len(data) - 1}/{whole}")
        self.send_header("ETag", '"e"')
        self.send_header("Last-Modified", "Thu, 03 Dec 2026 12:00:00 GMT")
        self.end_headers()
        cut = self.server.mode == "short" or (
            self.server.mode == "short-range" and status == 206 and int(start) > 0)
        if cut and "/shard-" in self.path:
            self.wfile.write(data[:len(data) // 2])
            self.close_connection = True
        else:
            self.wfile.write(data)


@pytest.fixture
def odd_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[OddServer]:
    server = OddServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for k, v in {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "odd",
                 "AWS_SECRET_ACCESS_KEY": "odd-secret", "AWS_REGION": "us-east-1",
                 "AWS_ALLOW_HTTP": "true", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
                 "AWS_MAX_RETRIES": "0"}.items():
        monkeypatch.setenv(k, v)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def snapshot_on(server: OddServer, tmp_path: Path,
                records: list[SessionRecord] = RECORDS) -> str:
    """A snapshot written to a folder, its files then put on ``server``; its URL."""
    prefix = f"p{uuid.uuid4().hex[:6]}/ckpt"
    local = tmp_path / "ckpt"
    write_snapshot(str(local), {"holder-0": records})
    for f in (local / "environment").iterdir():
        server.objects[f"{prefix}/environment/{f.name}"] = f.read_bytes()
    return f"s3://{BUCKET}/{prefix}"


def test_a_server_that_answers_ranged_reads_with_200_restores_and_inspects(
        odd_server: OddServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = snapshot_on(odd_server, tmp_path)
    assert read_snapshot(url).sessions == {"holder-0": RECORDS}
    assert cli_main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert " r0 " in out and " r1 " in out


def test_a_head_read_takes_only_the_bytes_asked_for(
        odd_server: OddServer, tmp_path: Path) -> None:
    url = snapshot_on(odd_server, tmp_path)
    folder: Any = environment_folder(url)
    name = shard_file_name("snap-1", "holder-0")
    whole = folder.read(name)
    assert folder.read(name, 10) == whole[:10]
    assert len(whole) > 5000


def test_a_body_that_stops_short_is_an_error_naming_the_object(
        odd_server: OddServer, tmp_path: Path) -> None:
    url = snapshot_on(odd_server, tmp_path)
    folder: Any = environment_folder(url)
    shard = shard_file_name("snap-1", "holder-0")
    odd_server.mode = "short"
    with pytest.raises(CheckpointPathError) as caught:
        read_snapshot(url)
    message = str(caught.value)
    assert "\n" not in message
    assert folder.describe(shard) in message
    assert "broke off" in message


def test_a_body_longer_than_the_written_object_is_a_corrupted_shard(
        odd_server: OddServer, tmp_path: Path) -> None:
    url = snapshot_on(odd_server, tmp_path)
    folder: Any = environment_folder(url)
    shard = shard_file_name("snap-1", "holder-0")
    odd_server.mode = "long"
    with pytest.raises(ShardCorruptedError) as caught:
        read_snapshot(url)
    assert folder.describe(shard) in str(caught.value)


# A shard of several ranges: read with parallel ranged GETs where the server serves them.
BIG = [session("holder-0", f"b{i}", state=os.urandom(3 << 20)) for i in range(7)]


@pytest.mark.parametrize("mode", ["ranges", "range-as-200"])
def test_a_large_shard_reads_the_same_in_ranges_or_in_one_get(
        odd_server: OddServer, tmp_path: Path, mode: str) -> None:
    odd_server.mode = mode
    url = snapshot_on(odd_server, tmp_path, BIG)
    assert read_snapshot(url).sessions == {"holder-0": BIG}
    assert (odd_server.ranges >= 3) == (mode == "ranges")


def test_a_range_that_comes_back_short_is_an_error_naming_the_object(
        odd_server: OddServer, tmp_path: Path) -> None:
    url = snapshot_on(odd_server, tmp_path, BIG)
    odd_server.mode = "short-range"
    folder: Any = environment_folder(url)
    with pytest.raises(CheckpointPathError) as caught:
        read_snapshot(url)
    message = str(caught.value)
    assert "\n" not in message
    assert folder.describe(shard_file_name("snap-1", "holder-0")) in message
