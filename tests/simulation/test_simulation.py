"""The deterministic simulation itself: a seed replays exactly, and the invariants catch
the bugs they are there for (a check that cannot fail proves nothing). The 10,000
schedules run in ``make test`` as their own step (``python -m tests.simulation``)."""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import re
import time
from collections.abc import Iterable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from actors.holder.actor import SessionHolder
from actors.sim import SimActor, SimWorld, delivery
from nemo_ckpt.catalog import listing as catalog
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.driver import RaySnapshot
from nemo_ckpt.driver.snapshot_operation import SnapshotOperation
from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.integrations import nemo_rl_ledger
from nemo_ckpt.integrations.nemo_rl import NemoRlEnvironmentCheckpoint
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.manager import removals
from nemo_ckpt.storage import local_folder
from nemo_ckpt.transport import HOLDER, Actor
from tests import simulation
from tests.simulation import faults as simulation_faults

pytestmark = pytest.mark.timeout(300)


def _first_showing(case: str, seeds: Iterable[int]) -> int | None:
    """The first of ``seeds`` whose schedule shows ``case``: the search stops there."""
    return next((seed for seed in seeds if case in {
        simulation.case_of(v) for v in simulation.run_one(seed).violations}), None)


def test_a_seed_replays_exactly() -> None:
    for seed in (3, 26, 574, 20, 4):  # 20: a zombie coordinator; 4: calls wait for slots
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
    monkeypatch.setattr(SnapshotOperation, "_unchecked", lambda *args: None)
    assert _first_showing("10 refused snapshot committed", range(150)) is not None


def test_a_holder_that_releases_whatever_snapshot_is_paused_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Drivers and the coordinator both release, and a copy may come late (issue 26's
    faults): a holder that took any release for the snapshot it is paused for would
    let turns run under the next snapshot's cut."""
    original = SessionHolder.release

    async def careless(self: SessionHolder, snapshot_id: str) -> None:
        await original(self, self.current[1] or snapshot_id)

    monkeypatch.setattr(SessionHolder, "release", careless)
    assert _first_showing("26.1 a holder resumed for a snapshot whose block still ran",
                          range(150)) is not None


def test_a_removal_that_ignores_claims_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The retention script's removals race the job's snapshots: one that removed files
    without claiming the path first, whatever snapshot is there now, tears or removes a
    snapshot that commits meanwhile."""
    real = catalog.remove_snapshot

    def careless(path: Any, **options: Any) -> Any:
        options.pop("snapshot_id", None)
        return real(path, **options)

    monkeypatch.setattr(catalog, "_claim_alone", lambda *args, **kwargs: None)
    monkeypatch.setattr(simulation_faults, "remove_snapshot", careless)
    # The race is rare (one schedule of the first 2,000 shows it): only schedules whose
    # plan has a retention script run, from the one that shows it today (785) and then
    # round the range, so that a change of the plans costs time, not the case.
    seeds = itertools.chain(range(785, 2_000), range(785))
    shown = (seed for seed in seeds if simulation.Plan.make(seed).retention
             and "1 committed snapshot lost" in {
                 simulation.case_of(v) for v in simulation.run_one(seed).violations})
    assert next(shown, None) is not None


def test_a_read_of_the_root_that_blocks_on_a_planted_fifo_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50, case 5: a read that opens what is planted as a manifest (a FIFO, or a
    link to one) as it opened files before waits for a writer that never comes."""
    monkeypatch.setattr(local_folder, "_READ_FLAGS", os.O_RDONLY | os.O_CLOEXEC)
    seed = next(s for s in range(100) if simulation.Plan.make(s).planted)
    assert "50.5 a read of the root opened a planted FIFO" in {
        simulation.case_of(v) for v in simulation.run_one(seed).violations}


