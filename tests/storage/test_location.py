"""A checkpoint path is a folder or a URL, never a URL taken for a folder."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from nemo_ckpt import CheckpointConfig
from nemo_ckpt.cli.main import main
from nemo_ckpt.errors import CheckpointPathError
from nemo_ckpt.storage.location import LocalLocation, ObjectLocation, join_location, parse_location

REPO = Path(__file__).resolve().parents[2]


def test_folders_stay_folders_and_urls_keep_bucket_and_prefix() -> None:
    assert parse_location("/mnt/ckpt/run-1") == LocalLocation(Path("/mnt/ckpt/run-1"))
    assert parse_location(Path("relative/ckpt")) == LocalLocation(Path("relative/ckpt"))
    assert parse_location("C:/ckpt") == LocalLocation(Path("C:/ckpt"))  # a drive, not a URL
    url = parse_location("s3://nemo/runs/demo/")
    assert url == ObjectLocation("s3", "nemo", "runs/demo")
    assert str(url) == "s3://nemo/runs/demo"
    assert str(parse_location("S3://nemo")) == "s3://nemo"
    assert join_location("s3://nemo/runs/", "a", "b") == "s3://nemo/runs/a/b"
    assert join_location("/mnt/ckpt", "a") == "/mnt/ckpt/a"


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


def test_the_config_keeps_a_url_as_text_and_a_folder_as_a_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert CheckpointConfig(checkpoint_root="s3://nemo/demo/").checkpoint_root == \
        "s3://nemo/demo"
    assert CheckpointConfig(checkpoint_root=str(tmp_path)).checkpoint_root == tmp_path
    with pytest.raises(ValidationError, match="pathlib.Path collapsed"):
        CheckpointConfig(checkpoint_root=Path("s3://nemo/demo"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("root", [Path("/shared/ckpt"), "s3://nemo/demo", None])
def test_the_config_round_trips_through_json_as_a_driver_hands_it_to_another(
        root: Path | str | None) -> None:
    config = CheckpointConfig(checkpoint_root=root)
    again = CheckpointConfig.model_validate_json(config.model_dump_json())
    assert again == config and type(again.checkpoint_root) is type(root)


@pytest.mark.parametrize("argv", [["inspect", str(Path("s3://nemo/demo"))],
                                  ["diff", "/tmp/a", "s3://nemo/a/../b"]])
def test_the_cli_refuses_a_malformed_url_as_a_usage_error(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert "checkpoint" in err and ("collapsed" in err or "segment" in err)


@pytest.mark.timeout(60)
def test_the_minimal_example_refuses_a_url_and_writes_no_folder_named_after_it(
        tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "minimal_driver.py"), "--checkpoint-dir",
         "s3://nemo/demo"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert "argument --checkpoint-dir: s3://nemo/demo is an object-store URL; this example " \
           "keeps RL's half" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_the_demo_takes_a_url_as_text_and_refuses_a_collapsed_one(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import turn_level_recovery
    finally:
        sys.path.remove(str(REPO / "examples"))
    args = turn_level_recovery.parse_args(["--checkpoint-dir", "s3://nemo/demo/"])
    assert args.options.checkpoint_dir == "s3://nemo/demo"
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "turn_level_recovery.py"),
         "--checkpoint-dir", "s3:/nemo/demo"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert "pathlib.Path collapsed" in done.stderr and "'s3://nemo/demo'" in done.stderr
    assert list(tmp_path.iterdir()) == []
