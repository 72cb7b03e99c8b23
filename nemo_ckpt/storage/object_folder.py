"""A snapshot folder in an S3-compatible bucket (``s3://bucket/prefix``) or an Azure Blob
container (``az://container/prefix``), through obstore.

Why obstore (docs/DESIGN.md, "Object storage"): one Rust client with an atomic single
put, conditional puts, parallel multipart uploads, ranged and streamed reads, and the
fastest puts of the libraries measured here. The endpoint, region and credentials come
the standard way, from the store's environment variables (S3: ``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_ALLOW_HTTP`` for a plain-http endpoint, ...; Azure: ``AZURE_STORAGE_ACCOUNT_NAME``,
``AZURE_STORAGE_ACCOUNT_KEY``, ...) or the node's identity, on every node and on the
driver: nothing nemo-ckpt writes or logs ever holds them.

What a filesystem gets from temp file, fsync and rename, a bucket gets from the store:
an object appears whole when its (multipart) upload completes, or not at all; an upload
that fails or is interrupted is aborted, and a manifest's put replaces the older one
atomically. There are no temp names to clean up.
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from nemo_ckpt.errors import CheckpointPathError, SnapshotWriteError
from nemo_ckpt.storage.folder import ABSENT, Sink, unlistable
from nemo_ckpt.storage.location import ObjectLocation
from nemo_ckpt.storage.manifest import is_plain_file_name
from nemo_ckpt.storage.read_ahead import read_ahead
from nemo_ckpt.storage.store_errors import is_store_error, store_failure

if TYPE_CHECKING:  # obstore itself is imported only when a bucket is used
    from obstore.store import RetryConfig

__all__ = ["RANGED_READS", "SCHEMES", "ObjectFolder", "RangedReads"]

# Multipart part size and parallelism of a shard's upload: obstore uploads a part as
# soon as this much is buffered, up to _CONCURRENCY at once (benchmarks/README.md).
_PART_BYTES = 16 << 20
_CONCURRENCY = 8
_DELETE_BATCH = 1000  # S3's DeleteObjects limit
# The pieces a streamed read takes at a time (a shard's head, the rest of it unread).
_STREAM_CHUNK = 256 << 10


@dataclass(frozen=True)
class RangedReads:
    """A streamed read's ranged requests: ``size`` bytes each (whole chunks),
    ``concurrency`` at once, and ``ahead`` ranges fetched ahead of the consumer at most
    (its memory bound). Tuned against a plain get on both test servers
    (benchmarks/object_reads.py, which sweeps them through ``RANGED_READS``)."""

    size: int = 8 << 20
    concurrency: int = 4
    ahead: int = 4


RANGED_READS = RangedReads()


class _WriterSink:
    """A ``Sink`` onto an obstore writable file (it buffers and uploads parts)."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self.length = 0

    def write(self, data: bytes | bytearray | memoryview, copy: bool = False) -> None:
        self._writer.write(data)
        self.length += len(data)


class _StreamReader:
    """The body of one plain GET as the ``bytes``-returning file object msgpack reads:
    only what is read is fetched (a head of a shard, for ``inspect``)."""

    def __init__(self, chunks: Iterator[Any], describe: str) -> None:
        self._chunks = chunks
        self._describe = describe
        self._buffer = bytearray()
        self._done = False

    def read(self, size: int = -1) -> bytes:
        while not self._done and (size is None or size < 0 or len(self._buffer) < size):
            chunk = _next_chunk(self._chunks, self._describe)
            if chunk is None:
                self._done = True
            else:
                self._buffer += chunk
        end = len(self._buffer) if size is None or size < 0 else min(size, len(self._buffer))
        out = bytes(self._buffer[:end])
        del self._buffer[:end]
        return out


def _next_chunk(chunks: Iterator[Any], describe: str) -> Any:
    """The next piece of a body, or None at its end."""
    return _body(lambda: next(chunks, None), describe)


