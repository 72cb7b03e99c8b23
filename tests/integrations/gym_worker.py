"""A NeMo Gym-side environment worker for tests/integrations/test_nemo_gym_local.py, run
in a process of its own (``python -m tests.integrations.gym_worker PHASE JSON``):
importing NeMo Gym changes ``sys.path``, ``print`` and ``HF_HOME``, which must not reach
the test suite's process. It joins the test's Ray cluster, uses the real NeMo Gym 0.7.0
package (its registry, ``AsyncSandbox``, its ``local`` provider under ours), and prints
one line ``RESULT <json>`` of what it saw.

- ``start``: selects the provider by name through Gym's registry, makes a sandbox for
  rollout attempt 0, runs two turns whose commands write files, then a command after the
  last commit, and exits without closing anything (the worker dies with its job);
- ``resume``: after the restore, connects Gym's ``AsyncSandbox`` to the continued
  attempt's sandbox, reads it back, pauses and resumes it, runs a turn, closes it twice;
- ``lost``: creates whose open's answer is lost, never arrives, or cannot be learned,
  each retried; ``kill-start`` and ``kill-resume``: a job killed mid-rollout with
  sandboxes on every holder, and its continued rollouts after the restore
  (tests/integrations/test_nemo_gym_release.py); ``stage``: Gym's token capture stages
  rows (tests/integrations/test_nemo_gym_staging.py; no cluster).
"""

from __future__ import annotations

# nemo-ckpt first: Gym's import moves the working directory behind site-packages on
# sys.path, and the package found first stays the one every later import uses.
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import nemo_ckpt
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt import SessionClient
from nemo_ckpt.connect import connect
from nemo_ckpt.integrations import nemo_gym as ours
from nemo_ckpt.integrations.nemo_gym_docker import DOCKER_PROVIDER_NAME as DOCKER

# A counter kept in a shell's memory only: each request on the FIFO /tmp/req is answered
# with the next count on /tmp/rep.
SERVER = ("mkfifo /tmp/req /tmp/rep; n=0; "
          "while true; do read cmd < /tmp/req; n=$((n+1)); echo $n > /tmp/rep; done")
ASK = "echo go > /tmp/req; cat /tmp/rep"
PID1 = "tr '\\0' ' ' < /proc/1/cmdline"  # what runs as the container's first process


def _error(exc: BaseException) -> list[str]:
    return [type(exc).__name__, str(exc)]


async def _files(box: Any) -> dict[str, str]:
    """Every file of the sandbox and its content, read through Gym's handle."""
    found = await box.exec("find . -type f | sort")
    out: dict[str, str] = {}
    for name in found.stdout.split():
        out[name] = (await box.exec(f"cat {name}")).stdout
    return out


