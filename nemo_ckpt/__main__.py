"""``python -m nemo_ckpt``: the same as the ``nemo-ckpt`` console script."""

from nemo_ckpt.cli import main

raise SystemExit(main())
