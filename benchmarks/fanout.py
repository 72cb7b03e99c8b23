"""The fan-out model (``python -m benchmarks.fanout``; ``make bench`` runs it too): what
the coordinator's own work costs per holder, phase by phase, and what that predicts for
the entry and the pause at 256 and 1,000 nodes.

Measured in one run:

- **Real holders** (4, 16 and 64 on a 4-node local cluster; 16 and 64 are placed on the
  same 4 nodes, as the scale series' wide point is): the coordinator's own code
  (``actors.coordinator.actor.CheckpointCoordinator``) runs in this process over Ray's
  transport and drives one empty snapshot and one restore of it per repetition.
- **Simulated holders** (256 and 1,024): the same coordinator code in this process over
  the simulation's transport (``actors.sim``), one simulated node per holder.
- **Ray's cost per actor call at the caller**: an empty actor method called from this
  process on the same cluster, many calls in flight as a fan-out sends them.

"The coordinator's own CPU" is this thread's CPU time (``time.thread_time``) spent in the
steps of the coordinator's asyncio tasks (every task its calls start), counted per task
step through a task factory: the machine is shared, so wall time would count other
processes. Under Ray it includes the Ray calls' submission, which runs in those steps; a
Ray call's completion runs in Ray's threads and the loop's callbacks, counted apart as
this process's CPU (``resource.getrusage``). In the simulation, the holders' tasks and the
transport's deliveries are not the coordinator's and are not counted.

Phases, each from a coordinator call's start to its phase log line
(``actors.coordinator.holders.log_phase``): ``begin_snapshot`` (``begin_snapshot``),
``release`` (``commit_snapshot``'s first step: the releases go out before it waits for
anything), ``finish_writes`` (the rest of ``commit_snapshot`` up to its phase line),
``prepare_restore`` and ``commit_restore``; besides, ``start_writes`` (one message per
holder) and the commit's tail after its phase line (manifest, resume, clean-up).

The model: a phase's coordinator work at N holders is ``fixed + N x (per-holder CPU +
Ray's per-call cost)``, where ``fixed`` is the intercept of the real holders' fit, the
per-holder CPU the slope of the simulated points (the coordinator's code alone), and
Ray's per-call cost the empty call's. Each holder is on a node of its own with its own
cores, so the holders' own part runs in parallel and stays what it is at 4 holders:
``entry(N) = entry(4) + work(N) - work(4)`` for ``begin_snapshot``, and the pause adds the
release's work the same way: ``paused(N) = paused(4) + (begin_snapshot + release work at N)
- (the same at 4)``, with ``paused(4)`` the 4 holders' entry plus two call round trips
(the driver's commit to the coordinator, the release to a holder). Targets: the
predicted coordinator work of the entry at 1,000 nodes <= 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import collections.abc
import json
import logging
import math
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from actors.coordinator.actor import CheckpointCoordinator
from actors.coordinator.holders import PHASE_LOGGER
from actors.ray_transport import RayTransport
from actors.sim import SimWorld, current_actor
from benchmarks.common import (
    LocalCluster,
    MiB,
    bench_config,
    format_table,
    format_targets,
    median,
    target,
)
from benchmarks.scale import NODES, make_instances
from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint
from nemo_ckpt.protocol.operations import new_operation_id
from nemo_ckpt.transport import COORDINATOR

# (holders, relayed): the flat fan-out's fit, and the relays at the widest real point.
REAL_POINTS = ((4, False), (16, False), (64, False), (64, True))
QUICK_REAL_POINTS = ((4, False), (16, False), (16, True))
SIM_POINTS = ((256, False), (1024, False), (256, True), (1024, True))
FLAT = 1_000_000  # relay_min_holders that no point reaches
PREDICT_NODES = (256, 1000)
PHASES = ("begin_snapshot", "release", "finish_writes", "prepare_restore", "commit_restore")
ENTRY_TARGET_MS = 100.0
_PHASE_PREFIX = "nemo_ckpt "


# --- the coordinator's own CPU ---------------------------------------------------------------


class _Timed(collections.abc.Coroutine):
    """A task's coroutine whose every step adds this thread's CPU time to its owner's."""

    def __init__(self, coro: Coroutine[Any, Any, Any], account: CpuAccount, owner: str,
                 ) -> None:
        self._coro = coro
        self._account = account
        self._owner = owner
        self.first_step: float | None = None

    def _step(self, fn: Callable[..., Any], *args: Any) -> Any:
        t = time.thread_time()
        try:
            return fn(*args)
        finally:
            spent = time.thread_time() - t
            self._account.add(self._owner, spent)
            if self.first_step is None:
                self.first_step = spent

    def send(self, value: Any) -> Any:
        return self._step(self._coro.send, value)

    def throw(self, *args: Any) -> Any:
        return self._step(self._coro.throw, *args)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._coro.__await__()


