"""Store writes that land and then fail (issue 34, cases 4 and 5): a bucket's server
executes a conditional put and answers 500, its client (obstore) retries, and the retry
meets the write its own first try made (412); or the write lands and then raises. Each
writer reads back what it wrote before it decides it lost a race, and a process that
gives up removes the claim it wrote. On SeaweedFS through a loopback proxy that answers
500 once after forwarding a conditional put (so obstore's real retry meets the real
412), and on a local folder in the same two forms."""

from __future__ import annotations

import asyncio
import http.client
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from actors.coordinator.folders import ClaimedFolders
from actors.coordinator.states import SnapshotBeginning, SnapshotOperation
from nemo_ckpt.catalog.listing import remove_snapshot
from nemo_ckpt.errors import CheckpointPathBusyError, SnapshotWriteError
from nemo_ckpt.storage.checkpoint_folder import environment_folder, folder_at
from nemo_ckpt.storage.claims import ClaimWatch, encode_claim
from nemo_ckpt.storage.cleanup import remove_snapshot_files
from nemo_ckpt.storage.commit_sequence import SEQUENCE_DIR, take_sequence
from nemo_ckpt.storage.folder import unlistable
from nemo_ckpt.storage.local_folder import LocalFolder
from nemo_ckpt.storage.location import join_location
from nemo_ckpt.storage.path_claims import claim_of, claim_path
from nemo_ckpt.transport import Runtime
from nemo_ckpt.trees.blob_store import BLOB_DIR, BlobStore, digest_of
from nemo_ckpt.trees.collection import collect_blobs
from tests.s3_server import LocalS3Server
from tests.storage.test_object_folder import session, write_snapshot

pytestmark = pytest.mark.timeout(120)


# --- a loopback proxy to the S3 server that loses the answer of one conditional put ----