def test_a_managers_sweep_that_ignores_claims_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50, case 7: a second job's manager whose sweep does not claim a leftover
    first takes a snapshot in progress, whose snapshot() then returns without RL's half
    or its record. Rare: only schedules with a second manager run, until one shows it."""
    monkeypatch.setattr(removals, "claim_for_removal",
                        lambda path, clock: (lambda: None))
    shown = (seed for seed in range(1_000) if simulation.Plan.make(seed).second_manager
             and "50.7 a managed snapshot returned without its record" in {
                 simulation.case_of(v) for v in simulation.run_one(seed).violations})
    assert next(shown, None) is not None


def test_an_adapted_rollout_rebuilt_without_its_replay_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild that trusts the records and skips the replay leaves the environment as
    constructed: the continued rollout's steps then differ from a crash-free run."""
    from nemo_ckpt.adapters import rollout

    monkeypatch.setattr(rollout, "replay", lambda framework, env, records, replayed=None: None)
    seeds = [s for s in range(120) if simulation.Plan.make(s).adapted
             and "restore" in simulation.Plan.make(s).ops][:8]
    assert seeds, "some schedules run adapted rollouts and restore"
    cases = {simulation.case_of(v) for s in seeds for v in simulation.run_one(s).violations}
    assert "28.1 an adapted rollout continued on a history it does not reproduce" in cases


def test_a_rollout_captured_before_its_init_turn_that_resume_refuses_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Schedules whose opens answer slowly (``Plan.slow_open``) snapshot sessions
    between ``AdaptedRollout.start``'s open and its init turn; a resume that does not
    read the prompt recorded at the open (as before issue 56) is refused on the
    continued attempt, and the simulation names it."""
    from nemo_ckpt.adapters import rollout

    monkeypatch.setattr(rollout, "_recorded_prompt", lambda state: (False, None))
    seeds = (s for s in range(400) if simulation.Plan.make(s).slow_open
             and "restore" in simulation.Plan.make(s).ops)
    shown = (s for s in seeds if "56.1 a continued adapted rollout that cannot be resumed"
             in {simulation.case_of(v) for v in simulation.run_one(s).violations})
    assert next(shown, None) is not None


def test_a_driver_whose_calls_have_no_deadline_is_caught_waiting_on_a_hung_coordinator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Schedules whose coordinator hangs, alive to Ray (``Plan.hang``): a driver that
    waits for its calls' answers without a deadline (as before issue 56) takes past its
    deadlines to begin, fail or commit, and the simulation names it."""
    from nemo_ckpt.driver import link

    monkeypatch.setattr(link.CoordinatorLink, "deadline_s",
                        lambda self, method, *args: None)
    seeds = (s for s in range(300) if simulation.Plan.make(s).hang is not None)
    shown = (s for s in seeds if "23.9 a call waits past its deadline (not on a FIFO)"
             in {simulation.case_of(v) for v in simulation.run_one(s).violations})
    assert next(shown, None) is not None


def _blocking_world() -> tuple[SimWorld, SimActor]:
    world = SimWorld(seed=7, nodes=1)
    actor = world.new_actor("worker", "w", "node-0")
    return world, actor


def test_blocking_work_outlives_its_cancelled_caller(tmp_path: Path) -> None:
    world, actor = _blocking_world()
    runtime = world.runtime(actor)
    target = tmp_path / "written"

    async def main() -> None:
        caller = world.spawn(actor, runtime.run_blocking(target.write_bytes, b"done"))
        await asyncio.sleep(0)
        caller.cancel()  # before the thread got to it
        await asyncio.sleep(1.0)
        assert caller.cancelled()

    world.loop.run_until_complete(main())
    world.loop.close()
    assert target.read_bytes() == b"done"
    assert [name for _, _, name, _, _ in world.io_log] == ["write_bytes"]


def test_a_call_that_blocks_for_ever_is_reported_and_unblocked(tmp_path: Path) -> None:
    world, actor = _blocking_world()
    runtime = world.runtime(actor)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    world.fifos.append(str(fifo))
    reports: list[tuple[str, str, str]] = []

    def on_blocked(a: SimActor, name: str, where: str) -> None:
        # Slow, as a report is on a loaded machine: the call must not return before it
        # (it did, and its schedule could end without the violation).
        time.sleep(0.3)
        reports.append((a.name, name, where))

    world.on_blocked = on_blocked

    def read_all(path: Path) -> bytes:
        return path.read_bytes()  # opening a FIFO with no writer waits for one

    result = world.loop.run_until_complete(world.spawn(actor, runtime.run_blocking(
        read_all, fifo)))
    world.loop.close()
    assert result == b""
    assert len(reports) == 1 and reports[0][:2] == ("w", "read_all")
    assert "opening a FIFO" in reports[0][2]