class CpuAccount:
    """This thread's CPU seconds in asyncio task steps, by the owner of each task
    (``owner_of()`` when the task is made), through the loop's task factory."""

    def __init__(self, owner_of: Callable[[], str]) -> None:
        self._owner_of = owner_of
        self.totals: dict[str, float] = {}
        self.last: _Timed | None = None  # the coroutine of the task made last

    def add(self, owner: str, seconds: float) -> None:
        self.totals[owner] = self.totals.get(owner, 0.0) + seconds

    def of(self, owner: str) -> float:
        return self.totals.get(owner, 0.0)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        inner = loop.get_task_factory()

        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> Any:
            timed = _Timed(coro, self, self._owner_of())
            self.last = timed
            if inner is not None:
                return inner(loop, timed, **kw)
            return asyncio.Task(timed, loop=loop, **kw)

        loop.set_task_factory(factory)


class _PhaseMarks(logging.Handler):
    """The coordinator's CPU so far as each phase line is logged, by (operation, phase)."""

    def __init__(self, account: CpuAccount) -> None:
        super().__init__(logging.INFO)
        self._account = account
        self.marks: dict[tuple[str, str], float] = {}
        self._logger = logging.getLogger(PHASE_LOGGER)
        self._level = self._logger.level
        self._propagate = self._logger.propagate

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_PHASE_PREFIX + "{"):
            line = json.loads(message[len(_PHASE_PREFIX):])
            if line.get("event") == "phase":
                self.marks[(line["operation"], line["phase"])] = self._account.of(COORDINATOR)

    def __enter__(self) -> _PhaseMarks:
        self._level = self._logger.level
        self._propagate = self._logger.propagate
        self._logger.setLevel(logging.INFO)
        self._logger.propagate = False  # the lines are read here, not printed
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
        self._logger.propagate = self._propagate


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class _Rep:
    """One repetition's CPU milliseconds per phase (coordinator steps; process)."""

    cpu: dict[str, float] = field(default_factory=dict)
    process: dict[str, float] = field(default_factory=dict)
    entry_ms: float = 0.0


