"""Tests of `examples/` and `cluster.yaml`: the demos and examples as a user runs them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> Any:
    """``examples/<name>.py`` as the module ``name`` (examples/ is not a package): its
    siblings import while it loads, as when it runs as a script, and the classes it
    defines reach Ray's workers by value, as a script's do (examples/ is on no worker's
    path)."""
    from ray import cloudpickle

    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    cloudpickle.register_pickle_by_value(module)
    return module
