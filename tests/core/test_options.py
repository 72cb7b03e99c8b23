"""Option and path checks shared by the CLI and the examples; no Ray involved."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from nemo_ckpt.connect import ray_address
from nemo_ckpt.options import (
    at_least,
    non_negative_float,
    output_file_problem,
    positive_float,
    writable_folder_problem,
)

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("text", ["auto", "10.0.0.10:6379", "head:6379", "[::1]:6379",
                                  "ray://10.0.0.10:10001", " 127.0.0.1:6390 "])
def test_cluster_addresses_that_ray_init_takes(text: str) -> None:
    assert ray_address(text) == text.strip()


@pytest.mark.parametrize("text, needle", [
    ("", "is not a cluster address"),
    ("head", "is not a cluster address"),
    (":6379", "is not a cluster address"),
    ("head:0", "no valid port"),
    ("head:65536", "no valid port"),
    ("head:port", "no valid port"),
    ("http://head:6379", "is not a cluster address"),
    ("local", "would start a new, empty Ray instance"),
])
def test_other_addresses_are_usage_errors(text: str, needle: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=needle):
        ray_address(text)


def test_number_types_refuse_out_of_range_and_non_numbers() -> None:
    assert at_least(1)("3") == 3
    for bad, needle in (("0", "at least 1"), ("-1", "at least 1"), ("1.5", "whole number")):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            at_least(1)(bad)
    assert positive_float("0.5") == 0.5 and non_negative_float("0") == 0.0
    for parse, bad in ((positive_float, "0"), (positive_float, "nan"),
                       (non_negative_float, "-0.1"), (non_negative_float, "inf")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_a_writable_folder_passes_and_the_missing_folders_tried_are_removed(
        tmp_path: Path) -> None:
    assert writable_folder_problem(tmp_path / "a" / "b" / "c") is None
    assert list(tmp_path.iterdir()) == []
    assert writable_folder_problem(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_a_folder_under_a_file_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert writable_folder_problem(tmp_path / "file" / "ckpt") == f"{tmp_path / 'file'} " \
        "is not a folder"
    assert writable_folder_problem(Path("/dev/null/ckpt")) == "/dev/null is not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_folder_that_cannot_be_written_is_refused() -> None:
    # /proc refuses new entries even to root, for whom permission bits change nothing.
    problem = writable_folder_problem(Path("/proc/nemo-ckpt-test/ckpt"))
    assert problem is not None and problem.startswith("cannot write under /proc/")


def test_an_output_file_is_checked_without_being_written(tmp_path: Path) -> None:
    existing = tmp_path / "report.json"
    existing.write_text("old")
    assert output_file_problem(existing) is None
    assert existing.read_text() == "old"
    assert output_file_problem(tmp_path / "new" / "report.json") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    assert output_file_problem(tmp_path) == f"{tmp_path} is a folder"
    assert output_file_problem(Path("/dev/null/out.json")) == "/dev/null is not a folder"