async def _one_round(coord: CheckpointCoordinator, account: CpuAccount, marks: _PhaseMarks,
                     path: str, seq: int) -> _Rep:
    """One empty snapshot and one restore of it, each coordinator call its own task."""
    rep = _Rep()
    sid = new_operation_id("snap", time.time(), uuid.uuid4().hex, seq)
    rid = new_operation_id("restore", time.time(), uuid.uuid4().hex, seq)
    loop = asyncio.get_running_loop()

    async def call(name: str, coro: Coroutine[Any, Any, Any], op: str, phase: str | None
                   ) -> tuple[Any, _Timed | None]:
        c0, p0, t0 = account.of(COORDINATOR), _process_cpu(), time.perf_counter()
        task = loop.create_task(coro)
        timed = account.last
        result = await task
        c1, p1, t1 = account.of(COORDINATOR), _process_cpu(), time.perf_counter()
        mark = marks.marks.get((op, phase)) if phase else None
        if name == "begin":
            rep.entry_ms = (t1 - t0) * 1e3
        if phase is None or mark is None:
            rep.cpu[name] = (c1 - c0) * 1e3
        else:
            rep.cpu[phase] = (mark - c0) * 1e3
            rep.cpu[f"{name} tail"] = (c1 - mark) * 1e3
        rep.process[name] = (p1 - p0) * 1e3
        return result, timed

    await call("begin", coord.begin_snapshot(sid, path), sid, "begin_snapshot")
    await call("start_writes", coord.start_writes(sid), sid, None)
    _, timed = await call("commit", coord.commit_snapshot(sid, path, {}, 0), sid,
                          "finish_writes")
    if timed is not None and timed.first_step is not None:
        release = timed.first_step * 1e3
        rep.cpu["release"] = release
        rep.cpu["finish_writes"] -= release
    await call("prepare", coord.prepare_restore(rid, path), rid, "prepare_restore")
    await call("commit_restore", coord.commit_restore(rid), rid, "commit_restore")
    return rep


def _summarise(holders: int, where: str, relayed: bool, reps: list[_Rep]) -> dict[str, Any]:
    keys = sorted({k for r in reps for k in r.cpu})
    pkeys = sorted({k for r in reps for k in r.process})
    return {
        "holders": holders, "where": where, "relayed": relayed, "repeats": len(reps),
        "cpu_ms": {k: round(median([r.cpu.get(k) for r in reps]), 3) for k in keys},
        "process_cpu_ms": {k: round(median([r.process.get(k) for r in reps]), 3)
                           for k in pkeys},
        "entry_ms": round(median([r.entry_ms for r in reps]), 3),
    }


# --- real holders ------------------------------------------------------------------------------


def _config(namespace: str, relayed: bool) -> CheckpointConfig:
    return bench_config(namespace, 600.0).model_copy(
        update={"relay_min_holders": 2 if relayed else FLAT})


async def measure_real(holders: int, relayed: bool, repeats: int, workdir: Path
                       ) -> dict[str, Any]:
    ns = f"fanout-{uuid.uuid4().hex[:8]}"
    config = _config(ns, relayed)
    ckpt = RayEnvironmentCheckpoint(config)
    point = workdir / f"real-{holders}-{relayed}"
    try:
        names = await make_instances(ckpt, holders, point)
        if len(names) != holders:
            raise RuntimeError(f"{len(names)} holders, not {holders}")
        account = CpuAccount(lambda: COORDINATOR)
        account.install(asyncio.get_running_loop())
        coord = CheckpointCoordinator(config, RayTransport(config))
        reps = []
        with _PhaseMarks(account) as marks:
            for r in range(repeats + 1):  # the first is a warm-up
                rep = await _one_round(coord, account, marks, str(point / f"s{r % 2}"), r)
                if r:
                    reps.append(rep)
        return _summarise(holders, "ray", relayed, reps)
    finally:
        asyncio.get_running_loop().set_task_factory(None)
        ckpt.shutdown()
        shutil.rmtree(point, ignore_errors=True)


# --- simulated holders -------------------------------------------------------------------------


