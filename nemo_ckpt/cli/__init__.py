"""The ``nemo-ckpt`` command line: look at snapshots on disk and at live holders.

    nemo-ckpt inspect PATH [--json]   what a snapshot holds, from its manifest
    nemo-ckpt verify PATH [--progress]
                                      every check a restore makes, without Ray
    nemo-ckpt diff A B                rollouts added, finished and advanced from A to B
    nemo-ckpt status                  the holders of a running job
    nemo-ckpt gc ROOT [--dry-run] [--wait SECONDS]
                                      remove sandbox blobs no committed snapshot references
    nemo-ckpt ls ROOT [--verify] [--latest] [--json]
                                      the committed snapshots under ROOT, newest first
    nemo-ckpt rm PATH... | rm --keep-last N ROOT [--dry-run] [--progress]
                                      remove snapshots beside a running job, then their blobs

``PATH`` is the checkpoint path handed to ``snapshot()``: the folder that holds
``environment/``. Expected failures (no snapshot, a damaged one, no cluster) print one
line on stderr and exit 1; a bad option is a usage error (exit 2) before Ray starts; a
traceback means a bug in nemo-ckpt.

Each command is a module of this package (``inspect``, ``verify``, ``diff``,
``status``, ``gc``, ``ls``, ``rm``), rendering what the core computes
(``nemo_ckpt.catalog.summary``, ``nemo_ckpt.catalog.verification``,
``nemo_ckpt.catalog.snapshot_diff``, ``nemo_ckpt.trees.collection``,
``nemo_ckpt.catalog.listing``); ``main`` holds the parser and the entry point (the console script's
``nemo_ckpt.cli.main:main``), ``render`` what they print with.
"""
