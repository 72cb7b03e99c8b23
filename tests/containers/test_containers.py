"""A session's container, recorded and created again, on this machine's podman (installed
by ``tests/container_runtime.py``; not mocked): its files, links, deletions and FIFOs
against its image, its processes' memory through CRIU, and what a container or a stored
record may hold that must not come back."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.containers.archive import INIT_MOUNT, check_archive
from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.containers.sandbox import ContainerSandboxes, RecordedContainer
from nemo_ckpt.errors import ContainerRuntimeError
from nemo_ckpt.trees.blob_store import digest_of
from nemo_ckpt.trees.container_record import ContainerRecord, decode_record, encode_record
from nemo_ckpt.trees.node_cache import BlobCache
from tests.container_runtime import INIT_PATH, Setup, ensure

pytestmark = pytest.mark.timeout(180)

# A server holding a counter in its shell's memory only: each request through the FIFO
# /tmp/req is answered with the next count on /tmp/rep (``ask``). Shared by the container
# tests, as are ``ask``, ``containers_named`` and ``assert_nothing_mounted_or_networked``.
SERVER = ("mkfifo /tmp/req /tmp/rep; n=0; "
           "while true; do read cmd < /tmp/req; n=$((n+1)); echo $n > /tmp/rep; done")


@pytest.fixture(scope="module")
def runtime() -> Iterator[Setup]:
    setup = ensure()
    yield setup
    podman = Podman(env=setup.env)
    left = containers_named(podman, "nemo-ckpt-test-")
    assert left == [], f"containers left behind: {left}"
    assert_nothing_mounted_or_networked(podman)


def containers_named(podman: Podman, prefix: str) -> list[str]:
    """The names of the containers whose name starts with ``prefix``, sorted."""
    return sorted(podman.text("ps", "-a", "--filter", f"name=^{prefix}", "--format",
                              "{{.Names}}").split())


def assert_nothing_mounted_or_networked(podman: Podman) -> None:
    """No container or image of podman's stays mounted, and no network but podman's
    default exists: the tests' teardown leaves nothing behind."""
    assert podman.text("mount") == "", "a container is still mounted"
    assert podman.text("image", "mount") == "", "an image is still mounted"
    networks = podman.text("network", "ls", "--format", "{{.Name}}").split()
    assert networks == ["podman"], f"networks left: {networks}"


@pytest.fixture
def podman(runtime: Setup) -> Podman:
    return Podman(env=runtime.env)


@pytest.fixture
def names(podman: Podman) -> Iterator[list[str]]:
    """Container names for one test; each is removed after it, by name."""
    made: list[str] = []
    yield made
    for name in made:
        podman.remove(name)


def _name(names: list[str]) -> str:
    name = f"nemo-ckpt-test-{uuid.uuid4().hex[:10]}"
    names.append(name)
    return name


def _sandboxes(podman: Podman, tmp_path: Path, memory: bool = True) -> ContainerSandboxes:
    return ContainerSandboxes(podman, BlobCache(tmp_path / "cache"), tmp_path / "staging",
                              memory=memory)


def _fetch(sandboxes: ContainerSandboxes) -> Callable[[bytes, int], bytes]:
    def fetch(digest: bytes, size: int) -> bytes:
        data = sandboxes.cache.read(digest, size)
        assert data is not None, "a blob the record references is not in the cache"
        return data
    return fetch


def _sh(podman: Podman, container: str, script: str) -> str:
    return podman.text("exec", container, "sh", "-c", script)


def ask(podman: Podman, container: str) -> int:
    """The next count of the ``SERVER`` running in ``container``."""
    return int(podman.text("exec", container, "sh", "-c", "echo go > /tmp/req; cat /tmp/rep"))


def _run(podman: Podman, runtime: Setup, name: str, script: str) -> None:
    podman.run("run", "-d", "--name", name, runtime.image, "/bin/sh", "-c", script)


