"""A user's mistakes fail closed, with an error that says what to do (issue 23): a
snapshot nobody checked against the cut, a relative root or a path outside it, a cut
adapter returning the wrong types. In-process, under virtual time, as
``tests/simulation/test_reliability.py``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.cut import check_rows_against_cut
from nemo_ckpt.errors import CheckpointPathError, UncheckedSnapshotError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.snapshot_files import read_manifest, read_snapshot
from tests.harness import CONFIG, World, files

pytestmark = pytest.mark.timeout(60)


def test_a_snapshot_whose_block_never_checked_the_cut_is_refused_and_the_last_one_stands(
        world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)
        first = read_manifest(path).snapshot_id
        before = files(path)
        with pytest.raises(UncheckedSnapshotError,
                           match=r"never called `await snapshot.check_against_cut\(cut\)`.*"
                                 r"allow_unchecked_snapshots=True"):
            async with world.ckpt.snapshot(path):
                pass  # RL saved its state, but nobody compared the capture with its ledger
        assert read_manifest(path).snapshot_id == first
        assert files(path) == before  # the refused snapshot left no shard behind
        assert set(world.states().values()) == {HolderState.RUNNING}

    world.run(scenario())


def test_allow_unchecked_snapshots_commits_a_snapshot_without_a_cut(world: World) -> None:
    path = world.path("ckpt")
    config = CheckpointConfig(**{**CONFIG.model_dump(), "allow_unchecked_snapshots": True})
    ckpt = world.checkpoint(world.driver, config)

    async def scenario() -> None:
        await world.populate()
        async with ckpt.snapshot(path) as snap:
            assert snap is not None
        loaded = read_snapshot(path)
        assert sum(len(v) for v in loaded.sessions.values()) == 6

    world.run(scenario())


def test_a_snapshot_of_a_backend_holding_nothing_commits_without_a_check(
        world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        async with world.ckpt.snapshot(path) as snap:
            assert snap is None  # nothing to check against
        assert not any(read_snapshot(path).sessions.values())

    world.run(scenario())


@pytest.mark.parametrize("field", ["checkpoint_root", "sandbox_root"])
def test_a_relative_root_is_refused_at_construction(field: str) -> None:
    values: dict[str, Any] = {"checkpoint_root": "/shared/ckpt", field: "ckpt/relative"}
    with pytest.raises(ValueError, match=rf"{field} 'ckpt/relative' is relative.*absolute"):
        CheckpointConfig(**values)


def test_a_relative_snapshot_or_restore_path_is_refused_at_the_call(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(world.root)

    async def scenario() -> None:
        live = await world.populate()
        with pytest.raises(CheckpointPathError, match="'ckpt' is relative.*absolute path"):
            await world.snapshot(Path("ckpt"), live)
        with pytest.raises(CheckpointPathError, match="'ckpt' is relative"):
            async with world.ckpt.restored(Path("ckpt")):
                pass
        assert not (world.root / "ckpt").exists()  # nothing was written anywhere
        assert set(world.states().values()) == {HolderState.RUNNING}

    world.run(scenario())


def test_a_snapshot_or_restore_path_outside_the_root_is_refused_naming_both(
        world: World) -> None:
    root = world.path("root")
    config = CheckpointConfig(**{**CONFIG.model_dump(), "checkpoint_root": root,
                                 "namespace": "rooted-job"})
    ckpt = world.checkpoint(world.driver, config)
    outside = world.path("elsewhere")

    async def scenario() -> None:
        await ckpt.ensure_holders()
        with pytest.raises(CheckpointPathError,
                           match=f"{outside} is not below CheckpointConfig.checkpoint_root "
                                 f"{root}"):
            async with ckpt.snapshot(outside):
                pass
        for sneaky in (root, root / ".." / "elsewhere"):
            with pytest.raises(CheckpointPathError, match="is not below"):
                async with ckpt.restored(sneaky):
                    pass
        assert not outside.exists()
        async with ckpt.snapshot(root / "step-1"):  # below the root, it works
            pass
        read_snapshot(root / "step-1")

    world.run(scenario())


class _Cut:
    """A cut adapter with whatever its methods return."""

    def __init__(self, expected: object, keys: object) -> None:
        self._expected, self._keys = expected, keys

    def require_live(self) -> None:
        pass

    def expected_episodes(self) -> Mapping[str, frozenset[Ep]]:
        return self._expected  # type: ignore[return-value]

    def staging_keys(self) -> frozenset[str]:
        return self._keys  # type: ignore[return-value]


CAPTURED = {"holder-0": [("r0", 0, frozenset({"r0/row0"}))]}
EXPECTED = {"holder-0": frozenset({Ep("r0", 0)})}


@pytest.mark.parametrize(("expected", "keys", "message"), [
    (EXPECTED, "r0/row0", r"staging_keys\(\) returned str, not a frozenset of staging keys"),
    (EXPECTED, {"r0/row0": 1}, r"staging_keys\(\) returned dict"),
    (EXPECTED, frozenset({b"r0/row0"}), r"staging_keys\(\) returned frozenset.*item is bytes"),
    ([("holder-0", Ep("r0", 0))], frozenset({"r0/row0"}),
     r"expected_episodes\(\) returned list, not a mapping"),
    ({"holder-0": Ep("r0", 0)}, frozenset({"r0/row0"}),
     r"expected_episodes\(\) returned EnvironmentEpisode, not a frozenset of "
     r"EnvironmentEpisode for 'holder-0'"),
    ({"holder-0": frozenset({("r0", 0)})}, frozenset({"r0/row0"}),
     r"expected_episodes\(\) returned frozenset.*an item is tuple"),
])
def test_a_cut_whose_methods_return_the_wrong_types_is_refused_naming_the_method(
        expected: object, keys: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        check_rows_against_cut(_Cut(expected, keys), CAPTURED)


def test_a_cut_of_the_right_types_passes() -> None:
    result = check_rows_against_cut(_Cut(EXPECTED, frozenset({"r0/row0", "orphan"})), CAPTURED)
    assert result.orphan_staging_keys == frozenset({"orphan"})
