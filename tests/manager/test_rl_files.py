"""``RlFiles``: RL's own files in a checkpoint path, on a folder and in the local S3
server's bucket (``tests/s3_server.py``, started only by the tests that ask for it):
written whole and read back, sync and async; reads bounded by the caller (a size is a
claim), JSON bounded in depth; a missing, oversized, non-regular or badly named file is
one line naming it."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt import RlFiles
from nemo_ckpt.errors import CheckpointPathError, RlFileInvalidError, RlFileNotFoundError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["folder", "bucket"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "folder":
        return str(tmp_path / "rollout-1")
    server = request.getfixturevalue("s3_server")
    return str(server.url(f"rl-files-{uuid.uuid4().hex[:8]}/rollout-1"))


def test_rl_files_are_written_whole_and_read_back_sync_and_async(where: str) -> None:
    files = RlFiles(where)
    files.write("ledger.bin", b"\x00ledger\xff")
    files.write_json("controller.json", {"next_prompt": 7, "groups": ["g1", "g2"]})

    async def on_a_loop() -> tuple[bytes, Any, list[str]]:
        await files.write_async("staging.bin", b"rows")
        await files.write_json_async("more.json", [1, 2, 3])
        return (await files.read_async("staging.bin", max_bytes=4),
                await files.read_json_async("more.json", max_bytes=100),
                await files.names_async())

    staging, more, listed = asyncio.run(on_a_loop())
    assert files.read("ledger.bin", max_bytes=100) == b"\x00ledger\xff"
    assert files.read_json("controller.json", max_bytes=1000) == {
        "next_prompt": 7, "groups": ["g1", "g2"]}
    assert (staging, more) == (b"rows", [1, 2, 3])
    assert listed == ["controller.json", "ledger.bin", "more.json", "staging.bin"]
    files.write("ledger.bin", b"v2")  # replaced whole
    assert files.read("ledger.bin", max_bytes=2) == b"v2"
    asyncio.run(files.remove_async(["ledger.bin", "never-written"]))
    files.remove(["more.json"])
    assert files.names() == ["controller.json", "staging.bin"]


def test_a_read_past_its_bound_or_of_a_missing_file_is_one_line_naming_it(where: str) -> None:
    files = RlFiles(where)
    files.write("ledger.bin", b"x" * 1000)
    with pytest.raises(RlFileInvalidError, match=r"^RL's file \S+ledger.bin is larger than "
                       r"the 999 bytes its reader allows: damaged or not RL's; raise "
                       r"max_bytes if RL writes that much$"):
        files.read("ledger.bin", max_bytes=999)
    with pytest.raises(RlFileNotFoundError, match=r"^RL's file \S+absent.json does not "
                       r"exist: the snapshot's RL half did not write it"):
        files.read_json("absent.json", max_bytes=100)
    with pytest.raises(RlFileNotFoundError):
        asyncio.run(files.read_async("absent.json", max_bytes=100))


def test_stored_json_nested_past_the_bound_or_not_json_is_refused(where: str) -> None:
    files = RlFiles(where)
    files.write("deep.json", b"[" * 100_000 + b"]" * 100_000)
    files.write("torn.json", b'{"ledger": [1, 2')
    with pytest.raises(RlFileInvalidError, match=r"deep.json is JSON nested too deeply "
                                                 r"\(more than 64 levels"):
        files.read_json("deep.json", max_bytes=300_000)
    with pytest.raises(RlFileInvalidError, match=r"torn.json is not valid JSON"):
        files.read_json("torn.json", max_bytes=100)


def test_a_fifo_in_place_of_rls_file_is_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    files = RlFiles(tmp_path)
    os.mkfifo(tmp_path / "ledger.bin")  # its open would wait for a writer for ever
    with pytest.raises(CheckpointPathError, match=r"^cannot read RL's file \S+ledger.bin: "
                                                  r".*FIFO"):
        files.read("ledger.bin", max_bytes=100)


def test_names_that_are_not_rls_to_write_are_refused_with_what_to_do(tmp_path: Path) -> None:
    files = RlFiles(tmp_path)
    with pytest.raises(ValueError, match=r"^RL's file name '../escape' is not a plain file "
                                         r"name \(no folders, no '..'\)"):
        files.write("../escape", b"x")
    with pytest.raises(ValueError, match=r"^'rollout_checkpoint.json' is nemo-ckpt's own in "
                                         r"a checkpoint path; give RL's file another name$"):
        files.write("rollout_checkpoint.json", b"{}")
    with pytest.raises(TypeError, match=r"cannot be written as JSON: .*bytes.*; encode such "
                                        r"values first \(bytes as hex or base64\)$"):
        files.write_json("state.json", {"row": b"tokens"})
    with pytest.raises(ValueError, match=r"^max_bytes must be an int >= 0, not -1$"):
        files.read("state.json", max_bytes=-1)
    assert not (tmp_path.parent / "escape").exists()
    assert list(tmp_path.iterdir()) == []


def test_names_leave_out_the_environments_folder_and_the_managers_record(
        tmp_path: Path) -> None:
    (tmp_path / "environment").mkdir()
    (tmp_path / "rollout_checkpoint.json").write_text("{}")
    files = RlFiles(tmp_path)
    files.write("nemo_rl_state.json", b"{}")
    assert files.names() == ["nemo_rl_state.json"]
