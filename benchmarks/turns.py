"""A turn's cost against its rollout's length (``Held.with_turn``: turns by delta).

Two rows, each with its own baseline in the same run:

- ``worker``: one session's turns through ``SessionClient`` on an embedded Ray instance
  (the worker in this process, the holder in its actor), each turn a record of
  ``--record-kib`` (a tool's output: a file, a test log) and a state of ``--state-kib``;
  the median turn around turn 20 against the median around turn ``--turns``. Target:
  at most 1.2x.
- ``holder``: a holder's own turn rate (``SessionHolder`` in this process, no Ray), one
  turn of each of ``--sessions`` sessions per round, on sessions of ``--long`` turns
  against sessions of ``--short`` turns, rounds alternating between the two holders so
  they share the machine's load. Target: the long sessions' rate at least 0.8x the
  short ones'.

    python -m benchmarks.turns [--turns 1000] [--sessions 1000 --long 200 --short 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from actors.holder.actor import SessionHolder
from benchmarks.common import bench_config, on_local_ray, print_verdicts
from nemo_ckpt import RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.transport import Runtime

KiB = 1 << 10


async def worker_turns(work: Path, turns: int, window: int, record_kib: int,
                       state_kib: int) -> list[float]:
    """Seconds of each turn of one session, through SessionClient on Ray."""
    config = bench_config("bench-turns", 120.0).model_copy(
        update={"checkpoint_root": work / "ckpt"})
    ckpt = RayEnvironmentCheckpoint(config)
    holders = await ckpt.ensure_holders()
    client = await SessionClient.connect(instance_id=holders[0].instance_id,
                                         namespace=config.namespace)
    ep = EnvironmentEpisode("long-rollout", 0)
    await client.open(ep, os.urandom(state_kib * KiB))
    records = [os.urandom(record_kib * KiB) for _ in range(8)]
    state = os.urandom(state_kib * KiB)
    took: list[float] = []
    for n in range(turns):
        start = time.perf_counter()
        async with client.turn(ep) as turn:
            turn.complete(records[n % len(records)], state, [f"long-rollout/{n}"])
        took.append(time.perf_counter() - start)
    last = await client.read_turns(ep, -1)
    assert last == (records[(turns - 1) % len(records)],), "the last record read back"
    await ckpt.shutdown(wait=True)
    return took


async def holder_rates(sessions: int, long: int, short: int, rounds: int,
                       record_bytes: int) -> dict[str, list[float]]:
    """Turns per second of a holder, round by round, on long and on short sessions."""
    record, state = os.urandom(record_bytes), os.urandom(256)
    holders = {"long": SessionHolder("holder-long", node_id="n", runtime=Runtime()),
               "short": SessionHolder("holder-short", node_id="n", runtime=Runtime())}
    eps = [EnvironmentEpisode(f"rollout-{i:05d}", 0) for i in range(sessions)]
    tokens = iter(range(1 << 62))

    async def one_round(h: SessionHolder) -> float:
        start = time.perf_counter()
        for ep in eps:
            token = f"t{next(tokens)}"
            await h.begin_turn(ep, token)
            await h.commit_turn(ep, token, record, state, [f"{ep.rollout_id}/{token}"])
        return sessions / (time.perf_counter() - start)

    for name, h in holders.items():
        await h.open_sessions([(ep, state) for ep in eps])
        for _ in range(long if name == "long" else short):
            await one_round(h)
    rates: dict[str, list[float]] = {"long": [], "short": []}
    for r in range(rounds):
        for name in (("long", "short") if r % 2 else ("short", "long")):
            rates[name].append(await one_round(holders[name]))
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=1000)
    p.add_argument("--window", type=int, default=20, help="turns on each side of a point")
    p.add_argument("--record-kib", type=int, default=64)
    p.add_argument("--state-kib", type=int, default=4)
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--long", type=int, default=200)
    p.add_argument("--short", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--holder-record-bytes", type=int, default=1024)
    args = p.parse_args(argv)
    if args.turns < 20 + args.window:
        p.error(f"--turns must be at least {20 + args.window}")

    took = on_local_ray(lambda work: worker_turns(work, args.turns, args.window,
                                                  args.record_kib, args.state_kib),
                        "bench-turns-")
    half = args.window // 2
    early = statistics.median(took[20 - half:20 + half])
    late = statistics.median(took[args.turns - args.window:])
    print(f"worker: one session, {args.record_kib} KiB records, {args.state_kib} KiB state, "
          f"through SessionClient on Ray")
    print(f"  turn 20 (median of turns {21 - half}-{20 + half}): {early * 1e3:.2f} ms")
    print(f"  turn {args.turns} (median of the last {args.window}): {late * 1e3:.2f} ms")
    print(f"  ratio {late / early:.2f}; the session held "
          f"{args.turns * args.record_kib / 1024:.0f} MiB of turn records at the end")

    rates = asyncio.run(holder_rates(args.sessions, args.long, args.short, args.rounds,
                                     args.holder_record_bytes))
    long_rate, short_rate = (statistics.median(rates[k]) for k in ("long", "short"))
    print(f"holder: {args.sessions} sessions, {args.holder_record_bytes} B records, "
          f"one turn of each per round, median of {args.rounds} rounds")
    print(f"  sessions of {args.short} turns: {short_rate:,.0f} turns/s")
    print(f"  sessions of {args.long} turns: {long_rate:,.0f} turns/s")
    print(f"  ratio {long_rate / short_rate:.2f}")
    print("targets:")
    print_verdicts([
        (f"a turn at turn {args.turns} costs at most 1.2x one at turn 20",
         late / early <= 1.2, f"{late / early:.2f}x"),
        (f"a holder's turn rate on sessions of {args.long} turns is at least 0.8x its "
         f"rate on sessions of {args.short}", long_rate / short_rate >= 0.8,
         f"{long_rate / short_rate:.2f}x")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
