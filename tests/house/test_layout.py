"""The test suite keeps its layout (issue 51): every test module lives in the folder named
for the part of the house it speaks for (docs/LAYOUT.md, "tests/"), never flat under
``tests/``, and the xdist scheduling's lists in ``tests/conftest.py`` name modules that
exist."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import PODMAN_MODULES, SLOWEST_MODULES

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

# Each folder of tests/ and what its tests speak for: paths that exist in the repository.
MIRRORS: dict[str, tuple[str, ...]] = {
    "adapters": ("nemo_ckpt/adapters",),
    "catalog": ("nemo_ckpt/catalog",),
    "cli": ("nemo_ckpt/cli",),
    "containers": ("nemo_ckpt/containers",),
    "coordinator": ("actors/coordinator",),
    "core": ("nemo_ckpt/interfaces.py", "nemo_ckpt/cut.py", "nemo_ckpt/receipts.py",
             "nemo_ckpt/sessions.py", "nemo_ckpt/options.py", "nemo_ckpt/tracing.py"),
    "driver": ("nemo_ckpt/driver",),
    "examples": ("examples", "cluster.yaml"),
    "holder": ("actors/holder",),
    "house": ("docs/LAYOUT.md", "README.md"),
    "integrations": ("nemo_ckpt/integrations",),
    "manager": ("nemo_ckpt/manager",),
    "protocol": ("nemo_ckpt/protocol",),
    "ray_cluster": ("actors/ray_transport.py", "actors/metrics.py", "actors/drills.py"),
    "sandboxes": ("nemo_ckpt/sandboxes",),
    "simulation": ("actors/sim", "tests/simulation/__main__.py"),
    "storage": ("nemo_ckpt/storage",),
    "testing": ("nemo_ckpt/testing",),
    "trees": ("nemo_ckpt/trees",),
}


def test_every_test_module_lives_in_a_folder_named_for_what_it_tests() -> None:
    modules = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))
    assert len(modules) > 70  # the whole suite, not an empty glob
    misplaced = [m for m in modules if m.count("/") != 1 or m.split("/")[0] not in MIRRORS]
    assert misplaced == [], (
        f"{misplaced}: move each into the tests/ folder of the package it tests "
        "(docs/LAYOUT.md, 'tests/'), or add its folder to MIRRORS and to that section")


def test_each_folder_is_a_package_mirroring_what_exists_and_the_layout_names_it() -> None:
    layout = (ROOT / "docs" / "LAYOUT.md").read_text()
    section = layout[layout.index("## `tests/`"):]
    for folder, mirrored in MIRRORS.items():
        assert (TESTS / folder / "__init__.py").is_file(), folder
        assert [m for m in mirrored if not (ROOT / m).exists()] == [], folder
        assert f"`tests/{folder}/`" in section, folder


def test_the_scheduling_lists_name_one_test_module_each() -> None:
    named = sorted(PODMAN_MODULES | {m for m in SLOWEST_MODULES if m != "podman"})
    found = {name: [p.relative_to(TESTS).as_posix() for p in TESTS.rglob(name)]
             for name in named}
    assert {name: paths for name, paths in found.items() if len(paths) != 1} == {}