async def start(args: dict[str, Any]) -> dict[str, Any]:
    from nemo_gym.sandbox import (
        AsyncSandbox,
        ConnectableProvider,
        SandboxSpec,
        SupportsSandboxPauseResume,
        create_provider,
        get_provider_class,
        list_providers,
    )

    config = {ours.PROVIDER_NAME: {"sandbox_root": args["sandbox_root"],
                                   "namespace": args["namespace"]}}
    provider = create_provider(config)
    seen: dict[str, Any] = {
        "listed": ours.PROVIDER_NAME in list_providers(),
        "class_by_name": get_provider_class(ours.PROVIDER_NAME) is ours.NemoCkptLocalProvider,
        "connectable": isinstance(provider, ConnectableProvider),
        "pause_resume": isinstance(provider, SupportsSandboxPauseResume),
        "recovery": getattr(provider, "recovery", None),
        "nemo_ckpt_from": str(Path(nemo_ckpt.__file__).parent.parent),
    }
    try:
        create_provider({ours.PROVIDER_NAME: {"sandbox_root": ""}})
    except Exception as exc:
        seen["without_root"] = _error(exc)
    try:
        await AsyncSandbox(provider, SandboxSpec(), owns_provider=False).start()
    except Exception as exc:
        seen["without_rollout"] = _error(exc)
    episode, instance = Ep(args["rollout_id"], 0), args["instance_id"]
    try:
        await AsyncSandbox(provider, SandboxSpec(
            workdir="/tmp", metadata=ours.sandbox_metadata(episode, instance)),
            owns_provider=False).start()
    except Exception as exc:
        seen["with_workdir"] = _error(exc)
    spec = SandboxSpec(metadata=ours.sandbox_metadata(episode, instance),
                       files={"README.md": "the task\n"})
    box = await AsyncSandbox(provider, spec, owns_provider=False).start()
    client = await SessionClient.connect(instance, namespace=args["namespace"])
    for t in range(2):
        async with client.turn(episode) as turn:
            done = await box.exec(f"echo turn-{t} >> log.txt && mkdir -p src "
                                  f"&& echo v{t + 1} > src/main.py")
            assert done.return_code == 0, done.stderr
            turn.complete(f"t{t}".encode(), f"s{t + 1}".encode())
    await box.exec("echo not-committed > after.txt")  # after the last commit
    record = await client.get(episode)
    seen.update(descriptor=await box.serialize(), directory=record.directory,
                status=(await box.status()).value, files=await _files(box))
    return seen


async def resume(args: dict[str, Any]) -> dict[str, Any]:
    from nemo_gym.sandbox import AsyncSandbox, create_provider

    provider = create_provider({ours.PROVIDER_NAME: {"sandbox_root": args["sandbox_root"],
                                                     "namespace": args["namespace"]}})
    seen: dict[str, Any] = {}
    try:
        await AsyncSandbox.connect(args["old_descriptor"], provider=provider)
    except Exception as exc:
        seen["old_descriptor"] = _error(exc)
    continued, instance = Ep(args["rollout_id"], 1), args["instance_id"]
    descriptor = ours.sandbox_descriptor(continued, instance)
    box = await AsyncSandbox.connect(descriptor, provider=provider, owns_provider=False)
    client = await SessionClient.connect(instance, namespace=args["namespace"])
    record = await client.get(continued)
    with tempfile.TemporaryDirectory() as tmp:
        await box.download("src/main.py", Path(tmp) / "main.py")
        downloaded = (Path(tmp) / "main.py").read_text()
    seen.update(descriptor=await box.serialize(), directory=record.directory,
                turns=len(record.turns), state=record.state.decode(),
                files=await _files(box), downloaded=downloaded,
                running=(await box.status()).value)
    refused = {}
    for what, call in (("cwd", lambda: box.exec("pwd", cwd="/tmp")),
                       ("upload", lambda: box.upload(Path(__file__), "../escaped.py")),
                       ("foreign", lambda: AsyncSandbox.connect({"sandbox_id": "nemo-gym-x"},
                                                                provider=provider)),
                       ("attempt", lambda: provider.connect({**descriptor, "attempt": True})),
                       ("instance", lambda: provider.connect({**descriptor, "instance_id": 7}))):
        try:
            await call()
        except Exception as exc:
            refused[what] = _error(exc)
    seen["refused"] = refused
    await box.pause()
    seen["paused"] = (await box.status()).value
    try:
        await box.exec("echo while-paused >> log.txt")
    except Exception as exc:
        seen["exec_while_paused"] = _error(exc)
    await box.resume()
    seen["resumed"] = (await box.status()).value
    async with client.turn(continued) as turn:
        await box.exec("echo turn-2 >> log.txt")
        turn.complete(b"t2", b"s3")
    seen["log_after_turn"] = (await box.exec("cat log.txt")).stdout
    other = await provider.connect(descriptor)  # a second handle on the same sandbox
    await client.finish(continued, b"done")  # the worker owns its directory from now on
    handle = box._handle  # Gym's handle of ``box``, to close it again below
    await box.stop()
    seen["directory_after_stop"] = Path(record.directory or "").exists()
    await box.stop()  # Gym's facade: a no-op
    closes = []
    for each in (handle, other, other):  # closed, then closed through another handle
        try:
            await provider.close(each)
            closes.append("ok")
        except Exception as exc:
            closes.append(repr(exc))
    seen["provider_closes"] = closes
    seen["status_after_close"] = [(await provider.status(h)).value for h in (handle, other)]
    return seen


