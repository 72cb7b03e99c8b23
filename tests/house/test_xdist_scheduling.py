"""``make test``'s ``pytest -n 3 --dist loadfile`` (tests/conftest.py), here on two workers
(the grouping does not depend on their number): the podman modules
share one worker, every module stays on one worker, and the slowest modules start first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PODMAN_MODULES

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)

TEST = """
import os
def test_{i}():
    with open({log!r}, "a") as f:
        f.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {name}\\n")
"""


def test_two_workers_keep_the_podman_modules_together_and_start_the_slowest_first(
        tmp_path: Path) -> None:
    log = tmp_path / "ran.log"
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems, "
        "pytest_xdist_make_scheduler\n")
    modules = ["test_aaa.py", "test_chaos.py", "test_zzz.py", *sorted(PODMAN_MODULES)]
    for name in modules:
        (tmp_path / name).write_text("".join(TEST.format(i=i, log=str(log), name=name)
                                             for i in range(3)))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadfile", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=100,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ran = [line.split() for line in log.read_text().splitlines()]
    assert len(ran) == 3 * len(modules)
    workers = {name: {w for w, n in ran if n == name} for name in modules}
    assert all(len(w) == 1 for w in workers.values()), workers
    assert len(set().union(*(workers[n] for n in PODMAN_MODULES))) == 1, workers
    # The podman group and test_chaos.py are each their worker's first module.
    firsts = {w: next(n for w2, n in ran if w2 == w) for w in {w for w, _ in ran}}
    (chaos,) = [w for w, n in firsts.items() if n == "test_chaos.py"]
    (other,) = set(firsts) - {chaos}
    assert firsts[other] in PODMAN_MODULES, firsts
