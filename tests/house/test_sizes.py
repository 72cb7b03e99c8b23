"""The house keeps its shape as features land (issue 51): no class in ``nemo_ckpt/`` or
``actors/`` over 400 lines, no function over 80. A class or function is measured from
its ``class`` or ``def`` line to its last line, decorators left out, nested ones too.
One over its bound is split along a concern into a part of its own, as the holder's
and the driver's parts are (docs/LAYOUT.md); import circles are test_core_modules'.
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
