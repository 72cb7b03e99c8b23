"""SkyRL-gym tasks with a scripted, seeded policy in the model's place, for the
adapter's tests, example and benchmark (``nemo_ckpt.adapters``): ``gsm8k_multi_turn``,
``text2sql`` over a small SQLite database made here, and ``rlm`` (a live Python REPL the
policy writes code into), and the crash-free reference run a recovered rollout must
equal. SkyRL-gym is imported only when an environment is made."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from nemo_ckpt.adapters.skyrl_gym import SkyRLGym
from nemo_ckpt.adapters.step_output import StepOutput

__all__ = ["TextTask", "gsm8k_task", "sql_task", "rlm_task", "make_sql_database",
           "reference_outputs", "SQL_DB_ID", "RLM_ENV_ID"]

SQL_DB_ID = "shop"
# Single-row integer answers: SkyRL-gym's SQL tool renders a result set through a
# frozenset, whose order for strings changes with each process's hash seed.
_QUERIES = ("SELECT COUNT(*) FROM orders", "SELECT SUM(qty) FROM orders",
            "SELECT MAX(price) FROM orders", "SELECT SUM(qty * price) FROM orders",
            "SELECT COUNT(*) FROM orders WHERE qty > 3")
_GOLD = "SELECT SUM(qty) FROM orders"


def make_sql_database(root: Path) -> Path:
    """A small SQLite database where ``text2sql`` looks for Spider's (``root`` is its
    ``db_path``); returns the database file."""
    folder = root / "spider" / "database" / SQL_DB_ID
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / f"{SQL_DB_ID}.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE IF EXISTS orders")
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, qty INTEGER, price INTEGER)")
        conn.executemany("INSERT INTO orders VALUES (?, ?, ?)",
                         [(i, (i * 7) % 9 + 1, (i * 13) % 50 + 5) for i in range(1, 41)])
    return db


@dataclass(frozen=True)
class TextTask:
    """One rollout's task: its environment, its prompt, and the scripted policy that
    answers for the model (``policy(turn)``: the action of step ``turn``, 1-based)."""

    rollout_id: str
    framework: SkyRLGym
    prompt: list[dict[str, str]]
    policy: Callable[[int], str]


def gsm8k_task(rollout_id: str, seed: int, max_turns: int = 5) -> TextTask:
    """A ``gsm8k_multi_turn`` rollout whose answer the policy guesses, seeded."""
    rng = random.Random(f"{seed}:{rollout_id}")
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    answer = a * b
    framework = SkyRLGym("gsm8k_multi_turn", extras={
        "reward_spec": {"ground_truth": str(answer)}, "max_turns": max_turns,
        "extra_info": {}})
    prompt = [{"role": "user", "content": f"What is {a} times {b}?"}]

    def policy(turn: int) -> str:
        r = random.Random(f"{seed}:{rollout_id}:{turn}")
        guess = answer if r.random() < 0.25 else answer + r.randint(-9, 9)
        return f"Turn {turn}: {a} * {b} is about {guess}. #### {guess}"

    return TextTask(rollout_id, framework, prompt, policy)


def sql_task(rollout_id: str, seed: int, db_root: Path, max_turns: int = 5) -> TextTask:
    """A ``text2sql`` rollout over ``make_sql_database(db_root)``: the policy queries,
    then answers, seeded."""
    framework = SkyRLGym("text2sql", env_config=SimpleNamespace(db_path=str(db_root)),
                         extras={"db_id": SQL_DB_ID, "reward_spec": {"ground_truth": _GOLD},
                                 "data": "spider", "max_turns": max_turns})
    prompt = [{"role": "user", "content": "How many items were ordered in total?"}]

    def policy(turn: int) -> str:
        r = random.Random(f"{seed}:{rollout_id}:{turn}")
        if turn > 2 and r.random() < 0.3:
            return f"The total is known. <solution>{_GOLD}</solution>"
        return f"Let me look. <sql>{r.choice(_QUERIES)}</sql>"

    return TextTask(rollout_id, framework, prompt, policy)


# SkyRL-gym 0.4 ships the RLM environment (skyrl_gym/envs/rlm) without registering it.
RLM_ENV_ID = "nemo_ckpt_rlm"
_WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
          "kappa", "lambda", "mu")


def _register_rlm() -> None:
    import skyrl_gym

    if RLM_ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=RLM_ENV_ID, entry_point="skyrl_gym.envs.rlm.env:BaseRLMEnv")


def rlm_task(rollout_id: str, seed: int, max_turns: int = 6) -> TextTask:
    """An ``rlm`` rollout: its context is seeded words, the policy explores them in the
    environment's persistent REPL over several turns (one turn without code), then
    answers with a variable it made (``FINAL_VAR``)."""
    _register_rlm()
    rng = random.Random(f"{seed}:{rollout_id}")
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 15)))
    k = rng.randint(3, 5)
    framework = SkyRLGym(RLM_ENV_ID, extras={
        "max_turns": max_turns, "repl_timeout": 30.0,
        "extra_info": {"context_text": words}})
    prompt = [{"role": "user", "content": f"How many words longer than {k} letters?"}]
    code = ["words = context.split()\nprint(len(words))",
            f"long = [w for w in words if len(w) > {k}]\nprint(long)",
            None,  # the model thinks aloud: no code this turn
            "answer = str(len(long))\nprint(answer)"]

    def policy(turn: int) -> str:
        if turn > len(code):
            return "```repl\nprint(answer)\n```\nFINAL_VAR(answer)"
        block = code[turn - 1]
        return "Thinking it over." if block is None else f"Next.\n```repl\n{block}\n```"

    return TextTask(rollout_id, framework, prompt, policy)


def reference_outputs(task: TextTask) -> list[StepOutput]:
    """What ``init`` and each step return in a run with no nemo-ckpt and no crash."""
    env: Any = task.framework.make(None)
    try:
        outputs = [task.framework.init(env, task.prompt)]
        while not outputs[-1].done:
            outputs.append(task.framework.step(env, task.policy(len(outputs))))
        return [StepOutput.from_plain(o.as_plain()) for o in outputs]
    finally:
        task.framework.close(env)