def test_every_process_reads_its_own_clocks() -> None:
    world = SimWorld(seed=11, nodes=2)
    world.clock_skew_s, world.clock_rate = 3600.0, 0.1
    a, b = world.new_actor("holder", "a", "node-0"), world.new_actor("holder", "b", "node-1")
    clock_a, clock_b = world.runtime(a).clock, world.runtime(b).clock
    start = (clock_a.wall(), clock_b.wall(), clock_a.monotonic(), clock_b.monotonic())
    world.loop.advance(100.0)
    wall_a, wall_b = clock_a.wall() - start[0], clock_b.wall() - start[1]
    assert abs(start[0] - start[1]) > 1.0  # steady offsets differ
    assert 90.0 <= wall_a <= 110.0 and 90.0 <= wall_b <= 110.0 and wall_a != wall_b
    assert clock_a.monotonic() - start[2] == pytest.approx(wall_a)  # one rate, both clocks
    world.loop.close()


class _Echo:
    """A callee whose calls take ``seconds`` and note when they ran."""

    def __init__(self, world: SimWorld, log: list[tuple[str, float]]) -> None:
        self._world, self._log = world, log

    async def work(self, name: str, seconds: float) -> str:
        self._log.append((name, self._world.loop.time()))
        await asyncio.sleep(seconds)
        return name


def _callee_world(log: list[tuple[str, float]]) -> tuple[SimWorld, SimActor, SimActor]:
    world = SimWorld(seed=5, nodes=2)
    world.message_delay = lambda target, method, reply: 0.01
    caller = world.new_actor("driver", "d", "node-0")
    callee = world.new_actor(HOLDER, "h", "node-1")
    callee.obj = _Echo(world, log)
    world.registry[("sim", HOLDER_NAME_PREFIX + "h")] = callee
    return world, caller, callee


def test_a_death_is_noticed_late_and_the_name_resolves_to_the_dead_actor_meanwhile() -> None:
    world, caller, callee = _callee_world([])
    world.death_delay = lambda actor: (2.0, 1.0)
    transport = world.transport(caller, simulation.CONFIG)
    seen: dict[str, Any] = {}

    async def main() -> None:
        world.kill(callee)
        handle = transport.holder("h")
        assert handle is not None and handle.ref is callee  # the dead incarnation
        with pytest.raises(BackendUnavailableError):
            await transport.call(handle, "work", "late", 0.0)
        seen["failed at"] = world.loop.time()
        seen["name at 2.5s"] = transport.holder("h")
        await asyncio.sleep(1.0)
        seen["name at 3.5s"] = transport.holder("h")

    world.loop.run_until_complete(main())
    world.loop.close()
    assert seen["failed at"] == pytest.approx(2.0)
    assert seen["name at 2.5s"] is not None and seen["name at 3.5s"] is None


def test_a_stalled_actor_declared_dead_runs_again_as_a_zombie() -> None:
    log: list[tuple[str, float]] = []
    world, caller, callee = _callee_world(log)
    world.zombie_life = lambda actor: 1.0
    transport = world.transport(caller, simulation.CONFIG)
    handle = Actor(HOLDER, "h", callee)

    async def main() -> None:
        world.stall([callee], seconds=5.0, detect=1.0)
        with pytest.raises(BackendUnavailableError):  # held by the stall, failed at 1s
            await transport.call(handle, "work", "held", 0.0)
        assert world.loop.time() == pytest.approx(1.0)
        assert transport.holder("h") is None and callee.zombie
        zombie = world.transport(callee, simulation.CONFIG)
        other = world.new_actor(HOLDER, "o", "node-0")
        other.obj = _Echo(world, log)
        await asyncio.sleep(4.5)  # the stall is over: the zombie works and calls out
        assert await zombie.call(Actor(HOLDER, "o", other), "work", "from zombie", 0.0) \
            == "from zombie"
        await asyncio.sleep(2.0)

    world.loop.run_until_complete(main())
    world.loop.close()
    assert [name for name, _ in log] == ["held", "from zombie"]
    assert log[0][1] == pytest.approx(5.0)  # the held call ran as the node thawed
    assert not callee.alive  # its raylet found out, and killed it