def measure_simulated(holders: int, relayed: bool, repeats: int, workdir: Path
                      ) -> dict[str, Any]:
    """The same rounds over the simulation's transport: one node per holder, every
    message delivered after 0.1 ms of virtual time, file work at no virtual cost. A
    relay's tasks are its own, not the coordinator's (it runs on another node)."""
    world = SimWorld(seed=holders, nodes=holders)
    world.message_delay = lambda target, method, reply: 0.0001
    world.io_cost = lambda name: 0.0001
    config = _config(f"fanout-sim-{holders}", relayed)
    me = world.new_actor(COORDINATOR, "coordinator", "node-0")
    coord = CheckpointCoordinator(config, world.transport(me, config))

    def owner() -> str:
        actor = current_actor.get()
        return "other" if actor is None else actor.kind

    account = CpuAccount(owner)
    account.install(world.loop)
    point = workdir / f"sim-{holders}-{relayed}"
    point.mkdir(parents=True, exist_ok=True)

    async def rounds() -> list[_Rep]:
        reps = []
        with _PhaseMarks(account) as marks:
            for r in range(repeats + 1):
                rep = await _one_round(coord, account, marks, str(point / f"s{r % 2}"), r)
                if r:
                    reps.append(rep)
        return reps

    try:
        reps = world.loop.run_until_complete(world.spawn(me, rounds()))
        return _summarise(holders, "simulated", relayed, reps)
    finally:
        for actor in world.actors:  # their tasks end with them
            world.kill(actor)
        world.loop.run_until_complete(asyncio.sleep(0))
        world.loop.close()
        shutil.rmtree(point, ignore_errors=True)


# --- Ray's cost per call ------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class _Empty:
    async def nothing(self, payload: Any = None) -> None:
        return None


async def ray_call_cost(calls: int = 512, rounds: int = 5) -> dict[str, Any]:
    """Per call at the caller: this thread's CPU to send ``calls`` empty calls at once
    and await them all (submission and completion in the loop), and this process's CPU
    over the same (Ray's threads included); and one call's round trip, alone."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    actors = [_Empty.options(scheduling_strategy=NodeAffinitySchedulingStrategy(  # type: ignore[attr-defined]
        n, soft=False)).remote() for n in nodes]
    try:
        await asyncio.gather(*(a.nothing.remote() for a in actors))
        thread, process, trips = [], [], []
        for _ in range(rounds + 1):
            t0, p0 = time.thread_time(), _process_cpu()
            await asyncio.gather(*(actors[k % len(actors)].nothing.remote()
                                   for k in range(calls)))
            thread.append((time.thread_time() - t0) / calls)
            process.append((_process_cpu() - p0) / calls)
        for _ in range(50):
            t = time.perf_counter()
            await actors[0].nothing.remote()
            trips.append(time.perf_counter() - t)
        # A relay's call carries its group's handles: their serialization, per handle.
        group = {f"holder-{k}": (actors[k % len(actors)], ("snap",)) for k in range(64)}
        carried = []
        for _ in range(rounds + 1):
            p0 = _process_cpu()
            await asyncio.gather(*(actors[k % len(actors)].nothing.remote(group)
                                   for k in range(calls // 8)))
            carried.append((_process_cpu() - p0) / (calls // 8))
        per_handle = max(median(carried[1:]) - median(process[1:]), 0.0) / len(group)
        return {"calls": calls, "thread_us": round(median(thread[1:]) * 1e6, 1),
                "process_us": round(median(process[1:]) * 1e6, 1),
                "handle_us": round(per_handle * 1e6, 1),
                "round_trip_ms": round(median(trips) * 1e3, 3)}
    finally:
        for a in actors:
            ray.kill(a)


# --- the model -----------------------------------------------------------------------------------


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ms against holders."""
    if len(points) < 2:
        return (points[0][1] if points else 0.0), 0.0
    slope, intercept = statistics.linear_regression([float(h) for h, _ in points],
                                                    [v for _, v in points])
    return intercept, slope


def _points(points: list[dict[str, Any]], phase: str) -> list[tuple[int, float]]:
    return [(p["holders"], p["cpu_ms"][phase]) for p in points if phase in p["cpu_ms"]]


def groups_of(nodes: int) -> int:
    """The relays of a fan-out to ``nodes`` holders (``HolderRegistry._groups``)."""
    return math.ceil(nodes / math.ceil(math.sqrt(nodes)))


