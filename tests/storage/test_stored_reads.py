"""Every read of a checkpoint root is a regular file's (issue 50, case 5), and every JSON
read from storage goes through one bounded decoder (case 6): a FIFO or a link planted
where nemo-ckpt expects a file ends each command at once with one line, and JSON nested
past the bound is a one-line refusal, never a ``RecursionError``.

A FIFO's open blocked for ever before: every test here has a timeout, so a regression
fails rather than hangs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nemo_ckpt.catalog.listing import list_snapshots
from nemo_ckpt.cli.main import main
from nemo_ckpt.errors import CheckpointPathError
from nemo_ckpt.storage.local_folder import LocalFolder
from nemo_ckpt.storage.path_claims import read_claims
from nemo_ckpt.storage.snapshot_files import read_manifest
from nemo_ckpt.storage.store_errors import NotARegularFileError
from nemo_ckpt.storage.stored_json import MAX_DEPTH, StoredJsonError, load_stored_json
from tests.catalog.test_listing import snap
from tests.harness import World

pytestmark = pytest.mark.timeout(60)

PLANTS = ("fifo", "symlink")


def plant(where: Path, kind: str) -> str:
    """A FIFO, or a link to a real manifest elsewhere, at ``where``; what the refusal
    calls it."""
    where.parent.mkdir(parents=True, exist_ok=True)
    where.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(where)
        return "is a FIFO, not a regular file"
    elsewhere = where.parent.parent.parent / "elsewhere.json"
    elsewhere.write_text("{}")
    os.symlink(elsewhere, where)
    return "is a symbolic link, not a regular file"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpt"
    snap(r / "step-1", "s1", 1)
    snap(r / "step-2", "s2", 2)
    return r


@pytest.mark.parametrize("kind", PLANTS)
@pytest.mark.parametrize("command", ["ls", "ls --latest", "gc", "verify", "inspect"])
def test_each_command_ends_at_once_naming_a_fifo_or_link_planted_as_a_manifest(
        root: Path, kind: str, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = root / "step-2" / "environment" / "manifest.json"
    said = plant(manifest, kind)
    target = root / "step-2" if command in ("verify", "inspect") else root
    code = main([*command.split(), str(target)])
    out, err = capsys.readouterr()
    # ls lists it apart (and --latest passes over it to step-1); the others refuse.
    assert code == (0 if command.startswith("ls") else 1)
    assert len(err.splitlines()) == 1
    assert f"{manifest} {said}" in err and "remove it" in err
    if command == "ls --latest":
        assert out.strip() == str(root / "step-1")
    assert manifest.is_symlink() == (kind == "symlink")  # left as it was


@pytest.mark.parametrize("kind", PLANTS)
def test_a_jobs_commit_passes_over_a_fifo_or_link_planted_as_another_snapshots_manifest(
        world: World, kind: str) -> None:
    # The commit numbers itself past every manifest under the root: it read this one.
    planted = world.root / "planted" / "environment" / "manifest.json"
    plant(planted, kind)
    # A read that waits on the FIFO is reported (and freed) by the world's guard.
    world.sim.fifos.append(str(planted))
    blocked: list[str] = []
    world.sim.on_blocked = lambda actor, name, where: blocked.append(f"{name} in {where}")
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)

    world.run(scenario())
    assert blocked == []
    assert read_manifest(path).sequence == 1
    listed = {s.path: s for s in list_snapshots(world.root)}
    assert listed[str(path)].readable
    assert "not a regular file" in str(listed[str(world.root / "planted")].error)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder"])
def test_every_read_of_a_local_folder_refuses_what_is_not_a_regular_file(
        tmp_path: Path, kind: str) -> None:
    folder = LocalFolder(tmp_path / "f")
    folder.prepare()
    if kind == "folder":
        (folder.path / "x").mkdir()
    else:
        plant(folder.path / "x", kind)
    for read in (lambda: folder.read("x"), lambda: folder.read("x", 10),
                 lambda: folder.read_view("x"), lambda: list(folder.read_chunks("x", 10, 4)),
                 lambda: folder.open_read("x").__enter__()):
        with pytest.raises(NotARegularFileError, match=r"/f/x is a .*, not a regular file"):
            read()


def test_a_fifo_planted_as_a_claim_stops_a_clean_up_at_once_in_one_line(
        tmp_path: Path) -> None:
    folder = LocalFolder(tmp_path / "env")
    folder.prepare()
    os.mkfifo(folder.path / ".claim-x.json")
    with pytest.raises(CheckpointPathError, match=r"cannot read the claim .*is a FIFO"):
        read_claims(folder)


def test_a_record_a_manifest_or_a_claim_nested_past_the_bound_is_one_line_not_recursion(
) -> None:
    deep = b'{"format": 1, "fingerprint": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    assert len(deep) < 256 * 1024  # under the record's size bound
    with pytest.raises(StoredJsonError, match=r"^rec is JSON nested too deeply \(more than "
                                              r"64 levels.*damaged or not ours$"):
        load_stored_json(deep, "rec", 256 * 1024)
    # Never opened, and not closed: the parsers would recurse as deep as the openers.
    with pytest.raises(StoredJsonError, match="nested too deeply"):
        load_stored_json(b"[" * 100_000, "rec", 256 * 1024)
    with pytest.raises(StoredJsonError, match="larger than 100 bytes"):
        load_stored_json(b" " * 101, "rec", 100)
    with pytest.raises(StoredJsonError, match=r"not valid JSON \(not UTF-8 at byte 1\)"):
        load_stored_json(b'"\xff"', "rec", 100)


def test_the_bound_counts_only_structure_not_brackets_inside_strings() -> None:
    at_bound = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert load_stored_json(at_bound, "w", 1 << 20) == json.loads(at_bound)
    with pytest.raises(StoredJsonError):
        load_stored_json("[" + at_bound + "]", "w", 1 << 20)
    # Brackets and escaped quotes inside strings are not structure.
    strings = {"k[": "[" * 200, "e": '\\"[[[' * 50, "b": "\\" * 3, "q": '"{' * 70}
    assert load_stored_json(json.dumps(strings), "w", 1 << 20) == strings
    # An escaped backslash ends before the quote: that quote closes the string.
    with pytest.raises(StoredJsonError):
        load_stored_json(b'["\\\\", ' + b"[" * 70 + b"]" * 70 + b"]", "w", 1 << 20)
