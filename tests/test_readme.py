"""The README says what the repository does: its integration guide is cut from the
minimal example, its set-up commands exist, and nothing refers outside the repository."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
EXAMPLES = [ROOT / "examples" / "minimal_driver.py", ROOT / "examples" / "minimal_worker.py"]


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def lines(text: str) -> list[str]:
    """Non-empty lines without their indentation: a snippet may be dedented."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def cut_from(snippet: str, source: list[str]) -> bool:
    """Whether ``snippet``'s parts (split at lines of ``...``) appear in ``source``, each
    part as consecutive lines, in order."""
    parts: list[list[str]] = [[]]
    for line in lines(snippet):
        if line == "...":
            parts.append([])
        else:
            parts[-1].append(line)
    at = 0
    for part in filter(None, parts):
        for i in range(at, len(source) - len(part) + 1):
            if source[i:i + len(part)] == part:
                at = i + len(part)
                break
        else:
            return False
    return True


def test_every_snippet_of_the_integration_guide_is_cut_from_the_minimal_example() -> None:
    snippets = code_blocks(section("Integration guide for an RL driver"))
    assert len(snippets) >= 8
    sources = [lines(path.read_text()) for path in EXAMPLES]
    for snippet in snippets:
        assert any(cut_from(snippet, source) for source in sources), snippet


def test_the_set_up_lists_make_test_demo_and_install_and_the_makefile_has_them() -> None:
    setup = section("Set-up")
    makefile = (ROOT / "Makefile").read_text()
    for target in ("test", "demo", "install"):
        assert f"make {target}" in setup
        assert re.search(rf"^{target}:", makefile, flags=re.M), target


def test_nothing_in_the_repository_refers_to_files_outside_it() -> None:
    outside = "/".join(("..", "shared"))  # spelled so that this file does not match
    skip = {".git", ".venv", ".mypy_cache", ".ruff_cache", ".pytest_cache", "__pycache__",
            "demo-checkpoints", "minimal-checkpoints"}
    offenders = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder) / name
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            if outside in text:
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