def model(real: list[dict[str, Any]], simulated: list[dict[str, Any]],
          call: dict[str, Any]) -> dict[str, Any]:
    """Per phase and fan-out (flat, relayed): the fit, and the coordinator's work
    predicted per node count; then the entry and the pause."""
    ray_call_ms = call["process_us"] / 1e3
    handle_ms = call["handle_us"] / 1e3
    flat_real = [p for p in real if not p["relayed"]]
    flat_sim = [p for p in simulated if not p["relayed"]]
    relay_sim = [p for p in simulated if p["relayed"]]
    phases: dict[str, Any] = {}
    for phase in PHASES:
        fixed, real_slope = _fit(_points(flat_real, phase))
        fixed = max(fixed, 0.0)
        flat_slope = max(_fit(_points(flat_sim, phase))[1], 0.0)
        relay_slope = max(_fit(_points(relay_sim, phase))[1], 0.0)
        phases[phase] = {
            "fixed_ms": round(fixed, 3), "real_slope_us": round(real_slope * 1e3, 2),
            "flat_slope_us": round(flat_slope * 1e3, 2),
            "relayed_slope_us": round(relay_slope * 1e3, 2),
            "flat_ms": {n: round(fixed + n * (flat_slope + ray_call_ms), 1)
                        for n in PREDICT_NODES},
            "relayed_ms": {n: round(fixed + groups_of(n) * ray_call_ms
                                    + n * (relay_slope + handle_ms), 1)
                           for n in PREDICT_NODES},
        }
    four = next(p for p in flat_real if p["holders"] == NODES)
    work4 = four["cpu_ms"]["begin_snapshot"]
    release4 = four["cpu_ms"].get("release", 0.0)
    paused4 = four["entry_ms"] + 2 * call["round_trip_ms"]
    predictions: dict[int, dict[str, Any]] = {}
    for n in PREDICT_NODES:
        # A relay's own leg: its calls to its group, on its own node, and one more hop.
        leg = math.ceil(n / groups_of(n)) * ray_call_ms + call["round_trip_ms"]
        predictions[n] = {"relays": groups_of(n)}
        for kind, extra in (("flat", 0.0), ("relayed", leg)):
            work = phases["begin_snapshot"][f"{kind}_ms"][n]
            release = phases["release"][f"{kind}_ms"][n]
            predictions[n][kind] = {
                "entry_work_ms": work,
                "entry_ms": round(four["entry_ms"] + work - work4 + extra, 1),
                "paused_ms": round(paused4 + work + release - work4 - release4 + 2 * extra,
                                   1),
            }
    return {"ray_call": call, "phases": phases, "predictions": predictions,
            "entry4_ms": four["entry_ms"], "paused4_ms": round(paused4, 1)}


def built(nodes: int) -> str:
    """The fan-out the coordinator uses at ``nodes`` holders by default."""
    return "relayed" if nodes >= CheckpointConfig().relay_min_holders else "flat"


def fanout_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    kind = built(1000)
    work = result["model"]["predictions"][1000][kind]["entry_work_ms"]
    return [target("predicted entry's coordinator work at 1,000 nodes", f"model, {kind}",
                   work, work <= ENTRY_TARGET_MS, f"<= {ENTRY_TARGET_MS:.0f} ms")]


