"""Sessions' sandbox directories: trees, the blob store, snapshots' trees, collection."""
