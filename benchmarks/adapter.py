"""The adapter for other frameworks' environments (issue 28): what it costs per step, and
how long a continued rollout's rebuild by replay takes, each target printed HOLDS or
MISSED with its ratio against a baseline measured in the same run.

One embedded single-node Ray instance with one holder; this process is the worker.

1. Cost per step: SkyRL-gym's ``gsm8k_multi_turn`` stepped through
   ``AdaptedRollout.step`` against the same environment stepped by a hand-written worker
   in a bare ``SessionClient`` turn that commits the step's output as its record and
   the environment pickled as its state (the way to use nemo-ckpt without the adapter).
   Alternating blocks of ``--steps`` steps, medians per step.
2. Rebuild: a ``text2sql`` rollout of 20 turns (each a query of the SQLite database),
   run model-paced, then rebuilt by ``AdaptedRollout.resume`` (the session read, the
   environment made, 20 turns replayed and checked) against the time its 20 turns took.
   Model-paced: each turn waits ``--model-seconds`` for the model's generation before its
   step, as a worker waits for its model (a fixed stand-in, shorter than most agentic
   turns' generations).

    .venv/bin/python -m benchmarks.adapter
    .venv/bin/python -m benchmarks.adapter --quick   # fewer steps and rebuilds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.common import on_local_ray, print_verdicts
from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.adapters import AdaptedRollout
from nemo_ckpt.adapters.skyrl_gym import SkyRLGym
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.testing.text_envs import SQL_DB_ID, make_sql_database

STEP_TARGET = 1.5  # the adapter's cost per step, at most this times the bare turn's
REBUILD_TARGET = 0.05  # a 20-turn rebuild, at most this share of its model-paced turns
REBUILD_TURNS = 20


def gsm8k(steps: int) -> SkyRLGym:
    # Never done within the benchmark: the answer is never given.
    return SkyRLGym("gsm8k_multi_turn", extras={"reward_spec": {"ground_truth": "-1"},
                                                "max_turns": steps + 10, "extra_info": {}})


def action(turn: int) -> str:
    return f"Turn {turn}: adding it up gives {turn * 7}. #### {turn * 7}"


async def bare_steps(client: SessionClient, episode: EnvironmentEpisode, steps: int) -> float:
    """Seconds per step of the hand-written worker: a bare turn that steps the environment
    and commits its output as the record and the pickled environment as the state."""
    framework = gsm8k(steps)
    env = framework.make(None)
    observations, _ = env.init([{"role": "user", "content": "What is 6 times 7?"}])
    await client.open(episode, state=pickle.dumps(env))
    started = time.perf_counter()
    for t in range(1, steps + 1):
        async with client.turn(episode) as turn:
            out = env.step(action(t))
            turn.complete(json.dumps(out).encode(), pickle.dumps(env))
    return (time.perf_counter() - started) / steps


async def adapted_steps(client: SessionClient, episode: EnvironmentEpisode,
                        steps: int) -> float:
    """Seconds per step of the same environment through ``AdaptedRollout.step``."""
    framework = gsm8k(steps)
    rollout = await AdaptedRollout.start(client, episode, framework,
                                         [{"role": "user", "content": "What is 6 times 7?"}])
    started = time.perf_counter()
    for t in range(1, steps + 1):
        await rollout.step(action(t))
    rollout.close()
    return (time.perf_counter() - started) / steps


def sql(db_root: Path) -> SkyRLGym:
    return SkyRLGym("text2sql", env_config=SimpleNamespace(db_path=str(db_root)),
                    extras={"db_id": SQL_DB_ID, "data": "spider",
                            "reward_spec": {"ground_truth": "SELECT SUM(qty) FROM orders"},
                            "max_turns": REBUILD_TURNS + 5})


def query(turn: int) -> str:
    return f"Looking again. <sql>SELECT COUNT(*) FROM orders WHERE qty > {turn % 9}</sql>"


async def rebuild(client: SessionClient, db_root: Path, model_seconds: float, rounds: int,
                  k: int) -> tuple[float, float]:
    """(seconds the 20 model-paced turns took, median seconds of their rebuild)."""
    framework = sql(db_root)
    episode = EnvironmentEpisode(f"sql-{k}", 0)
    started = time.perf_counter()
    rollout = await AdaptedRollout.start(client, episode, framework,
                                         [{"role": "user", "content": "How many?"}])
    for t in range(1, REBUILD_TURNS):  # init and 19 steps: 20 turns
        await asyncio.sleep(model_seconds)  # the model's generation
        await rollout.step(query(t))
    paced = time.perf_counter() - started
    rollout.close()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        again = await AdaptedRollout.resume(client, episode, framework)
        times.append(time.perf_counter() - t0)
        assert again.rebuilt_by == "replay" and len(again.replayed) == REBUILD_TURNS
        again.close()
    return paced, statistics.median(times)


async def run(args: argparse.Namespace, work: Path) -> list[tuple[str, bool, str]]:
    ckpt = RayEnvironmentCheckpoint(CheckpointConfig(namespace="bench-adapter",
                                                     checkpoint_root=work / "ckpt"))
    await ckpt.shutdown(wait=True)
    (instance,) = [h.instance_id for h in await ckpt.ensure_holders()]
    client = await SessionClient.connect(instance, namespace="bench-adapter")
    try:
        await bare_steps(client, EnvironmentEpisode("warm-bare", 0), 20)
        await adapted_steps(client, EnvironmentEpisode("warm-adapted", 0), 20)
        bare: list[float] = []
        adapted: list[float] = []
        for block in range(args.blocks):  # alternately first: drift hits both ways
            ways = [("bare", bare_steps, bare), ("adapted", adapted_steps, adapted)]
            for name, steps_of, times in ways if block % 2 == 0 else ways[::-1]:
                times.append(await steps_of(client, EnvironmentEpisode(f"{name}-{block}", 0),
                                            args.steps))
        b, a = statistics.median(bare), statistics.median(adapted)
        step_ratio = a / b
        db_root = work / "sql"
        make_sql_database(db_root)
        paced, rebuilt = await rebuild(client, db_root, args.model_seconds, args.rebuilds, 0)
        share = rebuilt / paced
    finally:
        ckpt.shutdown()
    print(f"cost per step (gsm8k_multi_turn, medians of {args.blocks} blocks of "
          f"{args.steps} steps): bare SessionClient turn with the pickled env as state "
          f"{b * 1e3:.3f} ms, AdaptedRollout.step {a * 1e3:.3f} ms: {step_ratio:.2f}x")
    print(f"rebuild of a {REBUILD_TURNS}-turn text2sql rollout (median of {args.rebuilds}): "
          f"{rebuilt * 1e3:.1f} ms, against {paced:.2f} s for its {REBUILD_TURNS} "
          f"model-paced turns ({args.model_seconds:.2f} s of model time each): "
          f"{share * 100:.2f}%")
    return [
        (f"adapter's cost per step <= {STEP_TARGET}x a bare SessionClient turn with the "
         f"state as bytes", step_ratio <= STEP_TARGET,
         f"{a * 1e3:.3f} ms vs {b * 1e3:.3f} ms = {step_ratio:.2f}x"),
        (f"a {REBUILD_TURNS}-turn replayed rollout rebuilds in <= {REBUILD_TARGET:.0%} of "
         f"its model-paced turns", share <= REBUILD_TARGET,
         f"{rebuilt * 1e3:.1f} ms vs {paced:.2f} s = {share * 100:.2f}% (model-paced: "
         f"{args.model_seconds:.2f} s of model time per turn)"),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps per timed block")
    p.add_argument("--blocks", type=int, default=6, help="timed blocks per way (alternating)")
    p.add_argument("--rebuilds", type=int, default=7, help="timed rebuilds (median)")
    p.add_argument("--model-seconds", type=float, default=0.2,
                   help="the model's time per turn of the model-paced rollout")
    p.add_argument("--quick", action="store_true", help="2 blocks of 50 steps, 3 rebuilds")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.blocks, args.rebuilds = 50, 2, 3
    results = on_local_ray(lambda work: run(args, work), "nemo-ckpt-adapter-bench-")
    print()
    print_verdicts(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
