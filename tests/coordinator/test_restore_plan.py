"""A restore's plan decided without actors: placement, shard assignment, and the checks
of what the holders read (``actors.coordinator.restore_plan``)."""

from __future__ import annotations

import pickle
from datetime import datetime, timezone

import msgpack
import pytest

from actors.coordinator.restore_plan import (
    assign_shards,
    conflict_error,
    holder_said,
    least_loaded_node,
    place_instances,
    verify_prepared,
)
from nemo_ckpt.errors import BackendUnavailableError, RestoreConflictError, ShardCorruptedError
from nemo_ckpt.phases import ChunkHashes, RestorePrepared, ShardRef
from nemo_ckpt.shard_refs import shard_entry, shard_ref
from nemo_ckpt.storage.manifest import (
    MIN_CHUNK_BYTES,
    Manifest,
    ShardChunks,
    ShardEntry,
    TreesEntry,
    encode_manifest,
    rollouts_by_shard,
)

HASH = "xxh3-128:" + "0" * 32


def _shard(instance: str, sessions: int) -> ShardEntry:
    return ShardEntry(file=f"shard-{instance}.msgpack", bytes=10, content_hash=HASH,
                      instance_id=instance, sessions=sessions,
                      chunks=ShardChunks(bytes=MIN_CHUNK_BYTES, hashes=["0" * 32]))


def _manifest(*shards: ShardEntry, instances: list[str] | None = None) -> Manifest:
    return Manifest.model_validate_json(encode_manifest(
        snapshot_id="snap-1", created_at=datetime.now(timezone.utc),
        instances=instances or sorted({s.instance_id for s in shards}),
        shards=list(shards), restarted_rollouts=0, metrics={}))


def _prepared(instance: str, sessions: list[tuple[str, int]], live: tuple[str, ...] = (),
              staging: frozenset[str] = frozenset(), read_seconds: float = 0.1
              ) -> RestorePrepared:
    return RestorePrepared(
        instance_id=instance, staging_keys=staging, bytes_read=100 * len(sessions),
        read_seconds=read_seconds,
        shard_sessions=((f"shard-{instance}.msgpack", msgpack.packb(sessions)),),
        live_rollouts=msgpack.packb(list(live)))


def test_a_new_holder_goes_to_the_alive_node_with_the_fewest_holders() -> None:
    assert least_loaded_node(["n1", "n2", "n3"], ["n1", "n1", "n3", "gone"]) == "n2"
    assert least_loaded_node(["n2", "n1"], ["n1", "n2"]) == "n1"  # ties: smallest id


def test_placement_with_no_alive_node_is_refused_as_unavailable() -> None:
    with pytest.raises(BackendUnavailableError, match="no alive Ray node"):
        least_loaded_node([], ["n1"])


def test_each_instance_reads_only_its_own_shards() -> None:
    manifest = _manifest(_shard("holder-0", 2), _shard("holder-1", 1))
    shards = assign_shards([shard_ref(s) for s in manifest.shards],
                           ["holder-0", "holder-1", "holder-2"], "/ckpt/a")
    assert {i: [s.file for s in ss] for i, ss in shards.items()} == {
        "holder-0": ["shard-holder-0.msgpack"], "holder-1": ["shard-holder-1.msgpack"],
        "holder-2": []}


def test_a_shard_whose_instance_has_no_holder_refuses_the_restore() -> None:
    manifest = _manifest(_shard("holder-0", 1), _shard("holder-1", 1))
    with pytest.raises(BackendUnavailableError, match="instance holder-1 of /ckpt/a"):
        assign_shards([shard_ref(s) for s in manifest.shards], ["holder-0"], "/ckpt/a")


def test_what_the_holders_read_becomes_the_continued_attempts() -> None:
    manifest = _manifest(_shard("holder-0", 2), _shard("holder-1", 1))
    verified = verify_prepared(rollouts_by_shard(manifest), "/ckpt/a/environment", "/ckpt/a", {
        "holder-0": _prepared("holder-0", [("r0", 0), ("r1", 2)], staging=frozenset({"k"}),
                              read_seconds=0.5),
        "holder-1": _prepared("holder-1", [("r2", 1)], read_seconds=0.2)})
    assert verified.continued_attempts == {("holder-0", "r0", 0), ("holder-0", "r1", 2),
                                           ("holder-1", "r2", 1)}
    assert verified.staging_keys == {"k"}
    assert verified.bytes_read == 300 and verified.read_seconds == 0.5


