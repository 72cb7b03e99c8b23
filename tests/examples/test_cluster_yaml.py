"""cluster.yaml is a Ray cluster launcher config that Ray itself accepts."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
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


def test_the_driver_commands_it_shows_run_the_examples_on_the_cluster_in_token_mode() -> None:
    text = CLUSTER_YAML.read_text()
    shown = re.findall(r"ray exec cluster.yaml '(.*)'", text)
    assert len(shown) == 2
    for command in shown:
        assert "RAY_AUTH_MODE=token .venv/bin/python examples/" in command
        assert "--address auto --checkpoint-dir /mnt/shared/nemo-ckpt" in command
        script = re.search(r"(examples/\S+\.py)", command)
        assert script is not None and (ROOT / script.group(1)).is_file()


def test_set_up_works_on_a_stock_ubuntu_node() -> None:
    setup = load()["setup_commands"]
    venv = next(i for i, c in enumerate(setup) if "python3 -m venv" in c)
    # Stock Ubuntu has no python3-venv (nor an NFS client): installed first, with sudo.
    apt = next(i for i, c in enumerate(setup) if "apt-get install" in c)
    assert apt < venv and "python3-venv" in setup[apt] and "nfs-common" in setup[apt]
    assert setup[apt].startswith("sudo apt-get update") and "sudo " in setup[apt][20:]
    # /mnt is root's: the mount point is made with sudo; the folder inside is the user's.
    assert "sudo mkdir -p /mnt/shared" in setup
    mount = next(c for c in setup if "mount -t nfs" in c)
    assert mount.startswith("mountpoint -q /mnt/shared || sudo mount")
    folder = next(c for c in setup if "/mnt/shared/nemo-ckpt" in c and "mkdir" in c)
    assert "sudo chown" in folder


def test_every_node_gets_the_token_and_starts_ray_in_token_mode() -> None:
    config = load()
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = next(c for c in config[key] if " start " in c)
        assert start.startswith("export RAY_AUTH_MODE=token;"), key
    # Shells of `ray exec` and `ray attach` read ~/.bashrc.
    assert any("export RAY_AUTH_MODE=token' ~/.bashrc" in c for c in config["setup_commands"])
