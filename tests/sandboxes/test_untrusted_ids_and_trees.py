"""Where a checkpoint meets data it did not write itself (issue 34): rollout ids too long
to name the directories a restore makes, and stored trees crafted to expand without
bound. Through the real driver, coordinator and holders in-process, and the CLI."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.catalog.verification import verify_snapshot
from nemo_ckpt.cli.main import main
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.errors import SandboxError, SnapshotReadError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.storage.checkpoint_folder import environment_dir, environment_folder, folder_at
from nemo_ckpt.storage.names import MAX_SANDBOX_ID_BYTES, NAME_MAX
from nemo_ckpt.storage.snapshot_files import read_manifest
from nemo_ckpt.testing.data_plane import StaticCut
from nemo_ckpt.trees import tree_codec
from nemo_ckpt.trees.blob_store import BlobStore, digest_of
from nemo_ckpt.trees.collection import collect_blobs
from nemo_ckpt.trees.limits import TreeBudget
from nemo_ckpt.trees.snapshot_trees import BlobsWritten, read_trees_file, write_trees_file
from nemo_ckpt.trees.tree_codec import decode_tree, pack_tree_object
from nemo_ckpt.trees.tree_types import DIR
from tests.harness import World
from tests.sandboxes.test_sandbox_sessions import sandbox_job

pytestmark = pytest.mark.timeout(120)

LEVELS = 30  # a planted tree of 2^30 directories


def test_the_id_bound_leaves_room_for_any_attempt_and_a_restore_beside_a_directory() -> None:
    # "-a" and 20 digits, then "." and a 16-digit tag: the longest name a restore makes.
    assert MAX_SANDBOX_ID_BYTES + len("-a") + 20 + len(".") + 16 == NAME_MAX


def _open_one(job: World, rollout_id: str, path: Path) -> None:
    """Open one session of ``rollout_id`` with a directory, take a turn, snapshot it."""
    async def scenario() -> None:
        await job.ckpt.ensure_holders()
        instance = sorted(job.holders())[0]
        client = await job.client(instance)
        ep = Ep(rollout_id, 0)
        work = job.sandboxes / "work" / "w0"
        work.mkdir(parents=True)
        (work / "state").write_text("s0")
        await client.open(ep, b"s0", directory=work)
        async with client.turn(ep) as turn:
            assert turn.directory is not None
            (turn.directory / "state").write_text("s1")
            turn.complete(b"t0", b"s1")
        async with job.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(StaticCut({instance: {ep}}, set()))

    job.run(scenario())


def test_a_sandbox_session_whose_id_cannot_name_its_restored_directory_is_refused_at_open(
        tmp_path: Path) -> None:
    job = sandbox_job(tmp_path)
    try:
        async def scenario() -> None:
            await job.ckpt.ensure_holders()
            client = await job.client(sorted(job.holders())[0])
            work = job.sandboxes / "work" / "w0"
            work.mkdir(parents=True)
            with pytest.raises(SandboxError, match=(
                    rf"rollout id 'xxx.*is 254 bytes as a file name; at most "
                    rf"{MAX_SANDBOX_ID_BYTES} for a session with a sandbox directory")):
                await client.open(Ep("x" * 254, 0), b"s0", directory=work)
            assert await client.sessions() == []
            # Without a directory the id names no file: it opens.
            await client.open(Ep("y" * 254, 0), b"s0")

        job.run(scenario())
    finally:
        job.close()


def test_a_session_of_the_longest_id_allowed_snapshots_and_restores(tmp_path: Path) -> None:
    rollout_id = "r" * MAX_SANDBOX_ID_BYTES
    path = tmp_path / "ckpt" / "step-1"
    job = sandbox_job(tmp_path)
    try:
        _open_one(job, rollout_id, path)
    finally:
        job.close()
    shutil.rmtree(tmp_path / "sandboxes")
    assert verify_snapshot(path).ok
    fresh = sandbox_job(tmp_path, seed=1)
    try:
        async def restore() -> None:
            async with fresh.ckpt.restored(path) as restored:
                assert {r for _, r, _ in restored.continued_attempts} == {rollout_id}
            restored_dir = fresh.sandboxes / f"{rollout_id}-a1"
            assert (restored_dir / "state").read_text() == "s1"

        fresh.run(restore())
    finally:
        fresh.close()


def test_a_snapshot_refuses_to_capture_a_session_a_restore_could_not_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import actors.holder.sessions
    monkeypatch.setattr(actors.holder.sessions, "sandbox_id_problem", lambda *a: None)
    job = sandbox_job(tmp_path)
    try:
        with pytest.raises(SandboxError, match=(
                r"cannot hold the directory of rollout 'x.*\(attempt 0\): its restored "
                r"directory would be named .*\(274 bytes with a restore's suffix\), past the "
                r"255-byte limit of a file name")):
            _open_one(job, "x" * 254, tmp_path / "ckpt" / "step-1")
    finally:
        job.close()
    assert not (environment_dir(tmp_path / "ckpt" / "step-1") / "manifest.json").exists()


def test_a_stored_session_a_restore_cannot_name_is_reported_by_verify_and_refused_by_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    import actors.holder.sandboxes
    import actors.holder.sessions
    # Holders as they were before ids were bounded: any id opens and is captured.
    monkeypatch.setattr(actors.holder.sessions, "sandbox_id_problem", lambda *a: None)
    monkeypatch.setattr(actors.holder.sandboxes, "restored_name_problem", lambda key: None)
    path = tmp_path / "ckpt" / "step-1"
    job = sandbox_job(tmp_path)
    try:
        _open_one(job, "x" * 254, path)
    finally:
        job.close()
    monkeypatch.undo()

    assert main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert "a restore cannot make it: its restored directory would be named 'xxx" in err
    assert "past the 255-byte limit of a file name" in err
    shutil.rmtree(tmp_path / "sandboxes")
    fresh = sandbox_job(tmp_path, seed=1)
    try:
        async def restore() -> None:
            with pytest.raises(SandboxError, match=(
                    r"cannot restore the directory of rollout 'x+' \(attempt 0\) of .*: its "
                    r"restored directory would be named")):
                async with fresh.ckpt.restored(path):
                    pass
            for instance in fresh.holders():
                assert await (await fresh.client(instance)).sessions() == []

        fresh.run(restore())
        assert [p.name for p in fresh.sandboxes.iterdir() if p.name != ".nemo-ckpt"] == []
    finally:
        fresh.close()


def test_a_restore_that_cannot_write_a_directory_raises_a_sandbox_error_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt" / "step-1"
    job = sandbox_job(tmp_path)
    try:
        _open_one(job, "r0", path)
    finally:
        job.close()
    shutil.rmtree(tmp_path / "sandboxes")
    import nemo_ckpt.sandboxes.directories

    def full_disk(tree: Any, target: Path, *args: Any, **kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", str(target / "state"))

    monkeypatch.setattr(nemo_ckpt.sandboxes.directories, "materialize", full_disk)
    fresh = sandbox_job(tmp_path, seed=1)
    try:
        async def restore() -> None:
            with pytest.raises(SandboxError, match=(
                    r"cannot restore the directory of rollout 'r0' \(attempt 0\) into "
                    r".*/restore-restore-.*/r0-a1/state: No space left on device")):
                async with fresh.ckpt.restored(path):
                    pass

        fresh.run(restore())
    finally:
        fresh.close()


# --- a tree crafted to expand without bound ------------------------------------------


def _plant_tree_bomb(snapshot: Path) -> None:
    """Put a tree of 2^LEVELS directories (LEVELS + 1 objects, each directory naming the
    one below twice) into the snapshot's blob store with the project's own encoder, and
    rewrite the snapshot's trees file and manifest so that its session owns it."""
    manifest = read_manifest(snapshot)
    store = BlobStore(str(snapshot.parent / "blobs"), folder_at)
    data = pack_tree_object([])
    for _ in range(LEVELS):
        digest = digest_of(data)
        store.put(digest, data)
        data = pack_tree_object([["a", DIR, 0o755, len(data), digest],
                                 ["b", DIR, 0o755, len(data), digest]])
    top = digest_of(data)
    store.put(top, data)
    assert len(data) < 100
    folder = environment_folder(snapshot)
    raw = json.loads((environment_dir(snapshot) / "manifest.json").read_bytes())
    for k, shard in enumerate(manifest.shards):
        if shard.trees is None:
            continue
        rows = [(r[0], r[1], top, len(data), r[4])
                for r in read_trees_file(folder, shard.trees, shard.instance_id)]
        entry = write_trees_file(folder, shard.trees.file, shard.instance_id, rows,
                                 shard.trees.blobs, BlobsWritten())
        raw["shards"][k]["trees"] = entry.model_dump()
    (environment_dir(snapshot) / "manifest.json").write_text(json.dumps(raw))