def format_fanout(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = ["fan-out: the coordinator's own CPU per phase, ms (median of its task steps; "
             "entry: the begin call's wall time, real holders only):"]
    head = ("holders", "where", "fan-out", "entry ms", *PHASES, "start_writes",
            "commit tail")
    rows = []
    for p in result["real"] + result["simulated"]:
        c = p["cpu_ms"]
        entry = f"{p['entry_ms']:.1f}" if p["where"] == "ray" else "-"
        rows.append((p["holders"], p["where"], "relayed" if p["relayed"] else "flat", entry,
                     *(f"{c.get(k, float('nan')):.2f}" for k in PHASES),
                     f"{c.get('start_writes', float('nan')):.2f}",
                     f"{c.get('commit tail', float('nan')):.2f}"))
    lines += format_table(head, rows, indent="  ")
    call = m["ray_call"]
    lines.append(f"Ray's cost per empty actor call at the caller ({call['calls']} in "
                 f"flight): {call['thread_us']} us on the loop thread, "
                 f"{call['process_us']} us of this process's CPU (the model's figure); one "
                 f"round trip {call['round_trip_ms']} ms; a holder's handle carried in a "
                 f"relay's call {call['handle_us']} us")
    lines.append("coordinator work per phase: flat = fixed + N x (per-holder CPU + Ray's "
                 "per call); relayed = fixed + relays x Ray's per call")
    lines.append("  + N x (per-holder CPU + a handle carried) (fixed: the real flat fit's "
                 "intercept; per-holder: the simulated slope):")
    for phase, f in m["phases"].items():
        flat = ", ".join(f"{n}: {v}" for n, v in f["flat_ms"].items())
        relayed = ", ".join(f"{n}: {v}" for n, v in f["relayed_ms"].items())
        lines.append(f"  {phase:<15} fixed {f['fixed_ms']:.2f} ms; per holder: flat "
                     f"{f['flat_slope_us']:.1f} us, relayed {f['relayed_slope_us']:.1f} us "
                     f"(real flat fit {f['real_slope_us']:.1f} us, Ray's included); "
                     f"predicted ms flat {flat}; relayed {relayed}")
    lines.append(f"prediction (each holder on a node of its own, doing its part in parallel; "
                 f"measured at 4: entry {m['entry4_ms']:.1f} ms, paused ~{m['paused4_ms']:.1f}"
                 f" ms):")
    for n, p in m["predictions"].items():
        f, r = p["flat"], p["relayed"]
        lines.append(f"  {n:>5} nodes: flat entry {f['entry_ms']} ms (coordinator work "
                     f"{f['entry_work_ms']}), paused {f['paused_ms']} ms; relayed "
                     f"({p['relays']} relays) entry {r['entry_ms']} ms (coordinator work "
                     f"{r['entry_work_ms']}), paused {r['paused_ms']} ms; built: {built(n)}")
    return "\n".join(lines)


async def run_fanout(quick: bool, workdir: Path, repeats: int) -> dict[str, Any]:
    """The whole model on a running local cluster of ``NODES`` nodes."""
    quiet = logging.getLogger("nemo_ckpt")
    level = quiet.level
    # The restores' holders warn as the next round undoes them; only phase lines count.
    quiet.setLevel(logging.ERROR)
    try:
        return await _run_fanout(quick, workdir, repeats)
    finally:
        quiet.setLevel(level)


async def _run_fanout(quick: bool, workdir: Path, repeats: int) -> dict[str, Any]:
    real = []
    for holders, relayed in (QUICK_REAL_POINTS if quick else REAL_POINTS):
        print(f"fan-out: {holders} real holders on {NODES} nodes"
              f"{', relayed' if relayed else ''} ...", flush=True)
        real.append(await measure_real(holders, relayed, repeats, workdir))
    simulated = []
    for holders, relayed in SIM_POINTS:
        print(f"fan-out: {holders} simulated holders{', relayed' if relayed else ''} ...",
              flush=True)
        simulated.append(await asyncio.to_thread(measure_simulated, holders, relayed,
                                                 repeats, workdir))
    call = await ray_call_cost()
    return {"real": real, "simulated": simulated,
            "model": model(real, simulated, call)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 and 16 real holders only")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    workdir = Path(tempfile.mkdtemp(prefix="nemo-ckpt-fanout-"))
    cluster = LocalCluster(512 * MiB)
    try:
        cluster.grow_to(NODES)
        result = asyncio.run(run_fanout(args.quick, workdir, args.repeats))
    finally:
        cluster.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    print(format_fanout(result))
    print(format_targets(fanout_targets(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
