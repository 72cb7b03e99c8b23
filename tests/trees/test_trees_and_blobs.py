"""Sandbox trees and blobs without a holder: scanning, safety on restore, the blob store."""

from __future__ import annotations

import builtins
import os
import random
import shutil
import socket
import stat
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from nemo_ckpt.errors import BlobCorruptedError, CheckpointPathBusyError, SandboxError
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.claims import ClaimWatch
from nemo_ckpt.testing.toy_env import directory_listing
from nemo_ckpt.trees.blob_store import BlobStore, digest_of
from nemo_ckpt.trees.limits import MAX_DEPTH, SandboxLimits
from nemo_ckpt.trees.materialize import materialize
from nemo_ckpt.trees.node_cache import BlobCache
from nemo_ckpt.trees.scan import scan
from nemo_ckpt.trees.tree_codec import decode_tree, encode_tree
from nemo_ckpt.trees.tree_types import DIR, FILE, LINK, SPARSE, Entry, diff_trees


def _repo(root: Path) -> Path:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_text("print('hi')\n")
    (root / "README").write_text("readme\n")
    run = root / "run.sh"
    run.write_text("#!/bin/sh\necho run\n")
    run.chmod(0o755)
    (root / "empty").mkdir()
    (root / "link").symlink_to("src/pkg/mod.py")
    (root / "escape").symlink_to("/etc/passwd")
    return root


