"""The cut check: a capture against RL's ledger and staging rows at the cut."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_ckpt.cut import DataPlaneMutationCut, check_capture_against_cut
from nemo_ckpt.errors import SnapshotMismatchError, StaleCutError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.testing import StaticCut

Captured = dict[str, dict[Ep, frozenset[str]]]


@st.composite
def consistent_worlds(draw: st.DrawFn) -> tuple[Captured, frozenset[str]]:
    """A capture of 1..4 instances whose rollouts are distinct, and the rows they use."""
    n_instances = draw(st.integers(1, 4))
    rollout_ids = draw(
        st.lists(st.from_regex(r"r[a-z0-9]{1,6}", fullmatch=True), min_size=1,
                 max_size=12, unique=True)
    )
    captured: Captured = {f"holder-{i}": {} for i in range(n_instances)}
    rows: set[str] = set()
    for rid in rollout_ids:
        inst = f"holder-{draw(st.integers(0, n_instances - 1))}"
        attempt = draw(st.integers(0, 3))
        keys = frozenset(f"{rid}/t{t}" for t in range(draw(st.integers(0, 3))))
        captured[inst][Ep(rid, attempt)] = keys
        rows |= keys
    extra_rows = draw(st.frozensets(st.from_regex(r"orphan-[0-9]{1,3}", fullmatch=True),
                                    max_size=3))
    return captured, frozenset(rows) | extra_rows


def cut_for(captured: Captured, rows: frozenset[str]) -> StaticCut:
    return StaticCut({i: frozenset(s) for i, s in captured.items()}, rows)


def all_episodes(captured: Captured) -> list[tuple[str, Ep]]:
    return sorted((i, ep) for i, s in captured.items() for ep in s)


def test_static_cut_satisfies_the_protocol() -> None:
    assert isinstance(StaticCut({}), DataPlaneMutationCut)


@given(consistent_worlds())
def test_capture_equal_to_expectation_passes_and_reports_orphans(
    world: tuple[Captured, frozenset[str]],
) -> None:
    captured, rows = world
    result = check_capture_against_cut(cut_for(captured, rows), captured)
    assert result.not_held == frozenset()
    referenced = frozenset().union(*(k for s in captured.values() for k in s.values()))
    assert result.orphan_staging_keys == rows - referenced
    assert all(k.startswith("orphan-") for k in result.orphan_staging_keys)


@given(consistent_worlds(), st.data())
def test_an_added_episode_is_named(world: tuple[Captured, frozenset[str]],
                                   data: st.DataObject) -> None:
    captured, rows = world
    cut = cut_for(captured, rows)
    inst = data.draw(st.sampled_from(sorted(captured)))
    captured[inst][Ep("intruder", 0)] = frozenset()
    with pytest.raises(SnapshotMismatchError) as err:
        check_capture_against_cut(cut, captured)
    assert [(d.kind, d.instance_id, d.rollout_id) for d in err.value.differences] == [
        ("unexpected_episode", inst, "intruder")
    ]
    assert f"{inst}/intruder" in str(err.value)


@given(consistent_worlds(), st.data())
def test_a_bumped_attempt_is_named(world: tuple[Captured, frozenset[str]],
                                   data: st.DataObject) -> None:
    captured, rows = world
    cut = cut_for(captured, rows)
    inst, ep = data.draw(st.sampled_from(all_episodes(captured)))
    keys = captured[inst].pop(ep)
    captured[inst][ep.next_attempt()] = keys
    with pytest.raises(SnapshotMismatchError) as err:
        check_capture_against_cut(cut, captured)
    assert [(d.kind, d.instance_id, d.rollout_id, d.attempt)
            for d in err.value.differences] == [
        ("wrong_attempt", inst, ep.rollout_id, ep.attempt + 1)
    ]
    assert ep.next_attempt().capture_key in str(err.value)


@given(consistent_worlds(), st.data())
def test_a_rollout_on_a_second_instance_is_named(world: tuple[Captured, frozenset[str]],
                                                 data: st.DataObject) -> None:
    captured, rows = world
    cut = cut_for(captured, rows)
    inst, ep = data.draw(st.sampled_from(all_episodes(captured)))
    other = f"holder-{len(captured)}"
    captured[other] = {ep: captured[inst][ep]}
    with pytest.raises(SnapshotMismatchError) as err:
        check_capture_against_cut(cut, captured)
    found = {(d.kind, d.instance_id) for d in err.value.differences}
    assert found == {
        ("unexpected_episode", other),
        ("duplicate_rollout", inst),
        ("duplicate_rollout", other),
    }
    assert all(d.rollout_id == ep.rollout_id for d in err.value.differences)


@given(consistent_worlds(), st.data())
def test_a_removed_staging_key_is_named(world: tuple[Captured, frozenset[str]],
                                        data: st.DataObject) -> None:
    captured, rows = world
    referenced = sorted(frozenset().union(*(k for s in captured.values() for k in s.values())))
    if not referenced:
        inst, ep = all_episodes(captured)[0]
        captured[inst][ep] = frozenset({"only-row"})
        rows = rows | {"only-row"}
        referenced = ["only-row"]
    key = data.draw(st.sampled_from(referenced))
    cut = cut_for(captured, rows - {key})
    with pytest.raises(SnapshotMismatchError) as err:
        check_capture_against_cut(cut, captured)
    assert {d.kind for d in err.value.differences} == {"missing_staging_key"}
    assert all(key in d.detail for d in err.value.differences)
    assert repr(key) in str(err.value)


@given(consistent_worlds(), st.data())
def test_a_dropped_episode_passes_and_is_reported_not_held(
    world: tuple[Captured, frozenset[str]], data: st.DataObject
) -> None:
    captured, rows = world
    cut = cut_for(captured, rows)
    inst, ep = data.draw(st.sampled_from(all_episodes(captured)))
    dropped_keys = captured[inst].pop(ep)
    result = check_capture_against_cut(cut, captured)
    assert result.not_held == frozenset({(inst, ep)})
    # The dropped session's rows are no longer referenced: a restore clears them.
    still = frozenset().union(*(k for s in captured.values() for k in s.values()))
    assert result.orphan_staging_keys >= dropped_keys - still


def test_every_difference_is_listed_not_only_the_first() -> None:
    captured: Captured = {"holder-0": {Ep("a", 0): frozenset({"a/0"})},
                          "holder-1": {Ep("b", 0): frozenset({"b/0"})}}
    cut = cut_for(captured, frozenset({"a/0", "b/0"}))
    captured["holder-0"][Ep("x", 0)] = frozenset()
    captured["holder-1"] = {Ep("b", 2): frozenset({"b/0", "gone"})}
    with pytest.raises(SnapshotMismatchError) as err:
        check_capture_against_cut(cut, captured)
    kinds = sorted((d.kind, d.rollout_id) for d in err.value.differences)
    assert kinds == [("missing_staging_key", "b"), ("unexpected_episode", "x"),
                     ("wrong_attempt", "b")]
    assert "3 difference(s)" in str(err.value)


def test_a_restarting_episode_is_neither_an_error_nor_not_held() -> None:
    ep_a, ep_b = Ep("a", 0), Ep("b", 1)
    cut = StaticCut({"holder-0": {ep_a, ep_b}}, {"a/0", "b/0"})
    result = check_capture_against_cut(
        cut, {"holder-0": {ep_a: frozenset({"a/0"})}}, {"holder-0": frozenset({ep_b})}
    )
    assert result.not_held == frozenset()
    assert result.restarting == frozenset({("holder-0", ep_b)})
    assert result.orphan_staging_keys == frozenset({"b/0"})


def test_a_rollout_captured_on_one_instance_and_restarting_on_another_is_refused() -> None:
    ep = Ep("a", 0)
    cut = StaticCut({"holder-0": {ep}}, set())
    with pytest.raises(SnapshotMismatchError) as err:
        check_capture_against_cut(cut, {"holder-0": {ep: frozenset()}},
                                  {"holder-1": frozenset({ep})})
    assert {(d.kind, d.instance_id) for d in err.value.differences} == {
        ("duplicate_rollout", "holder-0"), ("duplicate_rollout", "holder-1")}


def test_a_stale_cut_is_refused_before_anything_else() -> None:
    # The capture is wrong too; the stale cut must win, since nothing it says counts.
    cut = StaticCut({}, set())
    cut.expire()
    with pytest.raises(StaleCutError, match="stale"):
        check_capture_against_cut(cut, {"holder-0": {Ep("x", 0): frozenset({"k"})}})


def test_a_rollout_unknown_to_the_ledger_says_so() -> None:
    cut = StaticCut({"holder-0": set()}, set())
    with pytest.raises(SnapshotMismatchError, match="no unfinished attempt"):
        check_capture_against_cut(cut, {"holder-0": {Ep("ghost", 0): frozenset()}})