async def docker_start(args: dict[str, Any]) -> dict[str, Any]:
    from nemo_gym.sandbox import AsyncSandbox, SandboxSpec, create_provider

    seen: dict[str, Any] = {}
    # Gym's defaults (its --init among them)
    provider = create_provider({DOCKER: {"namespace": args["namespace"], "memory": "required"}})
    episode, instance = Ep(args["rollout_id"], 0), args["instance_id"]
    meta = ours.sandbox_metadata(episode, instance)
    try:
        await AsyncSandbox(provider, SandboxSpec(
            image=args["image"], metadata=meta, provider_options={"volumes": ["/tmp:/host"]}),
            owns_provider=False).start()
    except Exception as exc:
        seen["with_volume"] = _error(exc)
    # The counter is the container's own process (CRIU restores a process tree, not a
    # process a `docker exec` left behind in a session of its own).
    box = await AsyncSandbox(provider, SandboxSpec(
        image=args["image"], metadata=meta, entrypoint=["sh", "-c", SERVER]),
        owns_provider=False).start()
    client = await SessionClient.connect(instance, namespace=args["namespace"])
    counts = []
    for t in range(2):
        async with client.turn(episode) as turn:
            counts.append((await box.exec(ASK)).stdout.strip())
            await box.exec(f"echo turn-{t} >> /work/log.txt")
            turn.complete(f"t{t}".encode(), f"s{t + 1}".encode())
    record = await client.get(episode)
    # The same create again, as after a lost answer: the live session's container.
    again = await provider.create(SandboxSpec(image=args["image"], metadata=meta))
    seen["retried"] = [again.raw.inner.sandbox_id, (await provider.exec(again, ASK)).stdout]
    seen.update(counts=counts, container=record.container, descriptor=await box.serialize(),
                pid1=(await box.exec(PID1)).stdout.strip(),
                recovery=provider.recovery_of(box._handle).value,
                declared=provider.recovery.value)
    return seen


async def docker_resume(args: dict[str, Any]) -> dict[str, Any]:
    from nemo_gym.sandbox import AsyncSandbox, create_provider

    provider = create_provider({DOCKER: {"namespace": args["namespace"]}})
    continued, instance = Ep(args["rollout_id"], 1), args["instance_id"]
    descriptor = ours.sandbox_descriptor(continued, instance, DOCKER)
    box = await AsyncSandbox.connect(descriptor, provider=provider, owns_provider=False)
    client = await SessionClient.connect(instance, namespace=args["namespace"])
    record = await client.get(continued)
    seen: dict[str, Any] = {"container": record.container, "descriptor": await box.serialize(),
                            "log": (await box.exec("cat /work/log.txt")).stdout,
                            "running": (await box.status()).value,
                            "pid1": (await box.exec(PID1)).stdout.strip()}
    async with client.turn(continued) as turn:
        seen["count"] = (await box.exec(ASK)).stdout.strip()
        turn.complete(b"t2", b"s3")
    await box.pause()
    seen["paused"] = (await box.status()).value
    try:
        await box.exec(ASK)
    except Exception as exc:
        seen["exec_while_paused"] = _error(exc)
    await box.resume()
    seen["resumed"] = (await box.status()).value
    seen["count_after_resume"] = (await box.exec(ASK)).stdout.strip()
    other = await provider.connect(descriptor)
    await client.finish(continued, b"done")
    handle = box._handle
    await box.stop()
    await box.stop()
    closes = []
    for each in (handle, other, other):
        try:
            await provider.close(each)
            closes.append("ok")
        except Exception as exc:
            closes.append(repr(exc))
    seen["provider_closes"] = closes
    return seen