def test_calls_beyond_a_groups_limit_wait_in_order_at_the_callee() -> None:
    log: list[tuple[str, float]] = []
    world, caller, callee = _callee_world(log)
    world.concurrency = lambda actor, group: 1
    queued: list[tuple[str, tuple[str, ...]]] = []
    world.on_queued = lambda target, method, args, waited, ahead, limit: queued.append(
        (args[0], ahead))
    transport = world.transport(caller, simulation.CONFIG)
    handle = Actor(HOLDER, "h", callee)

    async def main() -> list[str]:
        calls = [transport.call(handle, "work", f"c{k}", 1.0) for k in range(3)]
        return list(await asyncio.gather(*calls))

    assert world.loop.run_until_complete(main()) == ["c0", "c1", "c2"]
    world.loop.close()
    assert [round(t) for _, t in log] == [0, 1, 2]  # one at a time, first come first
    assert queued == [("c1", ("work",)), ("c2", ("work", "work"))]


def test_control_calls_behind_turns_are_found_unless_they_have_a_group_of_their_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Case 29.3: the groups are the real actors' (nemo_ckpt.transport.concurrency_group);
    # with every call in one group, as before the fix, the simulation finds the queue.
    seeds = [s for s in range(60) if simulation.Plan.make(s).turn_limit is not None][:6]

    def cases() -> set[str]:
        return {simulation.case_of(v) for seed in seeds
                for v in simulation.run_one(seed).violations}

    assert "29.3 control calls queued behind waiting turns" not in cases()
    monkeypatch.setattr(delivery, "method_group", lambda kind, method: "default")
    assert "29.3 control calls queued behind waiting turns" in cases()


# --- NeMo RL's recovery states (issue 52) ---------------------------------------------------


def _nemo_rl_seeds(count: int, *, restore: bool = False, first: int = 0) -> list[int]:
    return [s for s in range(first, first + 2_000) if simulation.Plan.make(s).nemo_rl
            and (not restore or "restore" in simulation.Plan.make(s).ops)][:count]


def test_the_nemo_rl_schedules_drive_the_double_through_its_recovery_states() -> None:
    """Issue 52: the NeMo RL schedules run ``nemo_ckpt.testing.nemo_rl``'s ledger (schema
    4 and with its retirement queue) through the integration: groups of prompt-group
    granularity abandoned whole at a restore, groups published and trained, finished
    rollouts sealed by the integration's drain before a cut, live failures retired by
    ``retire_dropped()``; with no violation."""
    plans = [simulation.Plan.make(s) for s in _nemo_rl_seeds(40, restore=True)]
    assert {p.retirement_queue for p in plans} == {False, True}
    assert {g.granularity for p in plans for g in p.nemo_groups} == {"sibling",
                                                                      "prompt_group"}
    assert {g.level for p in plans for g in p.nemo_groups} == {"turn", "sibling"}
    seen: set[str] = set()
    for plan in plans:
        result = simulation.run_one(plan.seed, tracing=True)
        assert not result.violations, (plan.seed, result.violations)
        text = "\n".join(result.trace)
        for mark, pattern in (("abandoned", r"drops \d+ \([1-9]\d* of abandoned groups\)"),
                              ("published", r"RL publishes group"),
                              ("trained", r"RL trains on group"),
                              ("drained", r"RL's drain sealed [1-9]"),
                              ("retired", r"retire_dropped retired [1-9]")):
            if re.search(pattern, text):
                seen.add(mark)
    assert seen == {"abandoned", "published", "trained", "drained", "retired"}


def _case_shown(case: str, seeds: list[int]) -> bool:
    return any(case in {simulation.case_of(v) for v in simulation.run_one(s).violations}
               for s in seeds)


