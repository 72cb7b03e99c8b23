"""The core's modules: no import circle, nothing from the actors or Ray in the core, and
the worker's client reaching its holder through the transport the Ray side registers."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.sessions import SessionClient, register_default_transport
from nemo_ckpt.transport import HOLDER, Transport
from tests.harness import CONFIG

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("nemo_ckpt", "actors")
# The Ray-facing modules of the package, and its testing helpers, may reach Ray (none of
# the package reaches the actors: the next test); the rest is the core.
RAY_FACING = ("nemo_ckpt.cli", "nemo_ckpt.connect", "nemo_ckpt.driver",
              "nemo_ckpt.testing")


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, for_typing: bool = False) -> set[str]:
    """Every module ``path`` imports at run time, inside functions too (imports under
    ``if TYPE_CHECKING:`` run no code and are left out, unless ``for_typing``)."""
    tree = ast.parse(path.read_text())
    typing_only = set() if for_typing else {
        id(n) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in node.body for n in ast.walk(sub)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _graph(for_typing: bool = False, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a package's ``__init__`` runs with
    each of its modules, so a module's own packages are no edge)."""
    files = {_module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        for target in _imports(path, for_typing):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges.add(target)
        graph[name] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles, one per strongly connected component of two or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others_not_even_inside_a_function() -> None:
    graph = _graph()
    assert "nemo_ckpt.sessions" in graph and "actors.coordinator.actor" in graph
    assert _circles(graph) == []


def test_no_module_imports_itself_through_others_not_even_for_type_checking() -> None:
    """A circle of type-only imports is a circle of meaning: two rooms that each need the
    other to be understood (a part typed by its owner: give it a Protocol of its own)."""
    graph = _graph(for_typing=True)
    assert "actors.sim.world" in graph and "nemo_ckpt.interfaces" in graph
    assert _circles(graph) == []


def test_the_circle_check_finds_a_circle_made_only_for_type_checking(tmp_path: Path) -> None:
    (tmp_path / "nemo_ckpt").mkdir()
    (tmp_path / "actors").mkdir()
    (tmp_path / "nemo_ckpt" / "a.py").write_text("from nemo_ckpt.b import B\n")
    (tmp_path / "nemo_ckpt" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nemo_ckpt.a import A\n")
    assert _circles(_graph(root=tmp_path)) == []
    assert _circles(_graph(for_typing=True, root=tmp_path)) == [["nemo_ckpt.a", "nemo_ckpt.b"]]


def test_the_core_imports_nothing_from_the_actors_or_ray_not_even_inside_a_function() -> None:
    offending = {}
    for path in (ROOT / "nemo_ckpt").rglob("*.py"):
        name = _module_name(path)
        if any(name == m or name.startswith(m + ".") for m in RAY_FACING):
            continue
        bad = sorted(m for m in _imports(path) if m.split(".")[0] in ("ray", "actors"))
        if bad:
            offending[name] = bad
    assert offending == {}


def test_no_module_of_the_package_imports_the_actors_not_even_its_testing_helpers() -> None:
    """The driver and the CLI reach Ray's actors through the ``nemo_ckpt.transports``
    entry point, not by importing them, even inside a function; the simulated world that
    runs the actors in-process is theirs (``actors.sim``), its virtual clock the core's."""
    offending = {}
    for path in (ROOT / "nemo_ckpt").rglob("*.py"):
        bad = sorted(m for m in _imports(path) if m.split(".")[0] == "actors")
        if bad:
            offending[_module_name(path)] = bad
    assert offending == {}


def test_the_ray_transport_is_found_through_its_entry_point_and_a_missing_one_says_so() -> None:
    from importlib.metadata import entry_points

    from nemo_ckpt.transport import TRANSPORTS_GROUP, runtime_transport

    (ray_entry,) = entry_points(group=TRANSPORTS_GROUP, name="ray")
    assert ray_entry.value == "actors.ray_transport:RayTransport"
    with pytest.raises(ImportError, match="no 'kubernetes' transport is installed.*reinstall"):
        runtime_transport(CONFIG, "kubernetes")


def test_a_client_connected_without_a_transport_reaches_its_holder_through_the_registered_one(
        world: Any) -> None:
    asked: list[str] = []

    def transport(namespace: str) -> Transport:
        asked.append(namespace)
        return world.sim.transport(world.worker, CONFIG)

    world.run(world.ckpt.ensure_holders())
    ray_side = register_default_transport(transport)
    try:
        async def open_one() -> tuple[str, list[Ep]]:
            client = await SessionClient.connect(namespace=CONFIG.namespace)
            await client.open(Ep("r", 0), b"s0")
            return client.instance_id, [s.episode for s in await client.sessions()]

        instance, episodes = world.run(open_one(), world.worker)
    finally:
        register_default_transport(ray_side)
    assert asked == [CONFIG.namespace]
    assert episodes == [Ep("r", 0)]
    assert [a.node for a in world.sim.live(HOLDER) if a.name == instance] == [world.worker.node]


def test_importing_the_package_loads_a_public_name_and_what_it_needs_only_when_used() -> None:
    """An actor's process imports the few submodules it runs: ``import nemo_ckpt`` loads
    none, and a worker's ``SessionClient`` none of the driver's, manager's or catalog's."""
    import subprocess
    import sys

    script = ("import sys, nemo_ckpt\n"
              "def loaded(): return sorted(m for m in sys.modules if m.startswith('nemo_ckpt.'))\n"
              "print(loaded())\n"
              "from nemo_ckpt import SessionClient\n"
              "print([m for m in loaded() if m.startswith(('nemo_ckpt.driver', "
              "'nemo_ckpt.manager', 'nemo_ckpt.catalog'))])\n"
              "print(nemo_ckpt.RayEnvironmentCheckpoint.__module__, "
              "'keep_last' in dir(nemo_ckpt))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60).stdout.splitlines()
    assert out == ["[]", "[]", "nemo_ckpt.driver.checkpoint True"]
    with pytest.raises(AttributeError, match="module 'nemo_ckpt' has no attribute 'Nope'"):
        import nemo_ckpt

        nemo_ckpt.Nope  # noqa: B018
