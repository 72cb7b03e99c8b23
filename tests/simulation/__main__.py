"""``python -m tests.simulation``: see ``tests/simulation/__init__.py``."""

import os
import sys

from .runner import main

if os.environ.get("PYTHONHASHSEED") != "0":  # sets iterate the same on every replay
    os.execve(sys.executable, [sys.executable, "-m", "tests.simulation", *sys.argv[1:]],
              dict(os.environ, PYTHONHASHSEED="0"))
sys.exit(main())