def test_an_integration_without_the_drain_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 52, point 4: without ``drain=`` a rollout Gym finished whose reply RL had
    not sealed is unsealed at the cut, and a restore runs it again."""
    real = NemoRlEnvironmentCheckpoint.__init__

    def without_drain(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["drain"] = None
        real(self, *args, **kwargs)

    monkeypatch.setattr(NemoRlEnvironmentCheckpoint, "__init__", without_drain)
    seeds = [s for s in _nemo_rl_seeds(80) if simulation.Plan.make(s).seal_delay > 0]
    assert _case_shown("52.4 a finished-unsealed rollout run again", seeds)


def test_an_integration_blind_to_published_rows_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 52, point 3: a published group's rows, still to be trained, are in no
    ledger record; without ``retained=`` they are orphans, and a restore clears them."""
    real = NemoRlEnvironmentCheckpoint.__init__

    def without_retained(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["retained"] = None
        real(self, *args, **kwargs)

    monkeypatch.setattr(NemoRlEnvironmentCheckpoint, "__init__", without_retained)
    seeds = [s for s in _nemo_rl_seeds(80) if any(
        g.train_after is not None for g in simulation.Plan.make(s).nemo_groups)]
    assert _case_shown("52.3 rows RL still needs reported as orphans or cleared", seeds)


def test_a_retire_dropped_that_leaves_sessions_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 52, point 2: a ``retire_dropped()`` that retires only what a retirement
    queue lists leaves the sessions of rollouts a schema-4 ledger dropped on holders."""
    async def queue_only(self: Any) -> frozenset[tuple[str, str, int]]:
        ledger = self._current_ledger()
        method = getattr(ledger, "gym_checkpoint_retirements", None)
        if method is None:
            return frozenset()
        queued = method(frozenset(self.owners))
        sent = frozenset((o, rid, att) for o, pairs in queued.items() for rid, att in pairs)
        if sent:
            await self.checkpoint.retire([Ep(rid, att) for _, rid, att in sent])
        return sent

    monkeypatch.setattr(NemoRlEnvironmentCheckpoint, "retire_dropped", queue_only)
    seeds = [s for s in _nemo_rl_seeds(200)
             if not simulation.Plan.make(s).retirement_queue]
    assert _case_shown("52.2 a dropped rollout's session left on a holder", seeds)


def test_a_restore_that_hands_over_a_prompt_group_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 52, point 1: handing a prompt-group group's restored sessions to the ledger,
    which abandons such a group whole and refuses them, fails the restore whole."""
    monkeypatch.setattr(nemo_rl_ledger, "abandoned_whole", lambda groups: frozenset())
    monkeypatch.setattr(nemo_rl_ledger, "unowned_episodes", lambda exc: None)
    seeds = [s for s in _nemo_rl_seeds(80, restore=True) if any(
        g.granularity == "prompt_group" and g.level == "turn"
        for g in simulation.Plan.make(s).nemo_groups)]
    assert _case_shown("52.1 a restore failed whole for a prompt-group group", seeds)


def test_a_scan_after_a_hostile_schedule_in_the_same_process_reads_every_file_as_it_is(
        tmp_path: Path) -> None:
    """A schedule's hostile sandbox process and faulty disk act inside that schedule
    alone: a scan that a later test makes in the same pytest worker sees its files
    unswapped (they once turned into FIFOs and links in tests/trees/)."""
    from nemo_ckpt.trees.node_cache import BlobCache
    from nemo_ckpt.trees.scan import scan
    from tests.simulation.plan import Plan

    seed = next(s for s in range(1000) if Plan.make(s).hostile and Plan.make(s).sandboxes)
    simulation.run_one(seed)
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(60):  # each would be swapped with chance Plan.hostile (a tenth)
        (tree / f"f{i}.txt").write_text(f"file {i}\n")
    cache = BlobCache(tmp_path / "cache")
    recorded = scan(tree, None, cache.store).tree()
    assert sorted(recorded) == sorted(f"f{i}.txt" for i in range(60))
    assert [cache.read(recorded[f"f{i}.txt"].data) for i in range(60)] == [
        f"file {i}\n".encode() for i in range(60)]
    assert all(not p.is_symlink() and p.read_text() == f"file {p.stem[1:]}\n"
               for p in tree.iterdir())


def test_a_seed_replays_the_same_whatever_real_time_its_scans_start_at(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Which files a sandbox's scan skips as unchanged depends on real time (the racy
    window: their real mtimes against the scan's real start), and every file read draws
    from the schedule's RNG: seed 470 gave 13 to 26 faults on a loaded machine. In a
    schedule every file is read, whatever the clock says."""
    from types import SimpleNamespace

    from nemo_ckpt.trees import scan as scan_module

    first = simulation.run_one(470, tracing=True)
    monkeypatch.setattr(scan_module, "time", SimpleNamespace(time_ns=lambda: 1 << 62))
    later = simulation.run_one(470, tracing=True)  # every file outside the racy window
    assert (later.trace, later.faults) == (first.trace, first.faults)
    assert any("swaps" in line for line in first.trace)  # its scans meet the hostile process