@pytest.fixture
def expansions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The most entries each stored tree's read had expanded (decode_tree's hook)."""
    seen: list[int] = []
    monkeypatch.setattr(tree_codec, "expansion_observer",
                        lambda where, n: seen.append(n))
    return seen


def test_a_tree_past_its_entry_budget_is_refused_as_it_is_expanded() -> None:
    objects: dict[bytes, bytes] = {}
    data = pack_tree_object([])
    for _ in range(LEVELS):
        digest = digest_of(data)
        objects[digest] = data
        data = pack_tree_object([["a", DIR, 0o755, len(data), digest],
                                 ["b", DIR, 0o755, len(data), digest]])
    top = digest_of(data)
    objects[top] = data
    reads: list[bytes] = []

    def fetch(digest: bytes, size: int) -> bytes:
        reads.append(digest)
        return objects[digest]

    with pytest.raises(SandboxError, match=(
            r"^the sandbox tree of s0 expands to more than 1000 entries \(a subtree counts "
            r"at each place that names it\), past sandbox_read_max_entries: .* raise "
            r"CheckpointConfig.sandbox_read_max_entries if the tree is genuine$")):
        decode_tree(top, len(data), fetch, "s0", TreeBudget(entries=1000))
    assert len(reads) == LEVELS + 1  # each object read once, however often it is named


def test_a_tree_whose_files_claim_more_than_the_byte_budget_is_refused() -> None:
    rows = [[f"f{k}", 1, 0o644, 1 << 20, bytes(16)] for k in range(8)]
    data = pack_tree_object(rows)
    with pytest.raises(SandboxError, match=r"claims more than 4194304 bytes of files, past "
                                           r"sandbox_read_max_bytes"):
        decode_tree(digest_of(data), len(data), lambda d, n: data, "s0",
                    TreeBudget(bytes=4 << 20))


def test_the_read_budget_defaults_to_the_scans_limits_and_is_validated(tmp_path: Path) -> None:
    cfg = CheckpointConfig(sandbox_max_files=1234, sandbox_max_bytes=5678)
    assert cfg.tree_budget == TreeBudget(entries=1234, bytes=5678)
    cfg = CheckpointConfig(sandbox_read_max_entries=99, sandbox_read_max_bytes=77)
    assert cfg.tree_budget == TreeBudget(entries=99, bytes=77)
    with pytest.raises(ValueError, match="sandbox_read_max_entries"):
        CheckpointConfig(sandbox_read_max_entries=0)


def test_a_planted_tree_of_2_to_the_30_directories_is_refused_by_every_reader_within_its_budget(
        tmp_path: Path, expansions: list[int], capsys: Any) -> None:
    a, b = tmp_path / "ckpt" / "a", tmp_path / "ckpt" / "b"
    job = sandbox_job(tmp_path)
    try:
        _open_one(job, "r0", a)
    finally:
        job.close()
    shutil.copytree(environment_dir(a), environment_dir(b))
    _plant_tree_bomb(b)
    limit = TreeBudget().entries
    refusal = f"expands to more than {limit} entries"

    assert main(["verify", str(b)]) == 1
    err = capsys.readouterr().err
    assert refusal in err and "sandbox_read_max_entries" in err
    assert main(["inspect", str(b)]) == 0
    assert refusal in capsys.readouterr().out
    assert main(["diff", str(a), str(b)]) == 0
    assert refusal in capsys.readouterr().out
    with pytest.raises(SnapshotReadError, match=(
            rf"collection of .*blobs stopped, nothing was removed: the sandbox tree of r0 "
            rf"in {b} {refusal}")):
        collect_blobs(tmp_path / "ckpt")
    assert main(["gc", str(tmp_path / "ckpt")]) != 0
    assert refusal in capsys.readouterr().err
    assert expansions and max(expansions) <= limit

    shutil.rmtree(tmp_path / "sandboxes")
    fresh = sandbox_job(tmp_path, seed=1, sandbox_read_max_entries=5000)
    expansions.clear()
    try:
        async def restore() -> None:
            with pytest.raises(SandboxError, match=(
                    r"the sandbox tree of r0 \(attempt 0\) in .* expands to more than 5000 "
                    r"entries")):
                async with fresh.ckpt.restored(b):
                    pass
            for instance in fresh.holders():
                assert await (await fresh.client(instance)).sessions() == []

        fresh.run(restore())
    finally:
        fresh.close()
    assert expansions and max(expansions) <= 5000
