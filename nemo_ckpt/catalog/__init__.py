"""The snapshots under a root, and what each holds: listed, verified, compared, removed."""