class _LosingProxy:
    """Forwards every request to ``upstream``; the first PUT with ``If-None-Match`` (or
    ``If-Match``) whose key contains ``marker`` is forwarded, executed by the server, and
    then answered 500, as a server or a load balancer that failed after the write does."""

    def __init__(self, upstream: str, marker: str) -> None:
        self.upstream = urlsplit(upstream)
        self.marker = marker
        # The conditional puts of keys with ``marker``: (path, the status sent back).
        self.conditional_puts: list[tuple[str, int]] = []
        self.lost = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                upstream = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=30)
                try:
                    # The Host header as the client signed it: the signature stays valid.
                    upstream.putrequest(self.command, self.path, skip_host=True,
                                        skip_accept_encoding=True)
                    for key, value in self.headers.items():
                        upstream.putheader(key, value)
                    upstream.endheaders(body or None)
                    reply = upstream.getresponse()
                    data = reply.read()
                    status, headers = reply.status, reply.getheaders()
                finally:
                    upstream.close()
                conditional = self.command == "PUT" and (
                    "If-None-Match" in self.headers or "If-Match" in self.headers)
                if conditional and proxy.marker in self.path and status < 300 \
                        and not proxy.lost:
                    proxy.lost += 1
                    status, data = 500, (b"<Error><Code>InternalError</Code><Message>"
                                         b"the answer was lost (test proxy)</Message></Error>")
                    headers = [("Content-Type", "application/xml")]
                if conditional and proxy.marker in self.path:
                    proxy.conditional_puts.append((self.path, status))
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in ("content-length", "transfer-encoding",
                                           "connection", "server", "date"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def losing_bucket(s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch
                  ) -> Iterator[Callable[[str], tuple[_LosingProxy, str]]]:
    """``(marker) -> (proxy, a fresh prefix URL)``: the bucket reached through a proxy that
    loses the answer of the first conditional put of a key containing ``marker``."""
    proxies: list[_LosingProxy] = []

    def make(marker: str) -> tuple[_LosingProxy, str]:
        proxy = _LosingProxy(s3_server.endpoint, marker)
        proxy.start()
        proxies.append(proxy)
        for k, v in s3_server.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        return proxy, s3_server.url(f"landed/{uuid.uuid4().hex[:8]}")

    yield make
    for proxy in proxies:
        proxy.stop()


def test_on_a_bucket_a_path_claim_whose_create_landed_but_answered_500_is_this_jobs(
        losing_bucket: Callable[[str], tuple[_LosingProxy, str]]) -> None:
    """Case 4: the retry's 412 was read as another writer's claim, naming a job that
    does not exist, and refused the snapshot as not retriable."""
    proxy, url = losing_bucket(".claim-snap-1")
    folder = environment_folder(f"{url}/ckpt")
    folder.prepare()
    claim_path(folder, "snap-1", "job@a", ClaimWatch(), 60.0, beat="beat-1")
    # obstore retried the create the proxy answered 500, and the server refused it.
    key = proxy.conditional_puts[0][0]
    assert proxy.conditional_puts[:2] == [(key, 500), (key, 412)]
    claim = claim_of(folder, "snap-1")
    assert claim is not None and (claim.owner, claim.beat) == ("job@a", "beat-1")
    # And it renews as this job's (an If-Match put).
    claim_path(folder, "snap-1", "job@a", ClaimWatch(), 60.0, beat="beat-2",
               renewing={"beat-1"})
    claim = claim_of(folder, "snap-1")
    assert claim is not None and claim.beat == "beat-2"


def test_on_a_bucket_a_claim_renewal_that_landed_but_answered_500_renews(
        losing_bucket: Callable[[str], tuple[_LosingProxy, str]]) -> None:
    """The renewal's If-Match retry met its own write: it was taken for a successor's
    fence (OperationAbortedError)."""
    proxy, url = losing_bucket(".claim-snap-1")
    folder = environment_folder(f"{url}/ckpt")
    folder.prepare()
    data, _ = encode_claim("snap-1", "job@a", 60.0, beat="beat-1")
    folder.write_bytes(".claim-snap-1.json", data, sync=False)  # created unconditionally
    claim_path(folder, "snap-1", "job@a", ClaimWatch(), 60.0, beat="beat-2",
               renewing={"beat-1"})
    assert [status for _, status in proxy.conditional_puts][:2] == [500, 412]
    claim = claim_of(folder, "snap-1")
    assert claim is not None and claim.beat == "beat-2"


def test_on_a_bucket_gc_whose_claim_landed_but_answered_500_collects_and_leaves_no_claim(
        losing_bucket: Callable[[str], tuple[_LosingProxy, str]]) -> None:
    """Case 5: the gc was refused by its own claim, left it behind, and the next gc
    was refused naming a collector that was not running."""
    proxy, url = losing_bucket(".claim-collector")
    root = f"{url}/root"
    store = BlobStore(join_location(root, BLOB_DIR), folder_at)
    garbage = b"no snapshot references this"
    store.put(digest_of(garbage), garbage)
    report = collect_blobs(root, "gc-1")
    assert [status for _, status in proxy.conditional_puts][:2] == [500, 412]
    assert report.removed == 1
    assert not [n for n in folder_at(join_location(root, BLOB_DIR)).names()
                if n.startswith(".claim-")]
    assert collect_blobs(root, "gc-2").removed == 0  # not refused


# --- the same on a local folder ---------------------------------------------------------


def _landing(monkeypatch: pytest.MonkeyPatch, marker: str, form: str) -> list[str]:
    """Make the first conditional write (``form`` "conflict") or the first write
    ("error") of a name containing ``marker`` land and then raise: ``FileExistsError``,
    as a bucket's retry meets it, or a write error. Returns the names it hit."""
    real = LocalFolder.write_bytes
    hit: list[str] = []

    def landing(self: LocalFolder, name: str, data: bytes, sync: bool = True,
                expect: str | None = None) -> None:
        real(self, name, data, sync, expect)
        if marker in name and not hit and (form == "error" or expect is not None):
            hit.append(name)
            if form == "conflict":
                raise FileExistsError(f"{self.describe(name)} exists (the retry met it)")
            raise SnapshotWriteError(self.path / name, "EIO after the rename (injected)")

    monkeypatch.setattr(LocalFolder, "write_bytes", landing)
    return hit


def test_a_path_claim_whose_create_landed_and_met_itself_is_this_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = environment_folder(str(tmp_path / "ckpt"))
    folder.prepare()
    hit = _landing(monkeypatch, ".claim-snap-1", "conflict")
    claim_path(folder, "snap-1", "job@a", ClaimWatch(), 60.0, beat="beat-1")
    claim = claim_of(folder, "snap-1")
    assert hit and claim is not None and (claim.owner, claim.beat) == ("job@a", "beat-1")


def test_a_path_claim_whose_create_landed_then_failed_is_removed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Left, it refused every other job's snapshot into the path (a claim seen for the
    first time is live) though no operation ran under it."""
    folder = environment_folder(str(tmp_path / "ckpt"))
    folder.prepare()
    _landing(monkeypatch, ".claim-snap-1", "error")
    with pytest.raises(SnapshotWriteError, match="EIO after the rename"):
        claim_path(folder, "snap-1", "job@a", ClaimWatch(), 60.0)
    assert claim_of(folder, "snap-1") is None
    claim_path(folder, "snap-2", "job@b", ClaimWatch(), 60.0)  # not refused


def test_gc_whose_claim_landed_and_met_itself_collects_and_leaves_no_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = BlobStore(str(tmp_path / BLOB_DIR), folder_at)
    garbage = b"no snapshot references this"
    store.put(digest_of(garbage), garbage)
    hit = _landing(monkeypatch, ".claim-collector", "conflict")
    assert collect_blobs(tmp_path, "gc-1").removed == 1
    assert hit
    assert not [p.name for p in (tmp_path / BLOB_DIR).iterdir() if p.name.startswith(".claim")]
    assert collect_blobs(tmp_path, "gc-2").removed == 0  # not refused


def test_a_collection_whose_renewal_landed_then_failed_leaves_no_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The renewal's bytes were not yet taken for the collection's own, so its end left
    them: every snapshot's persist then waited on a collection no one ran."""
    store = BlobStore(str(tmp_path / BLOB_DIR), folder_at)
    store.claims.begin_collection("gc-1", 30.0, ClaimWatch())
    _landing(monkeypatch, ".claim-collector", "error")
    with pytest.raises(SnapshotWriteError, match="EIO after the rename"):
        store.claims.renew_collection("gc-1", 30.0)
    store.claims.end_collection()
    assert not [p.name for p in (tmp_path / BLOB_DIR).iterdir() if p.name.startswith(".claim")]


