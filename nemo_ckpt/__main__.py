"""``python -m nemo_ckpt``: the same as the ``nemo-ckpt`` console script."""

from nemo_ckpt.cli.main import main

raise SystemExit(main())
