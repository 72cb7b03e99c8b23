"""The README says what the repository does: its integration guide is cut from the
minimal example, its call order from the contract; its public names import; its set-up
commands and links exist, and it links every reference page. The reference pages it
links (docs/CONFIG.md, docs/CLI.md, docs/METRICS.md) hold the config table made from the
model and the metrics table of the actors; the changelog names the formats this version
reads; docs/LAYOUT.md names every module; benchmarks/README.md stays a reference that names
every benchmark; and nothing refers outside the repository."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
from pathlib import Path

import pytest

import nemo_ckpt
from nemo_ckpt import interfaces
from nemo_ckpt.config_table import (
    BEGIN_MARKER,
    CONFIG_PAGE,
    END_MARKER,
    config_table,
    replace_table,
)
from nemo_ckpt.config_table import main as config_table_command
from nemo_ckpt.nemo_rl_telemetry import RESTORE_NAMES, SNAPSHOT_NAMES
from nemo_ckpt.storage.manifest import FORMAT_VERSION, SUPPORTED_FORMAT_VERSIONS

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
# The reference pages the README links: its long tables live there.
CONFIG = (ROOT / CONFIG_PAGE).read_text()
METRICS = (ROOT / "docs" / "METRICS.md").read_text()
REFERENCE_PAGES = [CONFIG_PAGE, "docs/CLI.md", "docs/METRICS.md", "docs/MANAGER.md"]
EXAMPLES = [ROOT / "examples" / "minimal_driver.py", ROOT / "examples" / "minimal_worker.py",
            ROOT / "examples" / "adapter_recovery.py",
            ROOT / "examples" / "container_recovery.py"]


def section(title: str, text: str = README) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


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


def test_every_snippet_of_the_nemo_rl_guide_is_cut_from_the_grpo_example() -> None:
    snippets = code_blocks(section(
        "With NeMo RL: the integration module and the rollout checkpoint manager"))
    assert len(snippets) >= 4
    source = lines((ROOT / "examples" / "grpo_recovery.py").read_text())
    for snippet in snippets:
        assert cut_from(snippet, source), snippet


def test_every_snippet_of_the_nemo_gym_section_is_cut_from_the_gym_worker() -> None:
    snippets = code_blocks(section("With NeMo Gym's sandboxes"))
    assert len(snippets) >= 1
    source = lines((ROOT / "tests" / "integrations" / "gym_worker.py").read_text())
    for snippet in snippets:
        assert cut_from(snippet, source), snippet


def test_the_call_order_is_the_contracts_own() -> None:
    snippets = code_blocks(section("The call order a driver uses"))
    assert len(snippets) == 2
    contract = lines(interfaces.__doc__ or "")
    for snippet in snippets:
        assert cut_from(snippet, contract), snippet


def test_the_set_up_is_make_demo_and_make_test_and_the_makefile_has_both() -> None:
    setup = section("Set-up")
    commands = [line.split("#")[0].strip() for line in setup.splitlines()
                if line.startswith("    ") and line.strip().startswith("make ")]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, flags=re.M), target


def test_the_config_pages_table_is_the_one_the_model_makes() -> None:
    begin = CONFIG.index(BEGIN_MARKER) + len(BEGIN_MARKER) + 1
    assert CONFIG[begin:CONFIG.index(END_MARKER)] == config_table(), (
        f"run: .venv/bin/python -m nemo_ckpt.config_table --write {CONFIG_PAGE}")


def test_the_config_table_command_remakes_a_table_edited_by_hand(tmp_path: Path) -> None:
    page = tmp_path / "CONFIG.md"
    page.write_text(CONFIG.replace("| `lease_s` | float | `30.0` |",
                                   "| `lease_s` | float | `60.0` |"))
    assert page.read_text() != CONFIG
    assert config_table_command(["--write", str(page)]) == 0
    assert page.read_text() == CONFIG


def test_the_readme_holds_no_config_table_and_links_every_reference_page() -> None:
    assert BEGIN_MARKER not in README and "| `lease_s` |" not in README
    assert "| `nemo_ckpt_" not in README  # the metrics table is on its own page
    for page in REFERENCE_PAGES:
        assert f"]({page}" in README, page


def test_the_config_table_command_refuses_a_file_without_the_markers(tmp_path: Path) -> None:
    other = tmp_path / "NOTES.md"
    other.write_text("no table here\n")
    assert config_table_command(["--write", str(other)]) == 1
    assert other.read_text() == "no table here\n"
    assert replace_table("no table here") is None


def public_names() -> dict[str, str]:
    """Each name of the README's public-names table -> the import statement it gives."""
    table = section("Public names and their imports")
    rows = re.findall(r"^\| (`[^|]+`) \| `(from [\w.]+ import [\w, ]+)` \|", table, flags=re.M)
    assert rows
    return {name: statement for names, statement in rows
            for name in re.findall(r"`(\w+)`", names)}