def test_a_removal_whose_claim_landed_then_failed_leaves_no_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``nemo-ckpt rm`` gave up and left its removal claim: the job's next snapshot into
    that path was refused as "being removed"."""
    path = str(tmp_path / "ckpt")
    write_snapshot(path, {"holder-0": [session("holder-0", "r1")]})
    _landing(monkeypatch, ".claim-remove-", "error")
    with pytest.raises(SnapshotWriteError, match="EIO after the rename"):
        remove_snapshot(path, collect=False)
    folder = environment_folder(path)
    assert not [n for n in folder.names() if n.startswith(".claim-")]
    assert "manifest.json" in folder.names()  # nothing was removed
    claim_path(folder, "snap-2", "job@a", ClaimWatch(), 60.0)  # not refused


def test_an_aborted_snapshot_whose_files_could_not_be_removed_still_drops_its_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = environment_folder(str(tmp_path / "ckpt"))
    folder.prepare()
    claim_path(folder, "snap-1", "job@a", ClaimWatch(), 60.0)

    def eio(self: LocalFolder, names: Any) -> None:
        raise SnapshotWriteError(self.path, "could not remove (injected)")

    real_remove = LocalFolder.remove
    monkeypatch.setattr(LocalFolder, "remove", lambda self, names: (
        real_remove(self, names) if any(n.startswith(".claim-") for n in names)
        else eio(self, names)))
    with pytest.raises(SnapshotWriteError, match="could not remove"):
        remove_snapshot_files(folder, "snap-1")
    assert claim_of(folder, "snap-1") is None


def test_a_commit_number_whose_create_landed_and_met_itself_is_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It took the next number instead, leaving a gap in the root's sequence."""
    _landing(monkeypatch, "", "conflict")
    assert take_sequence(str(tmp_path)) == 1
    assert sorted(p.name for p in (tmp_path / SEQUENCE_DIR).iterdir()) == ["1"]


