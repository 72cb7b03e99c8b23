"""The scenario tests' harness: one job in-process (``actors.sim``), under
virtual time, with the real driver, coordinator and holders: a driver, holders on every
node, a worker's session clients, and hooks that aim a fault at one message. The
reviewed cases (``tests/simulation/test_reliability.py``), the sandbox sessions
(``tests/sandboxes/test_sandbox_sessions.py``) and the other in-process scenarios run on it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from actors.drills import PhaseDelays
from actors.sim import SimActor, SimWorld
from nemo_ckpt import RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.checkpoint_folder import environment_dir
from nemo_ckpt.testing.data_plane import StaticCut
from nemo_ckpt.transport import HOLDER

# A job's config with deadlines short enough for scenarios of a few leases.
CONFIG = CheckpointConfig(namespace="job", drain_timeout_s=1.0, lease_s=6.0,
                          phase_timeout_s=3.0, persist_timeout_s=15.0, turn_timeout_s=20.0)


class World:
    """One in-process job: a driver, holders on every node, a worker's clients. Its
    sandbox root, if its config names one, is made."""

    def __init__(self, tmp_path: Path, nodes: int = 3, config: CheckpointConfig = CONFIG,
                 seed: int = 0) -> None:
        self.config = config
        self.sim = SimWorld(seed=seed, nodes=nodes)
        self.sim.message_delay = lambda target, method, reply: 0.001
        self.root = tmp_path
        self.driver = self.sim.new_actor("driver", "driver", "node-0")
        self.worker = self.sim.new_actor("worker", "worker", "node-0")
        self.ckpt = self.checkpoint(self.driver, config)
        if config.sandbox_root is not None:
            config.sandbox_root.mkdir(exist_ok=True)

    @property
    def sandboxes(self) -> Path:
        assert self.config.sandbox_root is not None, "this job's config names no sandbox_root"
        return self.config.sandbox_root

    def checkpoint(self, actor: SimActor, config: CheckpointConfig) -> RayEnvironmentCheckpoint:
        return RayEnvironmentCheckpoint(config, self.sim.transport(actor, config))

    def run(self, coro: Coroutine[Any, Any, Any], actor: SimActor | None = None) -> Any:
        return self.sim.loop.run_until_complete(self.sim.spawn(actor or self.driver, coro))

    def close(self) -> None:
        loop = self.sim.loop
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()

    def path(self, name: str) -> Path:
        return self.root / name

    def holders(self) -> dict[str, Any]:
        return {a.name: a.obj for a in self.sim.live(HOLDER)}

    def holder_delays(self) -> dict[str, PhaseDelays]:
        """Where each live holder's phases wait (``actors.drills``), for a test to set."""
        return {a.name: a.delays for a in self.sim.live(HOLDER)}

    def states(self) -> dict[str, HolderState]:
        return {name: h.current[0] for name, h in self.holders().items()}

    async def client(self, instance: str) -> SessionClient:
        transport = self.sim.transport(self.worker, self.config)
        handle = transport.holder(instance)
        assert handle is not None
        return SessionClient(handle, transport)

    async def populate(self, turns: int = 2) -> dict[str, list[Ep]]:
        """Two rollouts per holder, ``turns`` committed turns each."""
        await self.ckpt.ensure_holders()
        live: dict[str, list[Ep]] = {}
        for instance in sorted(self.holders()):
            client = await self.client(instance)
            live[instance] = [Ep(f"{instance}-r{k}", 0) for k in range(2)]
            for ep in live[instance]:
                await client.open(ep, b"s0")
                for t in range(turns):
                    async with client.turn(ep) as turn:
                        turn.complete(f"t{t}".encode(), f"s{t + 1}".encode(),
                                      [f"{ep.capture_key}/row{t}"])
        return live

    async def snapshot(self, path: Path, live: dict[str, list[Ep]],
                       block: Callable[[], Awaitable[None]] | None = None) -> None:
        async with self.ckpt.snapshot(path) as snap:
            if snap is not None:
                await snap.check_against_cut(cut_of(live))
            if block is not None:
                await block()

    def on_send(self, method: str, action: Callable[[], None]) -> None:
        """Run ``action`` as the driver sends ``method`` (once)."""
        fired: list[str] = []

        def hook(caller: SimActor, callee: SimActor, m: str, args: tuple[Any, ...]) -> None:
            if caller is self.driver and m == method and not fired:
                fired.append(m)
                action()

        self.sim.on_send = hook

    def on_deliver(self, method: str, action: Callable[[SimActor], None],
                   kind: str | None = None) -> None:
        """Run ``action(callee)`` as ``method`` arrives somewhere (once), at an actor of
        ``kind`` if given (a step's call has one name at the coordinator and the holder)."""
        fired: list[str] = []

        def hook(target: SimActor, m: str, args: tuple[Any, ...]) -> None:
            if m == method and not fired and kind in (None, target.kind):
                fired.append(m)
                action(target)

        self.sim.on_deliver = hook


def snapshotted_by_a_first_job(tmp_path: Path, nodes: int = 3
                               ) -> tuple[Path, dict[str, list[Ep]]]:
    """A first job on ``nodes`` nodes populated (``World.populate``) and snapshotted
    into ``tmp_path / "ckpt"``, then gone, for a fresh ``World`` to restore. Returns the
    path and the first job's live rollouts by holder."""
    first = World(tmp_path, nodes=nodes)
    path = tmp_path / "ckpt"
    try:
        live = first.run(first.populate())
        first.run(first.snapshot(path, live))
    finally:
        first.close()
    return path, live


def cut_of(live: dict[str, list[Ep]], turns: int = 2) -> StaticCut:
    """The cut RL takes of ``live`` after ``populate(turns)``."""
    rows = {f"{ep.capture_key}/row{t}" for eps in live.values() for ep in eps
            for t in range(turns)}
    return StaticCut({i: set(eps) for i, eps in live.items()}, rows)


def files(path: Path) -> list[str]:
    """The snapshot files at ``path`` (its shards and manifest), by name."""
    return sorted(p.name for p in environment_dir(path).iterdir() if not p.name.startswith("."))
