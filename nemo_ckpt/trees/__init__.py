"""Content-addressed file trees, which both sandbox backends record into: trees, their
scan and materialization, the blob store and node cache, the container record, how a
snapshot stores them, and collection."""