def test_a_claim_whose_create_met_a_conflict_it_could_not_read_back_fails_and_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write landed, its retry met it, and both reads back failed: whose claim it is
    is unknown, so the snapshot fails as a write that failed (retriable), not as busy
    "by another writer" (a job that does not exist), and the claim, ours, is gone."""
    folder = environment_folder(str(tmp_path / "ckpt"))
    folder.prepare()
    _landing(monkeypatch, ".claim-snap-1", "conflict")
    real_read = LocalFolder.read
    reads: list[str] = []

    def failing_read(self: LocalFolder, name: str, *args: Any) -> bytes:
        if name.startswith(".claim-snap-1") and len(reads) < 2:
            reads.append(name)
            raise OSError(5, "Input/output error (injected)")
        return real_read(self, name, *args)

    monkeypatch.setattr(LocalFolder, "read", failing_read)
    with pytest.raises(SnapshotWriteError, match="met a conflict .* reading it back failed"):
        claim_path(folder, "snap-1", "job@a", ClaimWatch(), 60.0)
    assert len(reads) == 2  # read back twice
    assert claim_of(folder, "snap-1") is None
    claim_path(folder, "snap-2", "job@b", ClaimWatch(), 60.0)  # not refused


def test_a_claim_whose_read_back_fails_once_is_this_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = environment_folder(str(tmp_path / "ckpt"))
    folder.prepare()
    _landing(monkeypatch, ".claim-snap-1", "conflict")
    real_read = LocalFolder.read
    reads: list[str] = []

    def failing_read(self: LocalFolder, name: str, *args: Any) -> bytes:
        if name.startswith(".claim-snap-1") and not reads:
            reads.append(name)
            raise OSError(5, "Input/output error (injected)")
        return real_read(self, name, *args)

    monkeypatch.setattr(LocalFolder, "read", failing_read)
    claim_path(folder, "snap-1", "job@a", ClaimWatch(), 60.0, beat="beat-1")
    claim = claim_of(folder, "snap-1")
    assert reads and claim is not None and (claim.owner, claim.beat) == ("job@a", "beat-1")


def test_a_claim_whose_create_met_another_writers_claim_is_refused_as_busy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read back is what stops a writer taking another's claim for its own."""
    folder = environment_folder(str(tmp_path / "ckpt"))
    folder.prepare()
    other, _ = encode_claim("snap-1", "job@b", 60.0)
    real = LocalFolder.write_bytes

    def raced(self: LocalFolder, name: str, data: bytes, sync: bool = True,
              expect: str | None = None) -> None:
        if name.startswith(".claim-snap-1"):
            real(self, name, other, sync)  # another writer's, just before ours
        real(self, name, data, sync, expect)

    monkeypatch.setattr(LocalFolder, "write_bytes", raced)
    with pytest.raises(CheckpointPathBusyError, match="by another writer at the same moment"):
        claim_path(folder, "snap-1", "job@a", ClaimWatch(), 60.0)
    claim = claim_of(folder, "snap-1")
    assert claim is not None and claim.owner == "job@b"


async def test_a_renewal_still_under_way_when_the_commit_rewrites_the_claim_fences_neither(
        tmp_path: Path) -> None:
    """A slow renewal of a snapshot's claim, and the commit writing that claim again
    (it looked stale): run at once, the commit's write landed first, and the renewal
    then found a beat it did not know and took it for a successor's fence. A snapshot's
    claim writes go one at a time, so both renew."""
    path = str(tmp_path / "ckpt")
    folder = environment_folder(path)
    folder.prepare()
    delays = iter([0.0, 0.3])  # the first claim; the renewal's write slow, the commit's not

    async def run_blocking(fn: Callable[..., Any], *args: Any) -> Any:
        await asyncio.sleep(next(delays, 0.0))
        return await asyncio.to_thread(fn, *args)

    folders = ClaimedFolders(Runtime(run_blocking=run_blocking), "job@a", "inc-1",
                             ClaimWatch(), lambda: 60.0)
    op = SnapshotOperation("snap-1", path, 0.0, 10.0, SnapshotBeginning())
    await folders.claim(op)
    renewal = asyncio.ensure_future(folders.claim(op))
    await asyncio.sleep(0.05)  # the renewal is under way
    await folders.claim(op)  # the commit's
    await renewal
    claim = claim_of(folder, "snap-1")
    assert claim is not None and claim.owner == "job@a"
    assert claim.beat in op.claim_beats and len(op.claim_beats) == 3


async def test_a_commits_clean_up_that_cannot_read_the_claims_still_drops_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The clean-up read the folder's claims first and gave up on a read error before
    it removed the committed snapshot's claim: left behind, it refused the next gc and
    held the path for nothing (simulation seed 219)."""
    path = str(tmp_path / "ckpt")
    folder = environment_folder(path)
    folder.prepare()
    folders = ClaimedFolders(Runtime(), "job@a", "inc-1", ClaimWatch(), lambda: 60.0)
    op = SnapshotOperation("snap-1", path, 0.0, 10.0, SnapshotBeginning())
    await folders.claim(op)
    assert claim_of(folder, "snap-1") is not None

    def eio(self: LocalFolder) -> list[str]:
        raise unlistable(self.describe(), OSError(5, "Input/output error (injected)"))

    monkeypatch.setattr(LocalFolder, "names", eio)
    assert await folders.clean_up(op, {"snap-1"}) == []
    monkeypatch.undo()
    assert claim_of(folder, "snap-1") is None
