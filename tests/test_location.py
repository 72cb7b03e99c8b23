"""A checkpoint path is a folder or a URL, never a URL taken for a folder."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from nemo_ckpt import CheckpointConfig
from nemo_ckpt.cli import main
from nemo_ckpt.errors import CheckpointPathError
from nemo_ckpt.location import LocalLocation, ObjectLocation, local_path, parse_location

REPO = Path(__file__).resolve().parent.parent


def test_folders_stay_folders_and_urls_keep_bucket_and_prefix() -> None:
    assert parse_location("/mnt/ckpt/run-1") == LocalLocation(Path("/mnt/ckpt/run-1"))
    assert parse_location(Path("relative/ckpt")) == LocalLocation(Path("relative/ckpt"))
    assert parse_location("C:/ckpt") == LocalLocation(Path("C:/ckpt"))  # a drive, not a URL
    url = parse_location("s3://nemo/runs/demo/")
    assert url == ObjectLocation("s3", "nemo", "runs/demo")
    assert str(url) == "s3://nemo/runs/demo"
    assert str(parse_location("S3://nemo")) == "s3://nemo"


@pytest.mark.parametrize("text, needle", [
    ("s3://", "names no bucket"),
    ("s3://nemo/a//b", "empty, '.' or '..' segment"),
    ("s3://nemo/a/../b", "empty, '.' or '..' segment"),
    ("s3://nemo/p?versionId=3", "has a query or fragment"),
    (str(Path("s3://nemo/demo")), "pathlib.Path collapsed"),
])
def test_malformed_urls_are_refused_with_what_to_write(text: str, needle: str) -> None:
    with pytest.raises(CheckpointPathError, match=re.escape(needle)):
        parse_location(text)


def test_a_url_is_refused_where_a_folder_is_needed_and_nothing_is_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointPathError, match="is an object-store URL"):
        local_path("s3://nemo/demo")
    with pytest.raises(ValidationError, match="is an object-store URL"):
        CheckpointConfig(checkpoint_root="s3://nemo/demo")  # type: ignore[arg-type]
    assert CheckpointConfig(checkpoint_root=tmp_path).checkpoint_root == tmp_path
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["inspect", "s3://nemo/demo"], ["verify", "gs://nemo/demo"],
                                  ["diff", "/tmp/a", "s3://nemo/demo"]])
def test_the_cli_refuses_a_url_as_a_usage_error(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert "is an object-store URL, which this nemo-ckpt cannot write or read yet" in err


@pytest.mark.timeout(60)
def test_the_demo_refuses_a_url_and_writes_no_folder_named_after_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "turn_level_recovery.py"),
         "--checkpoint-dir", "s3://nemo/demo"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert "argument --checkpoint-dir: checkpoint path s3://nemo/demo is an object-store " \
           "URL" in done.stderr
    assert list(tmp_path.iterdir()) == []