def test_a_rollout_in_two_shards_is_refused_as_corrupt() -> None:
    manifest = _manifest(_shard("holder-0", 1), _shard("holder-1", 1))
    with pytest.raises(ShardCorruptedError, match=r"rollouts held by two shards .*\['r0'\]"):
        verify_prepared(rollouts_by_shard(manifest), "/ckpt/a/environment", "/ckpt/a", {
            "holder-0": _prepared("holder-0", [("r0", 0)]),
            "holder-1": _prepared("holder-1", [("r0", 0)])})


def test_a_rollout_live_now_refuses_the_restore_naming_every_holder_and_the_fix() -> None:
    manifest = _manifest(_shard("holder-0", 1), _shard("holder-1", 1), _shard("holder-2", 1))
    with pytest.raises(RestoreConflictError) as refused:
        verify_prepared(rollouts_by_shard(manifest), "/ckpt/a/environment", "/ckpt/a", {
            "holder-0": _prepared("holder-0", [("r0", 0)]),
            "holder-1": _prepared("holder-1", [("r5", 0)], live=["r0", "r9"]),
            "holder-2": _prepared("holder-2", [("r7", 0)], live=["r5"])})
    message = str(refused.value)
    assert ("live now on 2 holder(s), holder-1, holder-2 (holder-1: r0; holder-2: r5)"
            in message)
    assert "shutdown(wait=True)" in message and "retire or close them first" in message


def test_a_conflict_names_ten_rollouts_per_holder_and_counts_the_rest() -> None:
    message = str(conflict_error("/ckpt/a", {"holder-0": [f"r{k:02d}" for k in range(12)]}))
    assert "(holder-0: r00, r01, r02, r03, r04, r05, r06, r07, r08, r09 and 2 more)" in message


def test_a_holders_own_conflict_loses_only_the_fix_the_whole_error_gives() -> None:
    live = RestoreConflictError("holder-3: cannot restore rollouts ['r1']: sessions of them "
                                "are live here; retire or close them first, or restore "
                                "into a fresh job")
    assert holder_said("holder-3", live) == ("cannot restore rollouts ['r1']: sessions of "
                                             "them are live here")
    directory = RestoreConflictError("holder-3: cannot restore the directory of r1-a0: /s/x "
                                     "already exists; remove it, or restore into a fresh job")
    assert holder_said("holder-3", directory).endswith("already exists; remove it, or "
                                                       "restore into a fresh job")


def test_holders_placed_together_spread_as_if_created_one_by_one() -> None:
    assert place_instances(["a", "b", "c", "d"], ["n1", "n2", "n3"], ["n1", "gone"]) == [
        ("a", "n2"), ("b", "n3"), ("c", "n1"), ("d", "n2")]
    assert place_instances([], ["n1"], []) == []


def test_a_manifests_shard_crosses_the_wire_and_comes_back_as_the_manifest_holds_it() -> None:
    # Every field the format carries: trees, chunk hashes, finished rollouts.
    trees = TreesEntry(file="shard-s-holder-0-trees.msgpack", bytes=7, content_hash=HASH,
                       sandboxes=1, blobs=3, new_blobs=2, new_blob_bytes=40)
    entry = _shard("holder-0", 2).model_copy(update={"trees": trees, "finished": 1})
    wired = pickle.loads(pickle.dumps(shard_ref(entry)))  # as a call carries it
    assert isinstance(wired, ShardRef) and wired.trees is not None
    assert (wired.file, wired.sessions, wired.finished, wired.trees.new_blob_bytes,
            wired.chunks) == ("shard-holder-0.msgpack", 2, 1, 40,
                              ChunkHashes(MIN_CHUNK_BYTES, ("0" * 32,)))
    assert shard_entry(wired) == entry
    assert {wired: 1}[shard_ref(entry)] == 1  # a prefetch finds its read by it