def _body(call: Callable[[], Any], describe: str) -> Any:
    """``call()``, which reads a body: one that breaks off is an ``OSError`` naming the
    object."""
    try:
        return call()
    except Exception as exc:
        if is_store_error(exc):
            raise OSError(f"the store's answer for {describe} broke off: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from exc
        raise


# Clients by bucket and the AWS_* environment they were made from: one per bucket, not
# one per folder or call. Making one loads the TLS roots and a connection pool, which
# costs milliseconds, and every snapshot is a new prefix; a changed environment makes anew.
_STORES: dict[tuple[tuple[str, tuple[tuple[str, str], ...]], bool], Any] = {}
_MAX_STORES = 64

# A probe's client gives up after a few quick retries: check_startup's probe must answer
# within the holder call's deadline, and the store's default (ten retries, backoff drawn
# at random up to 15 s each) can outlast it against a server that is down, which would
# report a slow holder instead of the server nobody reaches.
_PROBE_RETRIES: RetryConfig = {"max_retries": 2, "retry_timeout": timedelta(seconds=2),
                  "backoff": {"init_backoff": timedelta(milliseconds=50),
                              "max_backoff": timedelta(milliseconds=500), "base": 2}}


# Whether a bucket's server refuses a conditional write that no longer holds, by the
# same key as _STORES: probed once (``ObjectFolder.enforces_conditions``).
_CONDITIONAL: dict[tuple[str, tuple[tuple[str, str], ...]], bool] = {}
# obstore's errors for a conditional write refused (If-None-Match, If-Match).
_REFUSED = ("AlreadyExistsError", "PreconditionError")


# Whether a bucket's server answers a ranged GET with the range (206), by the same key as
# _STORES; rclone's ``serve s3`` answers 200 with the range, which obstore refuses, so its
# reads stream one plain GET instead.
_RANGES: dict[tuple[str, tuple[tuple[str, str], ...]], bool] = {}


# The stores by URL scheme, and the environment each one's client is made from.
_ENVIRONMENT = {"s3": ("AWS_",), "az": ("AZURE_", "AZURITE_")}
SCHEMES = tuple(_ENVIRONMENT)


def _store_key(location: ObjectLocation) -> tuple[str, tuple[tuple[str, str], ...]]:
    prefixes = _ENVIRONMENT[location.scheme]
    return (f"{location.scheme}://{location.bucket}",
            tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes))))


def _store(location: ObjectLocation, probe: bool = False) -> Any:
    from obstore.store import AzureStore, S3Store

    key = (_store_key(location), probe)
    store = _STORES.get(key)
    if store is None:
        if len(_STORES) >= _MAX_STORES:
            _STORES.pop(next(iter(_STORES)))
        make = S3Store if location.scheme == "s3" else AzureStore
        retries = _PROBE_RETRIES if probe else None
        store = _STORES[key] = make(location.bucket, retry_config=retries)
    return store


