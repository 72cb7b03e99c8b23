"""Calls across processes declared once (``nemo_ckpt.protocol.calls``): what a call
carries, what a proxy does with a call and a message, and the dispatch ``serves`` makes
and checks, on the real holder and coordinator."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, Protocol

import pytest

from actors.coordinator.actor import CheckpointCoordinator
from actors.holder.actor import SessionHolder
from nemo_ckpt.protocol.calls import Call, call, methods, one_way, serves
from nemo_ckpt.protocol.coordinator_api import CoordinatorApi, coordinator_calls
from nemo_ckpt.protocol.holder_api import HolderControl, HolderSessions, holder_calls
from nemo_ckpt.transport import HOLDER, Actor

ROOT = Path(__file__).resolve().parents[2]


def test_a_call_carries_only_what_differs_from_its_defaults() -> None:
    plain = call(HolderControl.begin_snapshot, "snap-1", 1.0, 10.0, "/ckpt")
    assert plain == Call("begin_snapshot", ("snap-1", 1.0, 10.0, "/ckpt"))
    stopping = call(HolderControl.begin_snapshot, "snap-1", 1.0, 10.0, "/ckpt", stop=True)
    assert stopping.args == ("snap-1", 1.0, 10.0, "/ckpt", "", True)
    assert call(HolderControl.release, "snap-1") == Call("release", ("snap-1",), True)
    assert stopping.within(5.0).timeout == 5.0


def test_a_wrong_argument_is_refused_at_the_caller_naming_it() -> None:
    wrong: Any = HolderControl.commit_restore
    with pytest.raises(TypeError, match="commit_restore\\(\\) is missing its argument "
                                        "'restore_id'"):
        call(wrong)
    with pytest.raises(TypeError, match="unexpected or repeated arguments \\['stopp'\\]"):
        call(wrong, "r-1", stopp=True)
    with pytest.raises(TypeError, match="commit_restore\\(\\) takes 1 arguments, 2 given"):
        call(wrong, "r-1", "extra")


class _Recorder:
    """A transport that records what it is asked to carry."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], float | None]] = []
        self.sent: list[tuple[str, tuple[Any, ...]]] = []

    async def _answer(self) -> str:
        return "answered"

    def call(self, actor: Actor, method: str, *args: Any, timeout: float | None = None
             ) -> Any:
        self.calls.append((method, args, timeout))
        return self._answer()

    def send(self, actor: Actor, method: str, *args: Any) -> None:
        self.sent.append((method, args))


async def test_a_proxy_sends_a_message_at_once_and_invokes_a_call_with_its_timeout(
        ) -> None:
    transport = _Recorder()
    holder = holder_calls(transport, Actor(HOLDER, "holder-0", None), 7.0)  # type: ignore[arg-type]
    await holder.release("snap-1")
    assert transport.sent == [("release", ("snap-1",))] and transport.calls == []
    assert await holder.finish_writes("snap-1") == "answered"
    assert transport.calls == [("finish_writes", ("snap-1",), 7.0)]
    with pytest.raises(AttributeError, match="'resume' is not a call of this interface"):
        _ = holder.resume  # type: ignore[attr-defined]


async def test_a_coordinator_proxy_without_a_way_to_send_refuses_a_message() -> None:
    async def invoke(method: str, *args: Any) -> Any:
        return (method, args)

    coordinator = coordinator_calls(invoke)
    assert await coordinator.renew("snap-1") == ("renew", ("snap-1",))
    with pytest.raises(TypeError, match="start_writes is a message, and this proxy was made "
                                        "without a way to send one"):
        await coordinator.start_writes("snap-1")


class _Steps(Protocol):
    async def step(self, op: str, lease_s: float = 1.0) -> int: ...


def test_serves_refuses_a_part_whose_method_differs_from_its_protocol() -> None:
    class Drifted:
        async def step(self, op: str) -> int:
            return 0

    with pytest.raises(TypeError, match="Drifted.step \\(_Steps\\) takes"):
        serves({_Steps: ("_part", Drifted)})(type("Router", (), {}))

    class Sync:
        def step(self, op: str, lease_s: float = 1.0) -> int:
            return 0

    with pytest.raises(TypeError, match="Sync.step \\(_Steps\\) is declared but not "
                                        "implemented as an async method"):
        serves({_Steps: ("_part", Sync)})(type("Router", (), {}))


async def test_serves_hands_each_call_to_the_part_that_serves_its_protocol() -> None:
    class Part:
        async def step(self, op: str, lease_s: float = 1.0) -> int:
            return len(op) + int(lease_s)

    @serves({_Steps: ("_part", Part)})
    class Router:
        def __init__(self) -> None:
            self._part = Part()

    assert await Router().step("abc", lease_s=2.0) == 5  # type: ignore[attr-defined]


@pytest.mark.parametrize("served, protocols", [
    (SessionHolder, (HolderControl, HolderSessions)),
    (CheckpointCoordinator, (CoordinatorApi,)),
])
def test_every_call_of_an_actors_interface_is_one_async_method_of_the_actor(
        served: type, protocols: tuple[type, ...]) -> None:
    declared = methods(*protocols)
    assert len(declared) > 10
    missing = [n for n in declared if not inspect.iscoroutinefunction(getattr(served, n, None))]
    assert missing == []


def test_no_call_across_processes_names_its_method_in_a_string() -> None:
    """Every call goes through a Protocol's method (``call``, a proxy); only the
    transports themselves and the relay's own wire carry a method's name."""
    carriers = {"actors/ray_transport.py", "actors/coordinator/holders.py",
                "nemo_ckpt/protocol/calls.py", "nemo_ckpt/protocol/holder_api.py",
                "nemo_ckpt/protocol/coordinator_api.py"}
    found = []
    for path in sorted([*(ROOT / "actors").rglob("*.py"), *(ROOT / "nemo_ckpt").rglob("*.py")]):
        name = path.relative_to(ROOT).as_posix()
        if name in carriers or name.startswith("actors/sim/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("call", "send") and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)):
                found.append(f"{name}:{node.lineno} {node.func.attr}(..., "
                             f"{node.args[1].value!r})")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "HolderCall"):  # the call-as-data of before
                found.append(f"{name}:{node.lineno} HolderCall(...)")
            # A proxy's own carrier (SessionClient._call) given a method's name by a
            # caller: SessionClient.holder_info did, beside its typed session calls.
            # The data plane's double calls RL's interface, not ours, by name.
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "_call" and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                    and name != "nemo_ckpt/testing/data_plane.py"):
                found.append(f"{name}:{node.lineno} _call({node.args[0].value!r}, ...)")
    assert found == []


def test_a_message_is_marked_on_its_protocol() -> None:
    assert {n for n, m in methods(HolderControl).items()
            if getattr(m, "__nemo_ckpt_one_way__", False)} == {"start_writes", "release"}

    class WithMessage(Protocol):
        @one_way
        async def note(self, text: str) -> None: ...

    assert call(WithMessage.note, "x").one_way
