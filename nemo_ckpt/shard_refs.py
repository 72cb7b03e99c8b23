"""The one conversion between the wire's shards (``nemo_ckpt.phases.ShardRef``) and the
manifest's (``nemo_ckpt.storage.manifest.ShardEntry``), so a change of the format on
disk stops here instead of reaching the calls between processes. The coordinator
converts where it encodes a manifest and where it reads one for a restore; a holder
where it hands what it wrote to storage's writers' results, and what it is asked to read
to storage's readers, which speak the manifest's classes.
"""

from __future__ import annotations

from nemo_ckpt.phases import ChunkHashes, ShardRef, TreesRef
from nemo_ckpt.storage.manifest import ShardChunks, ShardEntry, TreesEntry

__all__ = ["shard_entry", "shard_ref", "trees_ref"]


def trees_ref(entry: TreesEntry) -> TreesRef:
    """The trees file of a shard as the wire carries it."""
    return TreesRef(file=entry.file, bytes=entry.bytes, content_hash=entry.content_hash,
                    sandboxes=entry.sandboxes, blobs=entry.blobs, new_blobs=entry.new_blobs,
                    new_blob_bytes=entry.new_blob_bytes)


def shard_ref(entry: ShardEntry) -> ShardRef:
    """A manifest's shard as the wire carries it."""
    chunks = None if entry.chunks is None else ChunkHashes(entry.chunks.bytes,
                                                           tuple(entry.chunks.hashes))
    return ShardRef(file=entry.file, bytes=entry.bytes, content_hash=entry.content_hash,
                    instance_id=entry.instance_id, sessions=entry.sessions, chunks=chunks,
                    trees=None if entry.trees is None else trees_ref(entry.trees),
                    finished=entry.finished)


def shard_entry(ref: ShardRef) -> ShardEntry:
    """The wire's shard as the manifest holds it, validated as a manifest's entry is:
    a holder's report that the format refuses raises ``pydantic.ValidationError``."""
    trees = None if ref.trees is None else TreesEntry(
        file=ref.trees.file, bytes=ref.trees.bytes, content_hash=ref.trees.content_hash,
        sandboxes=ref.trees.sandboxes, blobs=ref.trees.blobs,
        new_blobs=ref.trees.new_blobs, new_blob_bytes=ref.trees.new_blob_bytes)
    chunks = None if ref.chunks is None else ShardChunks(bytes=ref.chunks.bytes,
                                                         hashes=list(ref.chunks.hashes))
    return ShardEntry(file=ref.file, bytes=ref.bytes, content_hash=ref.content_hash,
                      instance_id=ref.instance_id, sessions=ref.sessions, trees=trees,
                      finished=ref.finished, chunks=chunks)
