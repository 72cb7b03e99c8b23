"""A format-6 shard is verified chunk by chunk as it is read, and a chunk is decoded
only once its own hash matches the manifest's; older formats still restore and verify."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.cli.main import main as cli_main
from nemo_ckpt.errors import ManifestInvalidError, ShardCorruptedError
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.hashed_files import CHUNK_BYTES
from nemo_ckpt.storage.manifest import ENVIRONMENT_DIR, FORMAT_VERSION, MANIFEST_NAME, Manifest
from nemo_ckpt.storage.shards import read_shard_parts
from nemo_ckpt.storage.snapshot_files import read_manifest, read_snapshot
from tests.storage.test_object_folder import session, write_snapshot

pytestmark = pytest.mark.timeout(60)

# Three chunks and a bit: sessions of 700 KiB spread over chunk boundaries.
RECORDS = [session("holder-0", f"r{i}", state=os.urandom(700 << 10)) for i in range(5)]


def snapshot(root: Path) -> tuple[Manifest, Path]:
    manifest = write_snapshot(str(root), {"holder-0": RECORDS, "holder-1": []})
    return manifest, root / ENVIRONMENT_DIR / manifest.shards[0].file


def test_a_snapshot_is_written_as_format_6_with_a_hash_per_chunk(tmp_path: Path) -> None:
    manifest, shard = snapshot(tmp_path)
    entry = manifest.shards[0]
    assert manifest.format_version == FORMAT_VERSION == 6
    assert entry.chunks is not None and entry.chunks.bytes == CHUNK_BYTES
    assert len(entry.chunks.hashes) == -(-shard.stat().st_size // CHUNK_BYTES) == 4
    assert read_snapshot(tmp_path).sessions == {"holder-0": RECORDS, "holder-1": []}


def decoded(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every byte given to the decoder (msgpack's for the index, the in-place parse of
    the bodies), from here on: the chunks the shard's stream takes in."""
    import nemo_ckpt.storage.shards as shards

    given: list[bytes] = []
    stream = shards._VerifiedStream
    original = stream.pull

    def pull(self: Any) -> bool:
        took = original(self)
        if took:
            given.append(bytes(self._pieces[-1][1]))
        return took

    monkeypatch.setattr(stream, "pull", pull)
    return given


@pytest.mark.parametrize("chunk", [0, 2])
def test_a_crafted_chunk_is_refused_before_any_of_it_is_decoded(
        tmp_path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest, shard = snapshot(tmp_path)
    original = shard.read_bytes()
    data = bytearray(original)
    start = chunk * CHUNK_BYTES
    # msgpack's one never-used byte: decoding any of it would fail differently.
    data[start:start + CHUNK_BYTES] = b"\xc1" * len(data[start:start + CHUNK_BYTES])
    shard.write_bytes(bytes(data))
    given = decoded(monkeypatch)
    with pytest.raises(ShardCorruptedError) as caught:
        read_shard_parts(environment_folder(tmp_path), manifest.shards[0])
    assert f"chunk {chunk + 1} of 4 of shard {shard}" in str(caught.value)
    assert "restore an earlier checkpoint" in str(caught.value)
    # Only the chunks before the crafted one reached the decoder, as written.
    seen = b"".join(given)
    assert len(seen) <= start and seen == original[:len(seen)]


def test_a_shard_truncated_inside_a_chunk_is_refused(tmp_path: Path) -> None:
    manifest, shard = snapshot(tmp_path)
    size = shard.stat().st_size
    os.truncate(shard, CHUNK_BYTES * 2 + 100)
    with pytest.raises(ShardCorruptedError) as caught:
        read_snapshot(tmp_path)
    message = str(caught.value)
    assert f"ends after {CHUNK_BYTES * 2 + 100} bytes" in message
    assert f"the manifest says {size}" in message and "truncated" in message


def test_a_shard_longer_than_its_manifest_says_is_refused(tmp_path: Path) -> None:
    _, shard = snapshot(tmp_path)
    with open(shard, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ShardCorruptedError, match="is longer than"):
        read_snapshot(tmp_path)


def test_a_manifest_whose_chunk_list_does_not_cover_its_shard_is_refused(
        tmp_path: Path) -> None:
    snapshot(tmp_path)
    path = tmp_path / ENVIRONMENT_DIR / MANIFEST_NAME
    data = json.loads(path.read_bytes())
    data["shards"][0]["chunks"]["hashes"].pop()
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestInvalidError, match="has 4 chunks, not 3"):
        read_manifest(tmp_path)


def test_a_claimed_chunk_size_out_of_bounds_is_refused_before_a_read(tmp_path: Path) -> None:
    snapshot(tmp_path)
    path = tmp_path / ENVIRONMENT_DIR / MANIFEST_NAME
    data = json.loads(path.read_bytes())
    data["shards"][0]["chunks"]["bytes"] = 1 << 40
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestInvalidError):
        read_manifest(tmp_path)


def as_format(root: Path, version: int) -> None:
    """Rewrite the manifest under ``root`` as the format before chunk hashes wrote it."""
    path = root / ENVIRONMENT_DIR / MANIFEST_NAME
    data = json.loads(path.read_bytes())
    data["format_version"] = version
    for shard in data["shards"]:
        del shard["chunks"]
    path.write_text(json.dumps(data))


def test_an_older_format_snapshot_still_restores_verifies_and_inspects(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot(tmp_path)
    as_format(tmp_path, 3)
    loaded = read_snapshot(tmp_path)
    assert loaded.manifest.format_version == 3
    assert loaded.sessions == {"holder-0": RECORDS, "holder-1": []}
    assert cli_main(["verify", str(tmp_path)]) == 0
    assert cli_main(["inspect", str(tmp_path)]) == 0
    assert " r4 " in capsys.readouterr().out


def test_verify_and_inspect_read_a_format_6_snapshot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, shard = snapshot(tmp_path)
    assert cli_main(["verify", str(tmp_path)]) == 0
    assert cli_main(["inspect", str(tmp_path)]) == 0
    assert " r4 " in capsys.readouterr().out
    data = bytearray(shard.read_bytes())
    data[-10] ^= 1
    shard.write_bytes(bytes(data))
    assert cli_main(["verify", str(tmp_path)]) == 1
    assert "chunk 4 of 4" in capsys.readouterr().err


def test_a_format_6_manifest_without_chunk_hashes_is_refused(tmp_path: Path) -> None:
    snapshot(tmp_path)
    as_format(tmp_path, 6)
    with pytest.raises(ManifestInvalidError, match="chunk hashes"):
        read_manifest(tmp_path)