def _local(args: dict[str, Any]) -> Any:
    from nemo_gym.sandbox import create_provider

    return create_provider({ours.PROVIDER_NAME: {"sandbox_root": args["sandbox_root"],
                                                 "namespace": args["namespace"]}})


def _spec(rollout: str, instance: str, attempt: int = 0) -> Any:
    from nemo_gym.sandbox import SandboxSpec

    return SandboxSpec(metadata=ours.sandbox_metadata(Ep(rollout, attempt), instance),
                       files={"task.txt": rollout})


async def lost(args: dict[str, Any]) -> dict[str, Any]:
    """Creates whose open's answer is lost, or that never reach the holder, or whose
    holder cannot be asked; each retried."""
    from nemo_ckpt.errors import BackendUnavailableError

    provider, instance = _local(args), args["instance_id"]
    root = Path(args["sandbox_root"])
    client = await provider._client(instance)  # the provider's own client, to fail it
    real_open, real_get = client.open, client.get

    async def answer_lost(*a: Any, **k: Any) -> Any:
        await real_open(*a, **k)
        raise BackendUnavailableError("the holder's answer was lost")

    async def never_arrived(*a: Any, **k: Any) -> Any:
        raise BackendUnavailableError("the call never reached the holder")

    async def unreachable(*a: Any, **k: Any) -> Any:
        raise BackendUnavailableError("the holder cannot be reached")

    async def attempt(rollout: str) -> Any:
        try:
            return await provider.create(_spec(rollout, instance))
        except Exception as exc:
            return _error(exc)

    seen: dict[str, Any] = {}
    client.open = answer_lost
    first = await attempt("lost-answer")
    client.open = real_open
    await provider.exec(first, "echo kept > kept.txt")
    again = await attempt("lost-answer")  # the same create, retried
    seen["answer_lost"] = {
        "same": first.sandbox_id == again.sandbox_id,
        "kept": (await provider.exec(again, "cat kept.txt")).stdout,
        "session_directory": (await client.get(Ep("lost-answer", 0))).directory}
    client.open = never_arrived
    seen["never_arrived"] = await attempt("never-arrived")
    seen["never_arrived_left"] = (root / "never-arrived").exists()
    client.get = unreachable
    seen["unknown"] = await attempt("unknown")
    seen["unknown_left"] = (root / "unknown").exists()
    (root / "unknown" / "stale.txt").write_text("left by the create that failed")
    client.open, client.get = real_open, real_get
    retried = await attempt("unknown")  # it had not opened: made anew
    seen["unknown_retried"] = (await provider.exec(retried, "ls -A")).stdout
    for rollout, handle in (("lost-answer", again), ("unknown", retried)):
        await client.finish(Ep(rollout, 0), b"done")
        await provider.close(handle)
        await provider.close(first if rollout == "lost-answer" else handle)  # no-op
        await client.close(Ep(rollout, 0))
    ledger = await provider._ledger(client)
    seen["left"] = sorted(p.name for p in root.iterdir() if p.name.startswith(
        ("lost-", "never-", "unknown")))
    seen["marked"] = ledger.marked()
    return seen