@dataclass(frozen=True)
class ObjectFolder:
    """A ``Folder`` under a prefix of a bucket. Equal folders have equal URLs."""

    location: ObjectLocation
    # A probe's folder: its client retries briefly (``_PROBE_RETRIES``).
    probe: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.location.scheme not in _ENVIRONMENT:
            raise CheckpointPathError(
                str(self.location),
                f"{self.location.scheme}:// is not a store nemo-ckpt reads or writes; use "
                f"s3:// (GCS too, through its S3 interoperability), az://, or a folder")

    def __str__(self) -> str:
        return str(self.location)

    @property
    def store(self) -> Any:
        """The bucket's obstore client (made from the environment on first use); it
        takes whole keys (``key``)."""
        return _store(self.location, self.probe)

    def key(self, name: str) -> str:
        """The whole key of file ``name`` of this folder in its bucket."""
        if not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not a plain file name")
        prefix = self.location.prefix
        return f"{prefix}/{name}" if prefix else name

    @property
    def _list_prefix(self) -> str | None:
        return self.location.prefix or None

    def describe(self, name: str = "") -> str:
        return f"{self.location}/{name}" if name else str(self.location)

    def problem(self) -> str | None:
        return None

    def prepare(self) -> None:
        """Nothing to create: a prefix exists once something is under it."""

    def _write_error(self, name: str, exc: Exception) -> SnapshotWriteError:
        failure = store_failure(self.location, exc)
        cause = (f"{type(exc).__name__}: {_first_line(exc)}"
                 if isinstance(failure, FileNotFoundError) else str(failure))
        return SnapshotWriteError(self.describe(name),
                                  f"could not write {self.describe(name)}: {cause}")

    def write_stream(self, name: str, fill: Callable[[Sink], None]) -> int:
        import obstore

        key = self.key(name)
        try:
            # Leaving the block with an exception aborts the upload: nothing appears.
            with obstore.open_writer(self.store, key, buffer_size=_PART_BYTES,
                                     max_concurrency=_CONCURRENCY) as writer:
                sink = _WriterSink(writer)
                fill(sink)
        except (SnapshotWriteError, ValueError):
            raise
        except Exception as exc:
            if is_store_error(exc):
                raise self._write_error(name, exc) from exc
            raise
        return sink.length

    def write_bytes(self, name: str, data: bytes, sync: bool = True,
                    expect: str | None = None) -> None:
        import obstore

        key = self.key(name)
        mode: Any = None
        if expect is not None:
            if self.enforces_conditions():
                mode = "create" if expect == ABSENT else {"e_tag": expect}
            elif self.version(name) != (expect or None):
                raise FileExistsError(f"{self.describe(name)} exists or changed")
        try:
            obstore.put(self.store, key, data, use_multipart=False, mode=mode)
        except Exception as exc:
            if type(exc).__name__ in _REFUSED:
                raise FileExistsError(f"{self.describe(name)} exists or changed") from exc
            if is_store_error(exc):
                raise self._write_error(name, exc) from exc
            raise

    def version(self, name: str) -> str | None:
        import obstore

        key = self.key(name)
        try:
            meta = _reading(self.location, lambda: obstore.head(self.store, key))
        except FileNotFoundError:
            return None
        return str(meta["e_tag"] or meta["last_modified"])

    def enforces_conditions(self) -> bool:
        """Probed once per bucket and process: a create of an object that exists must be
        refused. Servers that ignore ``If-None-Match`` (rclone's) write it twice."""
        key = _store_key(self.location)
        known = _CONDITIONAL.get(key)
        if known is None:
            if len(_CONDITIONAL) >= _MAX_STORES:
                _CONDITIONAL.pop(next(iter(_CONDITIONAL)))
            known = _CONDITIONAL[key] = self._probe_conditions()
        return known

    def _probe_conditions(self) -> bool:
        import obstore

        name = f".conditional-probe-{uuid.uuid4().hex}"
        key = self.key(name)
        try:
            obstore.put(self.store, key, b"1", use_multipart=False, mode="create")
            try:
                obstore.put(self.store, key, b"2", use_multipart=False, mode="create")
                return False
            except Exception as exc:
                if type(exc).__name__ in _REFUSED:
                    return True
                if type(exc).__name__ == "NotSupportedError":
                    return False
                raise
            finally:
                obstore.delete(self.store, key)
        except Exception as exc:
            if type(exc).__name__ == "NotSupportedError":
                return False
            if is_store_error(exc):
                raise self._write_error(name, exc) from exc
            raise

    def size(self, name: str) -> int:
        import obstore

        key = self.key(name)
        return int(_reading(self.location, lambda: obstore.head(self.store, key))["size"])

    def read(self, name: str, limit: int | None = None) -> bytes:
        return bytes(self.read_view(name, limit))

    def read_view(self, name: str, limit: int | None = None) -> memoryview:
        # Never a ranged GET: some servers (rclone's serve s3) answer a range with a 200
        # and obstore refuses that. A plain GET is read only as far as ``limit``.
        result = self._get(name)
        size = int(result.meta["size"])
        if limit is None or size <= limit:
            data = memoryview(_body(result.bytes, self.describe(name)))
        else:
            head = bytearray()
            chunks = iter(result.stream(min_chunk_size=min(limit, _STREAM_CHUNK)))
            while len(head) < limit and (chunk := _next_chunk(chunks, self.describe(name))):
                head += chunk
            data = memoryview(bytes(head[:limit]))
        expected = size if limit is None else min(size, limit)
        if len(data) != expected:
            raise OSError(f"the store sent {len(data)} bytes of {self.describe(name)} "
                          f"where it announced {expected}")
        return data

    def read_chunks(self, name: str, length: int, chunk: int) -> Iterator[memoryview]:
        key = _store_key(self.location)
        ranged = RANGED_READS
        per_range = max(chunk, ranged.size // chunk * chunk)
        if length <= per_range or _RANGES.get(key) is False:
            yield from self._streamed_chunks(name, length, chunk)
            return
        import obstore

        describe = self.describe(name)
        try:
            # The first range says the object's size (and whether ranges are served).
            first = _reading(self.location, lambda: obstore.get(
                self.store, self.key(name), options={"range": (0, per_range)}))
        except OSError as exc:
            if "non-partial" not in str(exc) and "NotPartial" not in repr(exc.__cause__):
                raise
            _RANGES[key] = False
            yield from self._streamed_chunks(name, length, chunk)
            return
        _RANGES[key] = True
        size = int(first.meta["size"])
        end = min(size, length)

        def fetch(at: int, stop: int, result: Any = None) -> memoryview:
            if result is None:
                data = _body(lambda: obstore.get_range(self.store, self.key(name),
                                                       start=at, end=stop), describe)
            else:
                data = _body(result.bytes, describe)
            piece = memoryview(data)
            if len(piece) != stop - at:
                raise OSError(f"the store sent {len(piece)} bytes of {describe} for the "
                              f"range {at}-{stop} of {size}")
            return piece

        spans = [(at, min(at + per_range, end)) for at in range(0, end, per_range)]
        first_span = spans[0] if spans else (0, 0)
        reads: list[Callable[[], memoryview]] = [
            functools.partial(fetch, *first_span, result=first)]
        reads += [functools.partial(fetch, at, stop) for at, stop in spans[1:]]
        for piece in read_ahead(reads, workers=ranged.concurrency, depth=ranged.ahead):
            for at in range(0, len(piece), chunk):
                yield piece[at:at + chunk]
        if size > length:  # a longer object shows as one byte more
            yield fetch(length, length + 1)

    def _streamed_chunks(self, name: str, length: int, chunk: int) -> Iterator[memoryview]:
        """``read_chunks`` through one plain GET, its body cut into chunks as it
        arrives, read ahead by one thread."""
        describe = self.describe(name)
        result = self._get(name)
        # Pieces of a range's size, as the ranged reads: whole chunks are views of them.
        least = max(chunk, RANGED_READS.size // chunk * chunk)
        body = iter(result.stream(min_chunk_size=least))
        wanted = min(length + 1, int(result.meta["size"]))
        received = [0]

        def next_piece() -> memoryview:
            piece = _next_chunk(body, describe)
            if piece is None:
                if received[0] < wanted:
                    raise OSError(f"the store sent {received[0]} bytes of {describe} "
                                  f"where it announced {wanted}")
                return memoryview(b"")
            received[0] += len(piece)
            return memoryview(piece)

        pieces = read_ahead((next_piece for _ in range(-(-wanted // least) + 1)),
                            workers=1, depth=RANGED_READS.ahead)
        # A chunk within one piece is a view of it; one that spans pieces is joined once
        # from what arrived, never a buffer of the manifest's claimed length made ahead.
        parts: list[memoryview] = []
        held = sent = 0
        for piece in pieces:
            if not piece:
                break
            at = 0
            while at < len(piece):
                if sent >= length:  # a longer object shows as one byte more
                    yield memoryview(bytes(piece[at:at + 1]))
                    return
                want = min(chunk, length - sent)
                take = min(want - held, len(piece) - at)
                parts.append(piece[at:at + take])
                held += take
                at += take
                if held == want:
                    yield parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
                    sent += want
                    parts, held = [], 0
        if parts:
            yield memoryview(b"".join(parts))  # it ended short: the caller says so

    @contextlib.contextmanager
    def open_read(self, name: str) -> Iterator[BinaryIO]:
        chunks = iter(self._get(name).stream(min_chunk_size=_STREAM_CHUNK))
        yield cast(BinaryIO, _StreamReader(chunks, self.describe(name)))

    def _get(self, name: str) -> Any:
        import obstore

        key = self.key(name)
        return _reading(self.location, lambda: obstore.get(self.store, key))

    def names(self) -> list[str]:

        # Only this folder's own files: no deeper "subfolders" (there are none), and not
        # the empty marker some servers (SeaweedFS) list under a prefix emptied of files.
        prefix = self.location.prefix
        listed = self._listing()
        return [str(m["path"]).rsplit("/", 1)[-1] for m in listed["objects"]
                if m["path"] != prefix]

    def subfolders(self) -> list[str]:
        listed = self._listing()
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed["common_prefixes"]]

    def _listing(self) -> Any:
        import obstore

        try:
            return _reading(self.location,
                            lambda: obstore.list_with_delimiter(self.store, self._list_prefix))
        except FileNotFoundError:
            return {"objects": [], "common_prefixes": []}
        except OSError as exc:
            raise unlistable(self.describe(), exc) from exc

    def remove(self, names: Iterable[str]) -> None:
        import obstore

        names = list(names)
        keys = [self.key(n) for n in names]
        for i in range(0, len(keys), _DELETE_BATCH):
            try:
                obstore.delete(self.store, keys[i:i + _DELETE_BATCH])
            except FileNotFoundError:
                pass
            except Exception as exc:
                if is_store_error(exc):
                    raise self._write_error(names[i], exc) from exc
                raise


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _reading(location: ObjectLocation, call: Callable[[], Any]) -> Any:
    """``call()``, with a store's failure as the ``OSError`` of one line
    ``store_failure`` makes (an object not found stays a ``FileNotFoundError``)."""
    try:
        return call()
    except Exception as exc:
        if is_store_error(exc):
            failure = store_failure(location, exc)
            if failure is exc:
                raise
            raise failure from exc
        raise
