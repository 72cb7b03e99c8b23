"""The house keeps its shape as features land (issue 51): no class in ``nemo_ckpt/`` or
``actors/`` over 400 lines, no function over 80. A class or function is measured from
its ``class`` or ``def`` line to its last line, decorators left out, nested ones too.
One over its bound is split along a concern into a part of its own, as the holder's
and the driver's parts are (docs/LAYOUT.md); import circles are test_core_modules'.
The two sandbox backends, ``nemo_ckpt/sandboxes/`` (directories) and
``nemo_ckpt/containers/``, import neither each other, not even for type checking: what
both use lies below them (``nemo_ckpt/trees/``, ``nemo_ckpt/sandbox_backend.py``).
And the arrows run one way: storage imports nothing of the packages above it, and the
wire (the protocol and the holders) nothing of the manifest's on-disk classes.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("nemo_ckpt", "actors")
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80


def oversized(source: str, where: str) -> list[str]:
    """One line per class or function of ``source`` (the module at ``where``) over its
    bound, saying the bound and where it is."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            kind, bound = "class", MAX_CLASS_LINES
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, bound = "function", MAX_FUNCTION_LINES
        else:
            continue
        assert node.end_lineno is not None
        lines = node.end_lineno - node.lineno + 1
        if lines > bound:
            found.append(f"{where}:{node.lineno}: {kind} {node.name} is {lines} lines, "
                         f"over the bound of {bound}; split it along a concern")
    return found


def test_no_class_is_over_400_lines_and_no_function_over_80() -> None:
    modules = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(modules) > 100  # the whole house, not an empty glob
    found = [line for path in modules
             for line in oversized(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "\n" + "\n".join(found)


def test_the_check_names_each_class_and_function_over_its_bound_and_where_it_is() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    source = ("class Big:\n"
              "    @property\n"
              "    def long(self) -> None:\n"
              f"{body}\n"
              "\n"
              "    def short(self) -> None:\n"
              "        pass\n" + "    pass\n" * 316)
    assert oversized(source, "actors/big.py") == [
        "actors/big.py:1: class Big is 402 lines, over the bound of 400; split it along "
        "a concern",
        "actors/big.py:3: function long is 81 lines, over the bound of 80; split it "
        "along a concern"]
    within = "class Small:\n    def f(self) -> None:\n" + "        pass\n" * 79
    assert oversized(within, "actors/small.py") == []


BACKENDS = ("nemo_ckpt.sandboxes", "nemo_ckpt.containers")


def imported_modules(source: str, module: str) -> set[str]:
    """Every module the source of ``module`` names in an import, anywhere in it (inside
    functions and ``if TYPE_CHECKING:`` too), relative imports resolved, and for
    ``from a import b`` both ``a`` and ``a.b`` (``b`` may be a module)."""
    found: set[str] = set()
    package = module.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def crossing_imports(source: str, module: str) -> list[str]:
    """The imports of ``module`` that reach the other sandbox backend's package."""
    own = [b for b in BACKENDS if module == b or module.startswith(b + ".")]
    others = [b for b in BACKENDS if b not in own]
    return sorted(f"{module} imports {name}" for name in imported_modules(source, module)
                  if own and any(name == o or name.startswith(o + ".") for o in others))


def test_the_directory_and_container_backends_import_neither_each_other() -> None:
    found = []
    for backend in BACKENDS:
        folder = ROOT.joinpath(*backend.split("."))
        modules = sorted(folder.rglob("*.py"))
        assert len(modules) >= 2  # the package, not an empty glob
        for path in modules:
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found += crossing_imports(path.read_text(), name)
    assert found == []


def test_the_backend_check_sees_typing_only_relative_and_in_function_imports() -> None:
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n"
              "    from nemo_ckpt.containers.record import ContainerRecord\n"
              "from ..containers import podman\n"
              "from nemo_ckpt.trees.scan import scan\n"
              "def f() -> None:\n"
              "    import nemo_ckpt.containers.backend\n")
    assert crossing_imports(source, "nemo_ckpt.sandboxes.directories") == [
        "nemo_ckpt.sandboxes.directories imports nemo_ckpt.containers",
        "nemo_ckpt.sandboxes.directories imports nemo_ckpt.containers.backend",
        "nemo_ckpt.sandboxes.directories imports nemo_ckpt.containers.podman",
        "nemo_ckpt.sandboxes.directories imports nemo_ckpt.containers.record",
        "nemo_ckpt.sandboxes.directories imports nemo_ckpt.containers.record.ContainerRecord"]
    assert crossing_imports("from nemo_ckpt import sandboxes\n",
                            "nemo_ckpt.containers.sandbox") == [
        "nemo_ckpt.containers.sandbox imports nemo_ckpt.sandboxes"]
    assert crossing_imports(source, "nemo_ckpt.trees.scan") == []


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def reaching(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    """One line per import in ``paths`` of a module in (or below) ``forbidden``."""
    return [f"{path.relative_to(ROOT)} imports {name}" for path in paths
            for name in sorted(imported_modules(path.read_text(), _module_of(path)))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_storage_imports_nothing_from_the_packages_above_it() -> None:
    storage = sorted((ROOT / "nemo_ckpt" / "storage").glob("*.py"))
    assert (ROOT / "nemo_ckpt" / "storage" / "commit_sequence.py") in storage
    above = tuple(f"nemo_ckpt.{p}" for p in ("catalog", "cli", "manager", "driver",
                                               "integrations", "adapters"))
    assert not (found := reaching(storage, above)), "\n" + "\n".join(found)


def test_the_wire_and_the_holders_import_nothing_from_the_manifests_disk_classes() -> None:
    wire = sorted([*(ROOT / "nemo_ckpt" / "protocol").glob("*.py"),
                   ROOT / "nemo_ckpt" / "phases.py",
                   *(ROOT / "actors" / "holder").glob("*.py")])
    assert len(wire) > 12 and all(p.exists() for p in wire)
    found = reaching(wire, ("nemo_ckpt.storage.manifest",))
    assert not found, "\n" + "\n".join(found)


def test_the_import_check_sees_imports_inside_functions_and_for_typing(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n"
                      "    from nemo_ckpt.storage.manifest import ShardEntry\n"
                      "def f() -> None:\n"
                      "    import nemo_ckpt.catalog.listing\n"
                      "from nemo_ckpt.storage import manifest\n")
    assert imported_modules(module.read_text(), "m") >= {"nemo_ckpt.storage.manifest",
                                        "nemo_ckpt.storage.manifest.ShardEntry",
                                        "nemo_ckpt.catalog.listing"}
