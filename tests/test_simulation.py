"""The deterministic simulation itself: a seed replays exactly, and the invariants catch
the bugs they are there for (a check that cannot fail proves nothing). The 10,000
schedules run in ``make test`` as their own step (``python -m tests.simulation``)."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout

import pytest

from actors.session_holder import SessionHolder
from nemo_ckpt.ray_checkpoint import RayEnvironmentCheckpoint, RaySnapshot
from tests import simulation

pytestmark = pytest.mark.timeout(300)


def test_a_seed_replays_exactly() -> None:
    for seed in (3, 26, 574):
        first = simulation.run_one(seed, tracing=True)
        again = simulation.run_one(seed, tracing=True)
        assert first.trace == again.trace and first.trace
        assert (first.violations, first.faults) == (again.violations, again.faults)


def test_holders_that_ignore_aborts_are_caught_and_the_seed_printed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def ignore(self: SessionHolder, operation_id: str) -> None:
        del self, operation_id

    monkeypatch.setattr(SessionHolder, "abort", ignore)
    out = io.StringIO()
    with redirect_stdout(out):
        code = simulation.main(["--schedules", "120", "--jobs", "1"])
    text = out.getvalue()
    assert code == 1
    assert re.search(r"case (2|3) holders left paused by a .*: first at seed \d+", text)
    seed = int(re.search(r"replay: \.venv/bin/python -m tests\.simulation --replay (\d+)",
                         text).group(1))  # type: ignore[union-attr]
    assert simulation.run_one(seed).violations  # the printed seed shows it again


def test_a_snapshot_committed_despite_its_failed_check_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    original = RaySnapshot.check_against_cut

    async def forgetful(self: RaySnapshot, cut: object) -> None:
        try:
            await original(self, cut)  # type: ignore[arg-type]
        finally:
            self.refused = None  # the bug of case 10: a caught refusal is forgotten

    monkeypatch.setattr(RaySnapshot, "check_against_cut", forgetful)
    # ... and the later guard that refuses a snapshot no passing check vouched for.
    monkeypatch.setattr(RayEnvironmentCheckpoint, "_unchecked", lambda *args: None)
    total, _, bad = simulation.run_many(0, 150, jobs=1)
    cases = {simulation.case_of(v) for r in bad for v in r.violations}
    assert "10 refused snapshot committed" in cases