def test_a_scan_records_files_directories_links_and_modes(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    cache = BlobCache(tmp_path / "cache")
    result = scan(repo, None, cache.store)
    tree = result.tree()
    assert sorted(tree) == ["README", "empty", "escape", "link", "run.sh", "src", "src/pkg",
                            "src/pkg/mod.py"]
    assert tree["run.sh"].kind == FILE and tree["run.sh"].mode == 0o755
    assert tree["src"].kind == DIR
    assert tree["link"].kind == LINK and tree["link"].data == b"src/pkg/mod.py"
    assert tree["escape"].data == b"/etc/passwd"  # stored as a link, never followed
    assert cache.read(tree["README"].data) == b"readme\n"
    assert result.files_read == 3


def test_a_rescan_rereads_only_the_files_that_changed(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    cache = BlobCache(tmp_path / "cache")
    first = scan(repo, None, cache.store)
    # A scan well after the files' last change: none of them is racy any more.
    settled = scan(repo, first.listings, cache.store, now_ns=time.time_ns() + 10**9)
    assert settled.files_read == 3  # the first scan's files were all racy
    (repo / "README").write_text("edited\n")
    again = scan(repo, settled.listings, cache.store)
    assert again.files_read == 1 and again.bytes_read == len(b"edited\n")
    assert diff_trees(settled.tree(), again.tree()) == {"added": [], "removed": [],
                                                    "changed": ["README"]}
    assert cache.read(again.tree()["README"].data) == b"edited\n"


def test_a_file_rewritten_within_the_same_tick_is_still_seen(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    f = repo / "a"
    cache = BlobCache(tmp_path / "cache")
    f.write_bytes(b"one")
    first = scan(repo, None, cache.store)
    f.write_bytes(b"two")  # same size, likely the same mtime tick
    second = scan(repo, first.listings, cache.store)
    assert cache.read(second.tree()["a"].data) == b"two"


def _mutate(rng: random.Random, repo: Path) -> None:
    """One random change of the kinds a rollout makes."""
    files = sorted(p for p in repo.rglob("*") if p.is_file() and not p.is_symlink())
    dirs = [repo, *sorted(p for p in repo.rglob("*") if p.is_dir() and not p.is_symlink())]
    op = rng.choice(["create", "edit", "edit", "rename", "delete", "mkdir", "rmtree",
                     "chmod", "link", "swap"])
    where = rng.choice(dirs)
    if op == "create" or not files:
        (where / f"f{rng.randrange(10**6)}").write_bytes(rng.randbytes(rng.randrange(64)))
        return
    f = rng.choice(files)
    if op == "edit":  # often the same size
        f.write_bytes(rng.randbytes(f.stat().st_size or 1))
    elif op == "rename":
        f.rename(where / f"r{rng.randrange(10**6)}")
    elif op == "delete":
        f.unlink()
    elif op == "mkdir":
        (where / f"d{rng.randrange(10**6)}").mkdir()
    elif op == "rmtree" and where != repo:
        shutil.rmtree(where)
    elif op == "chmod":
        f.chmod(rng.choice([0o600, 0o644, 0o755]))
    elif op == "link":
        link = where / f"l{rng.randrange(10**6)}"
        link.symlink_to(rng.choice(["..", f.name, "/etc/passwd"]))
    elif op == "swap":  # a file becomes a directory of the same name
        f.unlink()
        f.mkdir()


@pytest.mark.parametrize("seed", range(4))
def test_an_incremental_scan_records_the_same_tree_as_a_fresh_one(
        tmp_path: Path, seed: int) -> None:
    repo = _repo(tmp_path / "repo")
    cache = BlobCache(tmp_path / "cache")
    rng = random.Random(seed)
    previous = scan(repo, None, cache.store)
    for _ in range(40):
        for _ in range(rng.randrange(1, 4)):
            _mutate(rng, repo)
        if rng.random() < 0.3:
            time.sleep(0.025)  # past the racy window: unchanged files are skipped
        incremental = scan(repo, previous.listings, cache.store)
        fresh = scan(repo, None, cache.store)
        assert incremental.tree() == fresh.tree()
        assert (incremental.root, incremental.root_size) == (fresh.root, fresh.root_size)
        assert incremental.blobs() == fresh.blobs()
        assert (incremental.file_count(), incremental.file_bytes()) == (
            fresh.file_count(), fresh.file_bytes())
        assert encode_tree(fresh.tree()).root == fresh.root
        previous = incremental


def test_a_rescan_of_an_unchanged_directory_reads_and_encodes_nothing(
        tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    cache = BlobCache(tmp_path / "cache")
    first = scan(repo, None, cache.store, now_ns=time.time_ns() + 10**9)
    (repo / "src" / "pkg" / "mod.py").write_text("changed\n")
    again = scan(repo, first.listings, cache.store, now_ns=time.time_ns() + 10**9)
    assert (again.files_read, len(again.objects)) == (1, 3)  # src/pkg, src and the top
    assert again.listings["empty"] is first.listings["empty"]
    still = scan(repo, again.listings, cache.store, now_ns=time.time_ns() + 10**9)
    assert (still.files_read, still.objects) == (0, {})


def test_a_directory_deeper_than_a_restore_allows_is_refused_at_the_scan(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    deep = repo.joinpath(*["d"] * (MAX_DEPTH + 1))
    deep.mkdir(parents=True)
    with pytest.raises(SandboxError, match=f"deeper than {MAX_DEPTH} directories"):
        scan(repo, None, BlobCache(tmp_path / "cache").store)


def test_the_cache_holds_small_blobs_in_memory_up_to_its_budget(tmp_path: Path) -> None:
    cache = BlobCache(tmp_path / "cache", memory_budget=100, memory_blob_max=50)
    small, large = b"s" * 40, b"l" * 60
    for data in (small, large, b"t" * 40, b"u" * 40):
        cache.put(digest_of(data), data)
    on_disk = sorted(p.name for p in (tmp_path / "cache").iterdir())
    # The first two small ones fit the budget; the large one and the third go to files.
    assert on_disk == sorted(digest_of(d).hex() for d in (large, b"u" * 40))
    assert cache.held(digest_of(small)) == small and cache.memory_bytes == 80
    assert all(cache.read(digest_of(d)) == d for d in (small, large, b"t" * 40, b"u" * 40))
    cache.remove([digest_of(small), digest_of(large)])
    assert cache.memory_bytes == 40 and not cache.has(digest_of(small))
    assert not cache.has(digest_of(large))


def test_a_fifo_or_socket_in_a_sandbox_is_refused_naming_its_path(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    os.mkfifo(repo / "pipe")
    cache = BlobCache(tmp_path / "cache")
    with pytest.raises(SandboxError, match=r"pipe, a FIFO"):
        scan(repo, None, cache.store)
    (repo / "pipe").unlink()
    short = Path("/tmp") / f"s{os.getpid()}"
    short.mkdir(exist_ok=True)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(short / "sock"))
        with pytest.raises(SandboxError, match=r"sock, a socket"):
            scan(short, None, cache.store)
    finally:
        sock.close()
        (short / "sock").unlink(missing_ok=True)
        short.rmdir()


def test_materialize_rebuilds_the_directory_byte_for_byte(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    (repo / "empty").chmod(0o500)  # a read-only directory is filled before its mode is set
    cache = BlobCache(tmp_path / "cache")
    tree = scan(repo, None, cache.store).tree()
    encoded = encode_tree(tree)
    decoded, objects = decode_tree(encoded.root, encoded.root_size,
                                   lambda d, n: encoded.objects[d], "test")
    assert decoded == tree and set(objects) == set(encoded.objects)
    assert len(encoded.objects) == 4  # one tree object per directory: ., src, src/pkg, empty
    written = materialize(decoded, tmp_path / "out", lambda d, n: cache.read(d, n))
    assert directory_listing(tmp_path / "out") == directory_listing(repo)
    assert written == sum(e.size for e in tree.values() if e.kind == FILE)
    (repo / "empty").chmod(0o700)
    (tmp_path / "out" / "empty").chmod(0o700)


def _objects(*rows_per_object: list[list[object]]) -> tuple[bytes, int, dict[bytes, bytes]]:
    """Tree objects from rows; the first is the top one."""
    objects = {}
    first = None
    for rows in rows_per_object:
        data = msgpack.packb(rows, use_bin_type=True)
        objects[digest_of(data)] = data
        first = first or (digest_of(data), len(data))
    assert first is not None
    return first[0], first[1], objects


@pytest.mark.parametrize("name", ["..", "/etc/passwd", "a/../../x", "a/b", ".", ""])
def test_a_stored_name_that_would_leave_its_directory_is_refused(name: str) -> None:
    root, size, objects = _objects([[name, FILE, 0o644, 1, b"\x00" * 16]])
    with pytest.raises(SandboxError, match="would leave its directory"):
        decode_tree(root, size, lambda d, n: objects[d], "r1")


def test_tree_objects_are_stored_deflated_and_undeflated_ones_still_read(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for i in range(33):
        (repo / f"mod{i:04d}.py").write_text(str(i))
    encoded = encode_tree(scan(repo, None, BlobCache(tmp_path / "cache").store).tree())
    top = encoded.objects[encoded.root]
    assert top[:1] == b"\x78" and len(zlib.decompress(top)) > 1.3 * len(top)
    decoded, _ = decode_tree(encoded.root, encoded.root_size,
                             lambda d, n: encoded.objects[d], "r0")
    assert sorted(decoded) == [f"mod{i:04d}.py" for i in range(33)]
    # A small one is kept as plain msgpack rows, as every one was before: both read.
    root, size, objects = _objects([["a", FILE, 0o644, 1, b"\x00" * 16]])
    tree, _ = decode_tree(root, size, lambda d, n: objects[d], "r1")
    assert tree == {"a": Entry(FILE, 0o644, 1, b"\x00" * 16)}


def test_a_tree_object_that_inflates_past_its_bound_is_refused() -> None:
    bomb = zlib.compress(msgpack.packb([["a" * (64 << 20), FILE, 0o644, 1, b"\x00" * 16]]), 9)
    objects = {digest_of(bomb): bomb}
    with pytest.raises(SandboxError, match="not one whole deflated object"):
        decode_tree(digest_of(bomb), len(bomb), lambda d, n: objects[d], "r1")


def test_a_stored_link_never_has_entries_below_it() -> None:
    # A link's entry names no tree object: "a" to /tmp cannot hold "a/evil".
    root, size, objects = _objects([["a", LINK, 0o777, 4, b"/tmp"],
                                    ["a/evil", FILE, 0o644, 1, b"\x00" * 16]])
    with pytest.raises(SandboxError, match="would leave its directory"):
        decode_tree(root, size, lambda d, n: objects[d], "r1")


def test_a_changed_file_costs_new_tree_objects_only_along_its_path(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    for i in range(20):
        (repo / f"dir{i}").mkdir()
        (repo / f"dir{i}" / "f").write_text(str(i))
    cache = BlobCache(tmp_path / "cache")
    before = encode_tree(scan(repo, None, cache.store).tree())
    (repo / "src" / "pkg" / "mod.py").write_text("changed\n")
    after = encode_tree(scan(repo, None, cache.store).tree())
    new = set(after.objects) - set(before.objects)
    assert len(after.objects) == 24 and len(new) == 3  # ., src and src/pkg


def test_the_blob_store_writes_only_what_it_lacks_and_refuses_a_damaged_blob(
        tmp_path: Path) -> None:
    cache = BlobCache(tmp_path / "cache", memory_budget=0)  # every blob in a file
    digest, _ = cache.store([b"con", b"tent"])
    store = BlobStore(str(tmp_path / "root" / "blobs"), folder_at)
    assert store.missing([digest]) == {digest}
    store.put(digest, cache.path(digest))
    assert store.missing([digest]) == set()
    assert store.digests() == {digest}
    held = b"held in memory"
    assert store.put(digest_of(held), held) == len(held)
    with pytest.raises(BlobCorruptedError, match="no longer matches its digest"):
        store.put(digest_of(b"other"), held)
    assert store.digests() == {digest, digest_of(held)}
    assert store.read(digest, 7) == b"content"
    blob = Path(store.describe(digest))
    blob.write_bytes(b"CONTENT")
    with pytest.raises(BlobCorruptedError, match="does not match its digest"):
        store.read(digest, 7)
    blob.unlink()
    with pytest.raises(BlobCorruptedError, match="missing from the blob store"):
        store.read(digest_of(b"content"))


def test_collection_and_snapshots_exclude_each_other(tmp_path: Path) -> None:
    store = BlobStore(str(tmp_path / "blobs"), folder_at)
    watch = ClaimWatch()
    store.claims.hold("snap-1", "job-a", ttl_s=60)
    with pytest.raises(CheckpointPathBusyError, match=r"in use by snapshot\(s\) \['snap-1'\]"):
        store.claims.begin_collection("gc", ttl_s=30, watch=watch)
    assert store.claims.live_collection(watch) is None  # the refused collection left no claim
    store.claims.release("snap-1")
    store.claims.begin_collection("gc", ttl_s=30, watch=watch)
    assert store.claims.live_collection(watch) is not None
    with pytest.raises(CheckpointPathBusyError, match="being collected"):
        store.claims.wait_for_collection(clock=lambda: 120.0, sleep=lambda s: None, deadline=100.0)
    store.claims.end_collection()
    store.claims.wait_for_collection(clock=lambda: 120.0)  # returns at once
    assert store.claims.live_collection(watch) is None


# --- a hostile sandbox: what its processes change while the scan reads it ---------------

def swap_before_open(monkeypatch: pytest.MonkeyPatch, name: str,
                      swap: Callable[[], None]) -> list[bool]:
    """Run ``swap`` once, when the scan first opens ``name``: after the listing and the
    stat that found it, before the open (the window a process inside the sandbox races)."""
    done: list[bool] = []

    def hooked(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if not done and isinstance(path, (str, Path)) and os.path.basename(path) == name:
                done.append(True)
                swap()
            return real(path, *args, **kwargs)
        return call

    for module, attr in ((os, "open"), (os, "scandir"), (builtins, "open")):
        monkeypatch.setattr(module, attr, hooked(getattr(module, attr)))
    return done


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "outside" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(b"the holder's secret")
    return secret


def test_a_file_swapped_for_a_symlink_after_the_listing_is_recorded_as_the_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path / "repo")
    secret = _secret(tmp_path)
    victim = repo / "src" / "pkg" / "mod.py"

    def swap() -> None:
        victim.unlink()
        victim.symlink_to(secret)

    cache = BlobCache(tmp_path / "cache")
    done = swap_before_open(monkeypatch, "mod.py", swap)
    tree = scan(repo, None, cache.store).tree()
    assert done
    assert tree["src/pkg/mod.py"] == Entry(LINK, 0o777, len(bytes(secret)), bytes(secret))
    assert cache.read(digest_of(secret.read_bytes())) is None  # never read


def test_a_directory_swapped_for_a_symlink_after_the_listing_is_never_walked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path / "repo")
    secret = _secret(tmp_path)

    def swap() -> None:
        shutil.rmtree(repo / "src")
        (repo / "src").symlink_to(secret.parent)

    cache = BlobCache(tmp_path / "cache")
    done = swap_before_open(monkeypatch, "src", swap)
    tree = scan(repo, None, cache.store).tree()
    assert done
    assert tree["src"].kind == LINK and not any(p.startswith("src/") for p in tree)
    assert cache.read(digest_of(secret.read_bytes())) is None


@pytest.mark.timeout(5)
def test_a_file_swapped_for_a_fifo_refuses_the_scan_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path / "repo")

    def swap() -> None:
        (repo / "README").unlink()
        os.mkfifo(repo / "README")  # no writer: a blocking open would wait for ever

    done = swap_before_open(monkeypatch, "README", swap)
    with pytest.raises(SandboxError, match=r"README, a FIFO that replaced a file"):
        scan(repo, None, BlobCache(tmp_path / "cache").store)
    assert done


def test_a_file_that_changes_while_it_is_read_is_read_again(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    log = repo / "log"
    log.write_bytes(b"first line\n")
    cache = BlobCache(tmp_path / "cache")
    reads: list[bytes] = []

    def store(chunks: Iterable[bytes]) -> tuple[bytes, int]:
        digest, length = cache.store(chunks)
        reads.append(digest)
        if len(reads) == 1:  # a process appends while the scan reads
            with open(log, "ab") as f:
                f.write(b"second line\n")
        return digest, length

    tree = scan(repo, None, store).tree()
    assert cache.read(tree["log"].data) == b"first line\nsecond line\n"
    assert len(reads) == 2


def test_a_file_that_keeps_changing_while_it_is_read_refuses_the_scan_naming_it(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    log = repo / "log"
    log.write_bytes(b"x")
    cache = BlobCache(tmp_path / "cache")

    def store(chunks: Iterable[bytes]) -> tuple[bytes, int]:
        result = cache.store(chunks)
        with open(log, "ab") as f:
            f.write(b"x")
        return result

    with pytest.raises(SandboxError, match=r"repo/log changed each of the 3 times"):
        scan(repo, None, store)


@pytest.mark.parametrize(("limits", "message"), [
    (SandboxLimits(file_bytes=100),
     r"big, 101 bytes to store, more than sandbox_max_file_bytes \(100\)"),
    (SandboxLimits(sandbox_bytes=150),
     r"more than sandbox_max_bytes \(150\) bytes of files \(.*repo/(a|big|c) passes it\)"),
    (SandboxLimits(files=5),
     r"more than sandbox_max_files \(5\) entries .*repo/d/\w is one too many"),
])
def test_each_sandbox_limit_refuses_the_scan_naming_the_limit_and_the_path(
        tmp_path: Path, limits: SandboxLimits, message: str) -> None:
    repo = tmp_path / "repo"
    (repo / "d").mkdir(parents=True)
    (repo / "big").write_bytes(b"b" * 101)
    (repo / "a").write_bytes(b"a" * 40)
    (repo / "c").write_bytes(b"c" * 40)
    for name in "xyz":
        (repo / "d" / name).write_bytes(b"")
    with pytest.raises(SandboxError, match=message):
        scan(repo, None, BlobCache(tmp_path / "cache").store, limits=limits)
    scan(repo, None, BlobCache(tmp_path / "cache2").store)  # the defaults fit


def sparse_file(path: Path, apparent: int, extents: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(apparent)
        for offset, data in extents.items():
            f.seek(offset)
            f.write(data)


def _data_of(path: Path) -> dict[int, bytes]:
    """A file's data extents, read without its holes."""
    out = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out[start] = os.pread(fd, end - start, start)
            pos = end
    finally:
        os.close(fd)
    return out


def same_content(a: Path, b: Path) -> bool:
    """Whether two files of the same size read the same, checked where either holds data
    (a hole reads as zeros), without reading their holes."""
    if a.stat().st_size != b.stat().st_size:
        return False
    for one, other in ((a, b), (b, a)):
        with open(other, "rb") as f:
            for offset, data in _data_of(one).items():
                f.seek(offset)
                if f.read(len(data)) != data:
                    return False
    return True


def test_a_sparse_file_is_stored_without_its_holes_and_restored_with_them(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    image = repo / "disk.img"
    sparse_file(image, 1 << 30, {0: b"boot" * 1024, 512 << 20: b"middle" * 1000,
                                  (1 << 30) - 4096: b"e" * 4096})
    cache = BlobCache(tmp_path / "cache")
    result = scan(repo, None, cache.store)
    entry = result.tree()["disk.img"]
    assert entry.kind == SPARSE and entry.size < 64 << 10  # the data, not the holes
    assert result.file_bytes() == result.bytes_read == entry.size  # what counts and is read
    blob = cache.read(entry.data, entry.size)
    assert blob is not None
    materialize(result.tree(), tmp_path / "out", lambda d, n: cache.read(d, n))
    out = tmp_path / "out" / "disk.img"
    assert out.stat().st_size == 1 << 30
    assert out.stat().st_blocks * 512 < 1 << 20  # the holes are holes again
    assert same_content(out, image)
    again = scan(tmp_path / "out", None, cache.store).tree()
    assert again["disk.img"] == entry  # the same layout, the same blob


def test_a_damaged_sparse_layout_is_refused_by_the_restore(tmp_path: Path) -> None:
    header = msgpack.packb([1, 100, [90, 20]])  # an extent past the apparent size
    blob = header + b"d" * 20
    tree = {"f": Entry(SPARSE, 0o644, len(blob), digest_of(blob))}
    with pytest.raises(SandboxError, match="has a malformed layout"):
        materialize(tree, tmp_path / "out", lambda d, n: blob)


@pytest.mark.parametrize("allow", [False, True])
def test_a_restore_drops_setuid_and_setgid_bits_unless_allowed(
        tmp_path: Path, allow: bool) -> None:
    content = b"#!/bin/sh\nid\n"
    tree = {"suid": Entry(FILE, 0o4755, len(content), digest_of(content)),
            "sgid": Entry(FILE, 0o2755, len(content), digest_of(content))}
    materialize(tree, tmp_path / "out", lambda d, n: content, allow_setid=allow)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    if allow:  # (setgid stays only for a group of ours, as chmod allows)
        assert modes["suid"] == 0o4755 and modes["sgid"] & ~0o2000 == 0o755
    else:
        assert modes == {"suid": 0o755, "sgid": 0o755}


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o000])
def test_a_restored_tree_has_its_modes_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    content = b"x"
    tree = {"a": Entry(DIR, 0o750, 0, b""), "a-b": Entry(FILE, 0o640, 1, digest_of(content)),
            "a/f": Entry(FILE, 0o664, 1, digest_of(content)),
            "a/g": Entry(FILE, 0o400, 1, digest_of(content)),
            "a/d": Entry(DIR, 0o777, 0, b""), "a/d/h": Entry(FILE, 0o755, 1, digest_of(content)),
            "a/l": Entry(LINK, 0o777, 0, b"d/h"), "z": Entry(FILE, 0o644, 1, digest_of(content))}
    old = os.umask(umask)
    try:
        materialize(tree, tmp_path / "out", lambda d, n: content)
    finally:
        os.umask(old)
    out = tmp_path / "out"
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.lstat().st_mode)
             for p in out.rglob("*") if not p.is_symlink()}
    assert modes == {"a": 0o750, "a-b": 0o640, "a/f": 0o664, "a/g": 0o400, "a/d": 0o777,
                     "a/d/h": 0o755, "z": 0o644}
    assert os.readlink(out / "a" / "l") == "d/h" and (out / "a" / "l").read_bytes() == b"x"


def test_an_entry_whose_directory_is_not_in_the_tree_is_refused(tmp_path: Path) -> None:
    tree = {"f": Entry(FILE, 0o644, 1, digest_of(b"x")),
            "f/g": Entry(FILE, 0o644, 1, digest_of(b"x"))}
    with pytest.raises(FileNotFoundError, match="its directory is not in the tree") as err:
        materialize(tree, tmp_path / "out", lambda d, n: b"x")
    assert err.value.filename == str(tmp_path / "out" / "f/g")


def test_directories_made_in_threads_come_back_in_order_and_the_first_error_ends_them() -> None:
    from actors.holder.sandbox_restores import in_threads

    ran: list[int] = []

    def make(i: int) -> int:
        time.sleep(0.001 * (i % 3))
        ran.append(i)
        return i * i

    assert in_threads([lambda i=i: make(i) for i in range(40)], 4) == [i * i for i in range(40)]
    assert sorted(ran) == list(range(40))

    def fail() -> int:
        raise SandboxError("cannot restore the directory of rollout 'r3'")

    ran.clear()
    calls = [lambda i=i: make(i) for i in range(3)] + [fail] + \
        [lambda i=i: make(i) for i in range(4, 400)]
    with pytest.raises(SandboxError, match="rollout 'r3'"):
        in_threads(calls, 2)
    assert len(ran) < 396, "the calls after the error did not all start"