async def kill_start(args: dict[str, Any]) -> dict[str, Any]:
    """On every holder, sandboxes of rollouts RL will retire (finished), drop, leave idle
    after a committed turn, and one mid-turn; prints ``READY`` with them and waits
    there, mid-rollout, for the test to kill it."""
    from nemo_gym.sandbox import AsyncSandbox

    provider = _local(args)
    seen: dict[str, Any] = {}
    mid = []
    for instance in args["instances"]:
        client = await SessionClient.connect(instance, namespace=args["namespace"])
        for kind in ("idle", "done", "dropped", "mid"):
            rollout = f"k-{instance}-{kind}"
            ep = Ep(rollout, 0)
            box = await AsyncSandbox(provider, _spec(rollout, instance),
                                     owns_provider=False).start()
            async with client.turn(ep) as turn:
                await box.exec("echo turn-0 > log.txt")
                turn.complete(b"t0", b"s1")
            if kind == "done":
                await client.finish(ep, b"result")
            if kind == "mid":
                turns = client.turn(ep)
                await turns.__aenter__()  # never ends: the job dies in it
                await box.exec("echo mid-turn >> log.txt")
                mid.append(turns)
            seen[rollout] = (await client.get(ep)).directory
    sys.stdout.write("READY " + json.dumps(seen) + "\n")
    sys.stdout.flush()
    await asyncio.sleep(3600)
    return seen


async def kill_resume(args: dict[str, Any]) -> dict[str, Any]:
    """After the restore: Gym's handle on each continued sandbox, a turn in it."""
    from nemo_gym.sandbox import AsyncSandbox

    provider = _local(args)
    seen: dict[str, Any] = {}
    for rollout, instance in args["continued"]:
        client = await SessionClient.connect(instance, namespace=args["namespace"])
        ep = Ep(rollout, 1)
        box = await AsyncSandbox.connect(ours.sandbox_descriptor(ep, instance),
                                         provider=provider, owns_provider=False)
        async with client.turn(ep) as turn:
            await box.exec("echo turn-1 >> log.txt")
            turn.complete(b"t1", b"s2")
        seen[rollout] = (await box.exec("cat log.txt")).stdout
    return seen


async def stage(args: dict[str, Any]) -> dict[str, Any]:
    """Gym's own ``RolloutTokenCapture`` stages one model call per ``(rollout id, call
    id)`` of ``args["calls"]`` through a ``StagingSink`` (the data plane's side, here a
    dict), and a ``StagingSource`` fetches them back by the keys it returned."""
    from nemo_gym.token_id_capture.staging import capture as gym_capture
    from nemo_gym.token_id_capture.staging import protocols, records

    stored: dict[str, Any] = {}

    class Sink:
        def stage(self, record: Any, *, attachments: Any = None) -> Any:
            key = records.staging_key(record.rollout_id, record.model_call_id)
            stored[key] = record
            return records.StageResult(ok=True, staging_key=key)

    class Source:
        def fetch(self, staging_keys: list[str]) -> list[Any]:
            return [stored[k] for k in staging_keys]

    sink, source = Sink(), Source()
    capture = gym_capture.RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 3)
    keys = []
    for rollout_id, call_id in args["calls"]:
        call = capture.begin_call(records.CaptureAdmission(
            rollout_id=rollout_id, model_call_id=call_id, mode="text"))
        coords = capture.complete_call(call, prompt_token_ids=[1, 2, 3],
                                       generated_token_ids=[4, 5],
                                       generated_logprobs=[-0.5, -0.25])
        keys.append(coords.staging_key)
    fetched = source.fetch(keys)
    return {"keys": keys,
            "protocols": [isinstance(sink, protocols.StagingSink),
                          isinstance(source, protocols.StagingSource)],
            "rows": {k: stored[k].model_dump_json() for k in keys},
            "fetched": [[f.rollout_id, f.model_call_id, f.weight_version] for f in fetched]}


def main() -> int:
    phase, args = sys.argv[1], json.loads(sys.argv[2])
    if phase != "stage":  # the only phase that needs no cluster
        connect(args["address"], log_to_driver=False, logging_level="ERROR")
    seen = asyncio.run({"start": start, "resume": resume, "docker-start": docker_start,
                        "docker-resume": docker_resume, "lost": lost,
                        "kill-start": kill_start, "kill-resume": kill_resume,
                        "stage": stage}[phase](args))
    sys.stdout.write("RESULT " + json.dumps(seen) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