def test_every_public_name_in_the_readme_imports_as_the_table_says() -> None:
    for name, statement in public_names().items():
        module, imported = re.fullmatch(r"from ([\w.]+) import ([\w, ]+)", statement).groups()
        assert name in [n.strip() for n in imported.split(",")], statement
        assert hasattr(importlib.import_module(module), name), statement


def test_every_name_the_package_exports_is_in_the_readmes_table() -> None:
    documented = {n for n, s in public_names().items() if s.startswith("from nemo_ckpt import")}
    assert set(nemo_ckpt.__all__) - documented == set()


def slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md", "docs/LAYOUT.md",
                                  "benchmarks/README.md", *REFERENCE_PAGES])
def test_every_link_leads_to_a_file_or_a_heading_that_exists(name: str) -> None:
    path = ROOT / name
    for target in re.findall(r"\]\(([^)]+)\)", path.read_text()):
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), target
        assert linked.is_relative_to(ROOT), target
        if anchor:
            assert anchor in anchors(linked), target


def test_the_changelog_says_which_formats_this_version_reads_and_writes() -> None:
    version = importlib.metadata.version("nemo-ckpt")
    row = re.search(rf"^\| {re.escape(version)}\b[^|]*\| ([^|]+) \| ([^|]+) \|$", CHANGELOG,
                    flags=re.M)
    assert row, f"CHANGELOG.md has no row for {version}"
    reads, writes = row.groups()
    assert {int(n) for n in re.findall(r"\d+", reads)} == set(SUPPORTED_FORMAT_VERSIONS)
    # It writes the newest format it reads, and never one it cannot read back.
    written = {int(n) for n in re.findall(r"\d+", writes)}
    newest = max(SUPPORTED_FORMAT_VERSIONS)
    assert {FORMAT_VERSION, newest} <= written <= set(
        SUPPORTED_FORMAT_VERSIONS)
    described = {int(n) for n in re.findall(r"^\| (\d+) \|", CHANGELOG, flags=re.M)}
    assert described == set(SUPPORTED_FORMAT_VERSIONS)


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


def test_every_module_of_the_core_and_the_actors_is_in_the_layout() -> None:
    layout = (ROOT / "docs" / "LAYOUT.md").read_text()
    modules = [p.relative_to(ROOT).as_posix() for folder in ("nemo_ckpt", "actors")
               for p in sorted((ROOT / folder).rglob("*.py"))
               if not (p.name == "__init__.py" and p.parent.name == "actors")]
    assert [m for m in modules if f"`{m}`" not in layout] == []


def test_the_metrics_table_lists_every_metric_the_actors_publish() -> None:
    published = set(re.findall(r'"(nemo_ckpt_\w+)"', (ROOT / "actors" / "metrics.py").read_text()))
    listed = set(re.findall(r"^\| `(nemo_ckpt_\w+)", section("Metrics", METRICS), flags=re.M))
    assert published and listed == published


def test_the_nemo_rl_names_table_lists_every_name_the_driver_gives_with_its_figure(
        ) -> None:
    given = {(n.name, n.ours) for n in (*SNAPSHOT_NAMES, *RESTORE_NAMES)}
    listed = set(re.findall(r"^\| `([\w/]+)` \| `([^`]+)` \|",
                            section("NeMo RL's names", METRICS), flags=re.M))
    assert given and listed == given


def test_the_glossary_defines_the_words_a_newcomer_meets_in_alphabetical_order() -> None:
    terms = re.findall(r"^- \*\*([^*]+)\*\*", section("Glossary"), flags=re.M)
    assert terms == sorted(terms, key=str.lower)
    for word in ("instance", "attempt", "capture key", "cut", "staging row", "ledger",
                 "holder", "snapshot", "session", "turn"):
        assert word in terms, word


def test_the_benchmarks_page_is_a_reference_that_names_every_benchmark() -> None:
    page = (ROOT / "benchmarks" / "README.md").read_text()
    assert len(page.splitlines()) <= 400, "the runs' history belongs in git, not on the page"
    modules = [p.stem for p in sorted((ROOT / "benchmarks").glob("*.py"))
               if p.name != "__init__.py"]
    assert [m for m in modules
            if f"benchmarks/{m}.py" not in page and f"benchmarks.{m}" not in page] == []
