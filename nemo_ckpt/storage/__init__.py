"""The snapshot format on disk, and the folders and buckets it is written through."""
