"""cluster.yaml is a Ray cluster launcher config that Ray itself accepts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_YAML = ROOT / "cluster.yaml"


def load() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def bootstrap(config: dict[str, Any]) -> dict[str, Any]:
    # What `ray up` runs before it touches any machine: fill in the provider's defaults,
    # validate against Ray's JSON schema, bootstrap the provider. Offline for "local".
    from ray.autoscaler._private.commands import _bootstrap_config

    return _bootstrap_config(copy.deepcopy(config), no_config_cache=True)


def test_ray_validates_the_cluster_config() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load()
    validate_config(prepare_config(copy.deepcopy(config)))
    resolved = bootstrap(config)
    assert resolved["provider"]["type"] == "local"
    assert resolved["max_workers"] == len(config["provider"]["worker_ips"]) == 2


def test_ray_rejects_a_misspelt_field_so_the_validation_is_real() -> None:
    import jsonschema

    config = load()
    config["setup_comands"] = config.pop("setup_commands")
    with pytest.raises(jsonschema.ValidationError, match="setup_comands"):
        bootstrap(config)


def test_every_node_installs_the_package_and_starts_ray_from_its_venv() -> None:
    config = load()
    assert "." in config["file_mounts"].values(), "the repository is synced to the nodes"
    setup = "\n".join(config["setup_commands"])
    assert "pip install" in setup and "-e ~/nemo-ckpt" in setup
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP" in c
               for c in config["worker_start_ray_commands"])


def test_the_driver_command_it_shows_runs_the_example_on_the_cluster() -> None:
    text = CLUSTER_YAML.read_text()
    assert "examples/turn_level_recovery.py --address auto" in text
    assert (ROOT / "examples" / "turn_level_recovery.py").is_file()