def test_the_runtime_is_installed_with_criu_that_passes_its_check(runtime: Setup,
                                                                  podman: Podman) -> None:
    assert podman.available() is None
    assert runtime.criu is not None, runtime.criu_problem
    assert podman.criu_problem() is None
    assert podman.storage().driver == "overlay"
    assert os.access(INIT_PATH, os.X_OK)  # catatonit, for podman's --init


def test_files_links_deletions_and_fifos_come_back_in_the_next_attempts_container(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    sandboxes = _sandboxes(podman, tmp_path, memory=False)
    first = _name(names)
    _run(podman, runtime, first, "sleep 1000")
    _sh(podman, first, "mkdir -p /work/repo/src && echo 'def f(): pass' > /work/repo/src/a.py"
        " && chmod 640 /work/repo/src/a.py && ln -s src/a.py /work/repo/link"
        " && rm /bin/vi /etc/group && mkfifo -m 600 /work/pipe"
        " && head -c 300000 /dev/urandom > /work/big")
    recorded = sandboxes.record(first, None)
    assert recorded.record.memory is None  # asked not to
    assert set(recorded.record.whiteouts) >= {"bin/vi", "etc/group"}
    assert recorded.record.fifos == (("work/pipe", 0o600),)
    big = _sh(podman, first, "md5sum /work/big")

    second = _name(names)
    restored = sandboxes.restore(recorded.record, _fetch(sandboxes), second, "r1-a1", "r1")
    assert restored.running is False
    assert restored.blobs == recorded.blobs
    listing = _sh(podman, second, "cat /work/repo/src/a.py; stat -c '%a %F' "
                  "/work/repo/src/a.py /work/pipe; readlink /work/repo/link; "
                  "test -e /bin/vi || echo no-vi; test -e /etc/group || echo no-group; "
                  "md5sum /work/big; test -e /etc/passwd && echo passwd-kept")
    assert listing.splitlines() == [
        "def f(): pass", "640 regular file", "600 fifo", "src/a.py", "no-vi", "no-group",
        big, "passwd-kept"]


def test_a_running_process_continues_from_its_memory_after_restore(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    sandboxes = _sandboxes(podman, tmp_path)
    first = _name(names)
    _run(podman, runtime, first, SERVER)
    assert [ask(podman, first) for _ in range(3)] == [1, 2, 3]
    recorded = sandboxes.record(first, None)
    assert recorded.record.memory is not None and recorded.record.memory_size > 0
    assert ask(podman, first) == 4  # the recorded container runs on
    again = sandboxes.record(first, recorded.listings)
    assert ask(podman, first) == 5

    # Restored twice from one record: each continues from 3, as recorded.
    for _ in range(2):
        name = _name(names)
        assert sandboxes.restore(recorded.record, _fetch(sandboxes), name, "k", "r").running is True
        assert ask(podman, name) == 4
        assert ask(podman, name) == 5
    name = _name(names)
    sandboxes.restore(again.record, _fetch(sandboxes), name, "k", "r")
    assert ask(podman, name) == 5


def test_without_memory_the_restored_container_starts_afresh_with_its_files(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    sandboxes = _sandboxes(podman, tmp_path)
    first = _name(names)
    _run(podman, runtime, first, SERVER)
    ask(podman, first)
    _sh(podman, first, "echo kept > /work/state")
    recorded = sandboxes.record(first, None)
    sandboxes.memory = False  # as on a node where `criu check` fails
    name = _name(names)
    assert sandboxes.restore(recorded.record, _fetch(sandboxes), name, "k", "r").running is False
    assert _sh(podman, name, "cat /work/state") == "kept"
    assert ask(podman, name) == 1  # its command ran again, from the start


def test_a_second_recording_reads_only_what_changed_and_rollouts_share_blobs(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    sandboxes = _sandboxes(podman, tmp_path, memory=False)
    a, b = _name(names), _name(names)
    for name in (a, b):
        _run(podman, runtime, name, "sleep 1000")
        _sh(podman, name, "mkdir /work/r && for i in 1 2 3 4 5; do "
            "echo same-$i > /work/r/$i; done")
    first = sandboxes.record(a, None)
    _sh(podman, a, "echo changed > /work/r/5")
    second = sandboxes.record(a, first.listings)
    assert first.record.tree != second.record.tree
    # podman's own files (hosts, hostname, resolv.conf, .containerenv) are changes too.
    assert first.file_count == second.file_count == first.files_read >= 5
    assert second.files_read == 1
    other = sandboxes.record(b, None)
    same = {digest_of(f"same-{i}\n".encode()) for i in range(1, 6)}
    assert same <= first.blobs and same <= other.blobs  # one blob each, for both


def test_a_setuid_file_made_in_the_container_comes_back_without_its_setuid_bit(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    sandboxes = _sandboxes(podman, tmp_path, memory=False)
    first = _name(names)
    _run(podman, runtime, first, "sleep 1000")
    _sh(podman, first, "cp /bin/busybox /work/su && chmod 4755 /work/su")
    recorded = sandboxes.record(first, None)
    name = _name(names)
    sandboxes.restore(recorded.record, _fetch(sandboxes), name, "k", "r")
    assert _sh(podman, name, "stat -c %a /work/su") == "755"


@pytest.mark.parametrize("init", [[], ["--init"]], ids=["plain", "with-init"])
def test_a_container_with_a_bind_mount_is_refused_saying_what_to_do(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path,
        init: list[str]) -> None:
    sandboxes = _sandboxes(podman, tmp_path)
    name = _name(names)
    (tmp_path / "host").mkdir()
    podman.run("run", "-d", "--name", name, *init, "-v", f"{tmp_path / 'host'}:/data",
               runtime.image, "sleep", "1000")
    with pytest.raises(ContainerRuntimeError, match="has mounts .*/data.* without volumes"):
        sandboxes.record(name, None)


def test_a_container_run_with_podmans_init_comes_back_under_it_from_its_memory(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    sandboxes = _sandboxes(podman, tmp_path)
    first = _name(names)
    podman.run("run", "-d", "--init", "--name", first, runtime.image, "/bin/sh", "-c",
               SERVER)
    assert [ask(podman, first) for _ in range(2)] == [1, 2]
    recorded = sandboxes.record(first, None)
    assert recorded.record.config.init is True and recorded.record.memory is not None
    stored = decode_record(encode_record(recorded.record), "r")
    assert stored.config.init is True
    name = _name(names)
    assert sandboxes.restore(stored, _fetch(sandboxes), name, "k", "r").running is True
    assert ask(podman, name) == 3  # its memory came back, under podman's init
    assert _sh(podman, name, "cat /proc/1/cmdline | tr '\\0' ' '").startswith(
        f"{INIT_MOUNT} -- /bin/sh -c")
    # Without memory (no CRIU on the node), it starts afresh, still under the init.
    sandboxes.memory = False
    fresh = _name(names)
    assert sandboxes.restore(stored, _fetch(sandboxes), fresh, "k", "r").running is False
    assert ask(podman, fresh) == 1
    assert podman.inspect(fresh)["HostConfig"]["Init"] is True


def _init_mount(spec: dict[str, Any]) -> dict[str, Any]:
    (found,) = [m for m in spec["mounts"] if m["destination"] == INIT_MOUNT]
    return found


@pytest.mark.parametrize("change,refusal", [
    (None, f"asks to mount '{INIT_PATH}' from the host \\(at '{INIT_MOUNT}'\\)"),
    (lambda s: _init_mount(s).__setitem__("source", "/bin/sh"),
     f"asks to mount '/bin/sh' from the host \\(at '{INIT_MOUNT}'\\)"),
    (lambda s: _init_mount(s).__setitem__("destination", "/etc/passwd"),
     f"asks to mount '{INIT_PATH}' from the host \\(at '/etc/passwd'\\)"),
    (lambda s: s["mounts"].append({"type": "bind", "source": "/root", "destination": "/r"}),
     "asks to mount '/root' from the host"),
], ids=["init-not-asked", "other-binary", "elsewhere", "another-mount"])
def test_an_archive_mounts_podmans_init_binary_only_from_its_own_path_and_place(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path,
        change: Any, refusal: str) -> None:
    sandboxes = _sandboxes(podman, tmp_path)
    first = _name(names)
    podman.run("run", "-d", "--init", "--name", first, runtime.image, "sleep", "1000")
    recorded = sandboxes.record(first, None)
    assert recorded.record.memory is not None
    data = sandboxes.cache.read(recorded.record.memory, recorded.record.memory_size)
    assert data is not None
    image = recorded.record.config.image
    check_archive(data, image, "r", init_path=INIT_PATH)  # podman's own passes
    if change is None:  # the container the restore made has no --init
        with pytest.raises(ContainerRuntimeError, match=refusal):
            check_archive(data, image, "r")
        return
    with pytest.raises(ContainerRuntimeError, match=refusal):
        check_archive(rewrite_dump(data, "spec.dump", change), image, "r",
                      init_path=INIT_PATH)


def _recorded(podman: Podman, runtime: Setup, names: list[str], tmp_path: Path
              ) -> tuple[ContainerSandboxes, RecordedContainer, bytes]:
    sandboxes = _sandboxes(podman, tmp_path)
    first = _name(names)
    _run(podman, runtime, first, SERVER)
    recorded = sandboxes.record(first, None)
    assert recorded.record.memory is not None
    data = sandboxes.cache.read(recorded.record.memory, recorded.record.memory_size)
    assert data is not None
    return sandboxes, recorded, data


def rewrite_dump(data: bytes, name: str, change: object) -> bytes:
    """The archive ``data`` with the JSON member ``name`` changed by ``change``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(data)) as src, \
            tarfile.open(fileobj=out, mode="w") as dst:
        for member in src:
            body = src.extractfile(member) if member.isreg() else None
            if member.name == name and body is not None:
                doc = json.loads(body.read())
                change(doc)  # type: ignore[operator]
                raw = json.dumps(doc).encode()
                member.size = len(raw)
                body = io.BytesIO(raw)
            dst.addfile(member, body)
    return out.getvalue()


@pytest.mark.parametrize("member,change,refusal", [
    ("spec.dump", lambda s: s["mounts"].append(
        {"type": "bind", "source": "/", "destination": "/host"}),
     "asks to mount '/' from the host"),
    ("config.dump", lambda c: c.__setitem__("privileged", True),
     "asks for a privileged container"),
    ("spec.dump", lambda s: s["process"]["capabilities"]["bounding"].append("CAP_SYS_ADMIN"),
     r"asks for capabilities \['CAP_SYS_ADMIN'\]"),
    ("spec.dump", lambda s: s["linux"]["namespaces"].__setitem__(
        0, {"type": "pid", "path": "/proc/1/ns/pid"}),
     "joins the pid namespace '/proc/1/ns/pid'"),
])
def test_a_stored_checkpoint_archive_asking_for_the_host_is_refused(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path,
        member: str, change: object, refusal: str) -> None:
    sandboxes, recorded, data = _recorded(podman, runtime, names, tmp_path)
    check_archive(data, recorded.record.config.image, "r")  # podman's own passes
    with pytest.raises(ContainerRuntimeError, match=refusal):
        check_archive(rewrite_dump(data, member, change), recorded.record.config.image, "r")


def test_a_stored_archive_holding_a_link_or_an_unknown_member_is_refused(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    _, recorded, data = _recorded(podman, runtime, names, tmp_path)
    for build in ("link", "rootfs"):
        out = io.BytesIO()
        with tarfile.open(fileobj=io.BytesIO(data)) as src, \
                tarfile.open(fileobj=out, mode="w") as dst:
            for m in src:
                dst.addfile(m, src.extractfile(m) if m.isreg() else None)
            if build == "link":
                link = tarfile.TarInfo("checkpoint/pages-9.img")
                link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
                dst.addfile(link)
            else:
                extra = tarfile.TarInfo("rootfs-diff.tar")
                dst.addfile(extra, io.BytesIO(b""))
        expect = "neither a file nor a folder" if build == "link" else "never writes"
        with pytest.raises(ContainerRuntimeError, match=expect):
            check_archive(out.getvalue(), recorded.record.config.image, "r")


def test_a_stored_record_is_read_back_and_a_crafted_one_is_refused_naming_the_field(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    _, recorded, _ = _recorded(podman, runtime, names, tmp_path)
    record = recorded.record
    assert decode_record(encode_record(record), "r") == record
    import msgpack

    raw = msgpack.unpackb(encode_record(record), raw=False)
    for field, value, expect in [
        ("whiteouts", ["../../etc/shadow"], "whiteouts names '../../etc/shadow'"),
        ("fifos", [["a/../../b", 0o600]], "fifos names"),
        ("image", "busybox", "image is not an image id"),
        ("memory_size", 0, "memory_size does not match memory"),
        ("workdir", "relative", "workdir is not an absolute path"),
        ("init", "/bin/sh", "init is not true or false"),
    ]:
        crafted = msgpack.packb({**raw, field: value}, use_bin_type=True)
        with pytest.raises(ContainerRuntimeError, match=expect):
            decode_record(crafted, "r")
    with pytest.raises(ContainerRuntimeError, match="more than"):
        decode_record(b"\x00" * (5 << 20), "r")
    older = {k: v for k, v in raw.items() if k != "init"}  # before --init was recorded
    assert decode_record(msgpack.packb(older, use_bin_type=True), "r") == record


def test_restoring_onto_a_node_without_the_image_says_to_load_it(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    sandboxes, recorded, _ = _recorded(podman, runtime, names, tmp_path)
    missing = ContainerRecord(
        config=type(recorded.record.config)(**{
            **{f: getattr(recorded.record.config, f)
               for f in recorded.record.config.__slots__},
            "image": "0" * 64}),
        tree=recorded.record.tree, tree_size=recorded.record.tree_size,
        whiteouts=(), opaque=(), fifos=(), memory=None, memory_size=0)
    name = _name(names)
    with pytest.raises(ContainerRuntimeError, match="is not on this node: load or pull it"):
        sandboxes.restore(missing, _fetch(sandboxes), name, "k", "r")
    assert not podman.exists(name)
    assert not os.listdir(tmp_path / "staging")  # nothing of the attempt left


def test_a_crafted_deletion_through_a_link_never_reaches_the_host(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    sandboxes = _sandboxes(podman, tmp_path, memory=False)
    victim = tmp_path / "victim"
    victim.write_text("the host's")
    first = _name(names)
    _run(podman, runtime, first, "sleep 1000")
    _sh(podman, first, f"ln -s {tmp_path} /work/esc")  # a link to a host path
    recorded = sandboxes.record(first, None)
    crafted = ContainerRecord(**{
        **{f: getattr(recorded.record, f) for f in ContainerRecord.__slots__},
        "whiteouts": ("work/esc/victim",)})
    name = _name(names)
    sandboxes.restore(crafted, _fetch(sandboxes), name, "k", "r")
    assert victim.read_text() == "the host's"
    assert _sh(podman, name, "readlink /work/esc") == str(tmp_path)


def test_a_recording_keeps_files_written_after_someone_elses_podman_checkpoint(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    """podman's own checkpoint (with its filesystem) leaves a rootfs diff in the
    container's folder; the restore that ends a recording with memory must not apply it
    again (found by benchmarks/containers.py)."""
    sandboxes = _sandboxes(podman, tmp_path)
    name = _name(names)
    _run(podman, runtime, name, SERVER)
    _sh(podman, name, "echo old > /work/f")
    podman.run("container", "checkpoint", "--leave-running", "--compress=none",
               f"--export={tmp_path / 'theirs.tar'}", name)
    _sh(podman, name, "echo new > /work/f")
    recorded = sandboxes.record(name, None)
    assert recorded.record.memory is not None
    assert _sh(podman, name, "cat /work/f") == "new"
    assert ask(podman, name) == 1  # still running, from its memory


def _craft(sandboxes: ContainerSandboxes, record: ContainerRecord, data: bytes,
           **fields: object) -> ContainerRecord:
    """``record`` with the checkpoint archive ``data`` as its memory (stored under its own
    digest, as an attacker re-hashes what they wrote) and ``fields`` changed."""
    digest, size = sandboxes.cache.store([data])
    return ContainerRecord(**{**{f: getattr(record, f) for f in ContainerRecord.__slots__},
                              "memory": digest, "memory_size": size, **fields})


def test_oci_hooks_in_a_stored_spec_never_run_on_the_host(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    """Issue 50 row 1: hooks added to spec.dump ran on the host as root at the restore
    and at the container's removal; what podman is handed now comes from our record."""
    sandboxes, recorded, data = _recorded(podman, runtime, names, tmp_path)
    marker = tmp_path / "hook-ran"
    hook = {"path": "/bin/sh", "args": ["sh", "-c", f"echo ran >> {marker}"]}
    crafted = _craft(sandboxes, recorded.record, rewrite_dump(data, "spec.dump", lambda s: s.
                     __setitem__("hooks", {kind: [hook] for kind in (
                         "prestart", "createRuntime", "createContainer", "startContainer",
                         "poststart", "poststop")})))
    name = _name(names)
    assert sandboxes.restore(crafted, _fetch(sandboxes), name, "k", "r").running is True
    assert ask(podman, name) == 1  # its server continues from its memory
    podman.remove(name)
    assert not marker.exists()


def test_pid_files_a_stored_config_names_on_the_host_are_left_alone(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    """Issue 50 row 2: config.dump's conmonPidFile / pid_file naming a host path had
    podman overwrite that file as root."""
    sandboxes, recorded, data = _recorded(podman, runtime, names, tmp_path)
    targets = {field: tmp_path / field for field in ("conmonPidFile", "pid_file")}
    for path in targets.values():
        path.write_text("the host's")

    def point(config: dict[str, object]) -> None:
        config.update({field: str(path) for field, path in targets.items()})
    crafted = _craft(sandboxes, recorded.record, rewrite_dump(data, "config.dump", point))
    name = _name(names)
    assert sandboxes.restore(crafted, _fetch(sandboxes), name, "k", "r").running is True
    assert ask(podman, name) == 1
    podman.remove(name)
    assert {f: p.read_text() for f, p in targets.items()} == {
        f: "the host's" for f in targets}


def test_a_crafted_deletion_through_a_link_with_memory_never_reaches_the_host(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    """Issue 50 row 3: with CRIU memory the deletions went to podman as deleted.files,
    which it removes following links; we delete them, by descriptor, before the
    processes run."""
    sandboxes = _sandboxes(podman, tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("the host's")
    first = _name(names)
    _run(podman, runtime, first, SERVER)
    _sh(podman, first, f"ln -s {tmp_path} /work_esc && rm /bin/vi")
    recorded = sandboxes.record(first, None)
    assert recorded.record.memory is not None
    crafted = ContainerRecord(**{
        **{f: getattr(recorded.record, f) for f in ContainerRecord.__slots__},
        "whiteouts": recorded.record.whiteouts + ("work_esc/victim",)})
    name = _name(names)
    assert sandboxes.restore(crafted, _fetch(sandboxes), name, "k", "r").running is True
    assert victim.read_text() == "the host's"
    assert ask(podman, name) == 1
    assert _sh(podman, name, "readlink /work_esc; test -e /bin/vi || echo no-vi"
               ).splitlines() == [str(tmp_path), "no-vi"]


def test_port_mappings_in_a_stored_config_publish_nothing(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    """Issue 50 row 4: config.dump's newPortMappings published a host port of the
    file's choosing."""
    sandboxes, recorded, data = _recorded(podman, runtime, names, tmp_path)
    ports = [{"host_ip": "", "container_port": 80, "host_port": 18931, "range": 1,
              "protocol": "tcp"}]
    crafted = _craft(sandboxes, recorded.record, rewrite_dump(
        data, "config.dump", lambda c: c.__setitem__("newPortMappings", ports)))
    name = _name(names)
    assert sandboxes.restore(crafted, _fetch(sandboxes), name, "k", "r").running is True
    assert ask(podman, name) == 1
    assert podman.text("port", name) == ""
    assert podman.inspect(name)["NetworkSettings"]["Ports"] in ({}, None)


def _replace(data: bytes, name: str, body: bytes) -> bytes:
    """The archive ``data`` with the member ``name``'s content replaced by ``body``
    (added when it is not there)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(data)) as src, \
            tarfile.open(fileobj=out, mode="w") as dst:
        found = False
        for member in src:
            content = src.extractfile(member) if member.isreg() else None
            if member.name == name:
                found, member.size, content = True, len(body), io.BytesIO(body)
            dst.addfile(member, content)
        if not found:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            dst.addfile(info, io.BytesIO(body))
    return out.getvalue()


def test_a_deeply_nested_dump_or_a_dot_or_repeated_member_is_refused_in_one_line(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    """Issue 50 row 4: a deeply nested config.dump raised a bare RecursionError; a member
    named ``checkpoint/..`` was accepted."""
    sandboxes, recorded, data = _recorded(podman, runtime, names, tmp_path)
    image = recorded.record.config.image
    nested = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(ContainerRuntimeError, match=r"holds a dump that does not read "
                       r"\(config.dump is JSON nested too deeply"):
        check_archive(_replace(data, "config.dump", nested), image, "r")
    for dot in ("checkpoint/..", "checkpoint/."):
        with pytest.raises(ContainerRuntimeError,
                           match=f"holds {re.escape(repr(dot))}, which podman's export "
                                 f"never writes"):
            check_archive(_replace(data, dot, b"x"), image, "r")
    twice = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(data)) as src, \
            tarfile.open(fileobj=twice, mode="w") as dst:
        for member in src:
            dst.addfile(member, src.extractfile(member) if member.isreg() else None)
            if member.name.endswith("inventory.img"):
                dst.addfile(member, src.extractfile(member))
    with pytest.raises(ContainerRuntimeError, match=r"holds 'checkpoint/inventory.img' twice"):
        check_archive(twice.getvalue(), image, "r")
    crafted = _craft(sandboxes, recorded.record, _replace(data, "spec.dump", nested))
    name = _name(names)
    with pytest.raises(ContainerRuntimeError, match="restore another snapshot$"):
        sandboxes.restore(crafted, _fetch(sandboxes), name, "k", "r")
    assert not podman.exists(name)


def test_dev_shm_files_come_back_and_a_link_among_them_is_refused(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    """The archive's /dev/shm contents are re-packed from plain files and folders."""
    sandboxes = _sandboxes(podman, tmp_path)
    first = _name(names)
    _run(podman, runtime, first, SERVER)
    _sh(podman, first, "mkdir /dev/shm/d && echo kept > /dev/shm/d/f")
    recorded = sandboxes.record(first, None)
    assert recorded.record.memory is not None
    name = _name(names)
    assert sandboxes.restore(recorded.record, _fetch(sandboxes), name, "k", "r").running
    assert _sh(podman, name, "cat /dev/shm/d/f") == "kept"

    shm = io.BytesIO()
    with tarfile.open(fileobj=shm, mode="w") as tar:
        link = tarfile.TarInfo("escape")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(link)
    data = sandboxes.cache.read(recorded.record.memory, recorded.record.memory_size)
    assert data is not None
    crafted = _craft(sandboxes, recorded.record,
                     _replace(data, "devshm-checkpoint.tar", shm.getvalue()))
    name = _name(names)
    with pytest.raises(ContainerRuntimeError,
                       match="holds 'escape' in its /dev/shm contents, not a plain file"):
        sandboxes.restore(crafted, _fetch(sandboxes), name, "k", "r")
    assert not podman.exists(name)


class _Squatting(Podman):
    """This machine's podman, where another container takes the address of the container
    being recorded while its processes are checkpointed (as a new session's or a restore's
    container may on a busy node)."""

    def __init__(self, env: dict[str, str], image: str, squatter: str) -> None:
        super().__init__(env=env)
        self.image, self.squatter = image, squatter

    def checkpoint(self, container: str, export: str, keep: bool) -> None:
        address = self.inspect(container)["NetworkSettings"]["IPAddress"]
        super().checkpoint(container, export, keep)
        done = self.run("run", "-d", "--name", self.squatter, "--ip", address, self.image,
                        "sleep", "1000", check=False)
        # Refused only when another process's container took the address first.
        assert done.returncode == 0 or b"is not available" in done.stderr, done.stderr


def test_a_recording_whose_address_was_taken_meanwhile_restores_on_a_fresh_one(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 50 row 16: the restore in place that ends a recording with memory asked for
    the container's old address, and failed when another container had taken it."""
    squatter = _name(names)
    sandboxes = ContainerSandboxes(_Squatting(runtime.env, runtime.image, squatter),
                                   BlobCache(tmp_path / "cache"), tmp_path / "staging")
    first = _name(names)
    _run(podman, runtime, first, SERVER)
    assert ask(podman, first) == 1
    address = podman.inspect(first)["NetworkSettings"]["IPAddress"]
    with caplog.at_level("WARNING", logger="nemo_ckpt.holder"):
        recorded = sandboxes.record(first, None)
    assert recorded.record.memory is not None
    assert ask(podman, first) == 2  # running on, from its memory
    assert podman.inspect(first)["NetworkSettings"]["IPAddress"] not in ("", address)
    assert f"container {first} continues on a new address" in caplog.text


class _LosingDump(Podman):
    """This machine's podman, where the dump of a recording's checkpoint is lost before
    its restore in place (as a failing CRIU or a full disk would leave it)."""

    def checkpoint(self, container: str, export: str, keep: bool) -> None:
        super().checkpoint(container, export, keep)
        folder = Path(self.inspect(container)["StaticDir"])
        (folder / "checkpoint" / "inventory.img").unlink()


def test_a_recording_that_cannot_restore_its_processes_says_the_container_is_stopped(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    """Issue 50 row 16: the failed recording's error says what state the container is in
    and what the worker does."""
    sandboxes = ContainerSandboxes(_LosingDump(env=runtime.env),
                                   BlobCache(tmp_path / "cache"), tmp_path / "staging")
    first = _name(names)
    _run(podman, runtime, first, SERVER)
    with pytest.raises(ContainerRuntimeError,
                       match=f"^container {first} was stopped for this turn's recording .* "
                             f"the turn is not committed and the container stays stopped: "
                             f"close the session .* or restore the last snapshot$"):
        sandboxes.record(first, None)
    assert podman.inspect(first)["State"]["Status"] == "exited"
    # The next turn's recording refuses rather than record its files without memory.
    with pytest.raises(ContainerRuntimeError,
                       match=f"^container {first} is stopped with its processes "
                             f"checkpointed and not restored .* close the session"):
        sandboxes.record(first, None)


def test_sixteen_containers_on_the_default_network_record_at_every_turn_beside_restores(
        runtime: Setup, podman: Podman, names: list[str], tmp_path: Path) -> None:
    """Issue 50 row 16 at scale: four holders on one node, four sessions each, every turn
    recorded with memory while the node restores other containers (each takes an address
    from podman's default network); every recording succeeds and every server continues."""
    holders = [_sandboxes(podman, tmp_path / f"holder{i}") for i in range(4)]
    servers = [[_name(names) for _ in range(4)] for _ in holders]
    for i in range(4):  # neighbouring addresses in different holders
        for own in servers:
            _run(podman, runtime, own[i], SERVER)

    def run_holder(sandboxes: ContainerSandboxes, own: list[str]) -> list[int]:
        recorded: dict[str, RecordedContainer] = {}
        for turn in range(3):
            for server in own:
                assert ask(podman, server) == turn + 1
                before = recorded.get(server)
                recorded[server] = sandboxes.record(server, before and before.listings)
                assert recorded[server].record.memory is not None
            # Another job's restore on this node: a new container takes an address.
            made = _name(names)
            assert sandboxes.restore(recorded[own[turn]].record, _fetch(sandboxes), made,
                                     "k", "r").running is True
        return [ask(podman, server) for server in own]

    with ThreadPoolExecutor(len(holders)) as pool:
        counts = list(pool.map(run_holder, holders, servers))
    assert counts == [[4, 4, 4, 4]] * len(holders)
