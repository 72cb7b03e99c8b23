"""``nemo-ckpt status``: the holders of a running job, asked through the transport.

Read-only: holders are found by name and asked for their ``info()`` through
``actors.ray_transport.RayTransport``; nothing is created (unlike
``RayEnvironmentCheckpoint.holders()``, which creates the coordinator).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

from nemo_ckpt.cli.render import PROG, table
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.connect import ray_address
from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.options import non_empty, positive_float
from nemo_ckpt.phases import HolderInfo, instance_sort_key
from nemo_ckpt.protocol.holder_api import holder_calls
from nemo_ckpt.transport import Actor, Transport, runtime_transport

__all__ = ["HolderStatus", "add_parser", "holder_status", "run", "run_status"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``status`` to the parser's subcommands."""
    p = sub.add_parser("status", help="show the holders of a running job",
                       description="Show each session holder's node, state, sessions, last "
                                   "snapshot id and lease expiry. Read-only: creates no "
                                   "actor. Exits 1 when no holder is found or one does not "
                                   "answer.")
    p.add_argument("--address", default="auto", type=ray_address,
                   help="Ray cluster address: HOST:PORT of the head, ray://HOST:PORT, or "
                        "'auto' (default), the cluster `ray start` started on this node "
                        "or $RAY_ADDRESS. A cluster with token authentication needs "
                        "RAY_AUTH_MODE=token and its token (README, 'Ray token "
                        "authentication')")
    p.add_argument("--namespace", default="nemo_ckpt", type=non_empty,
                   help="the job's CheckpointConfig.namespace (default: nemo_ckpt); the "
                        "demo and the examples print theirs")
    p.add_argument("--timeout", type=positive_float, default=10.0,
                   help="seconds to wait for the holders to answer (default: 10)")
    p.set_defaults(run=run)


@dataclass(frozen=True)
class HolderStatus:
    """One holder as ``status`` found it: its ``info()``, or why it did not answer."""

    instance_id: str
    info: HolderInfo | None = None
    error: str | None = None


async def holder_status(transport: Transport, timeout_s: float = 10.0) -> list[HolderStatus]:
    """Ask every holder of ``transport``'s namespace for its ``info()``, all at once.

    A holder that does not answer within ``timeout_s``, or that the transport finds dead,
    is reported with the reason.
    """

    async def ask(instance_id: str, holder: Actor) -> HolderStatus:
        try:
            info = await holder_calls(transport, holder, timeout_s).info()
        except BackendUnavailableError as exc:
            if exc.unreachable is None:
                raise  # the holder itself raised it: a bug, not an outage
            if exc.timed_out:
                return HolderStatus(instance_id, error=f"no answer within {timeout_s:g}s")
            cause = "" if exc.__cause__ is None else f" ({type(exc.__cause__).__name__})"
            return HolderStatus(instance_id, error=f"unreachable{cause}")
        return HolderStatus(instance_id, info=info)

    found = await asyncio.gather(*(ask(i, h) for i, h in transport.holders().items()))
    return sorted(found, key=lambda h: instance_sort_key(h.instance_id))


def _ray_transport(namespace: str) -> Transport:
    return runtime_transport(CheckpointConfig(namespace=namespace), "ray")


def _cluster_view(namespace: str) -> tuple[dict[str, dict[str, Any]], bool]:
    """The cluster's nodes by id, and whether the namespace's coordinator is registered.

    Read from Ray directly: the transport's ``coordinator()`` creates the coordinator it
    does not find, and the transport knows nodes by id only, not by address.
    """
    import ray

    nodes = {n["NodeID"]: n for n in ray.nodes()}
    coordinator = CheckpointConfig().coordinator_name
    has_coordinator = any(a["name"] == coordinator and a.get("namespace") == namespace
                          for a in ray.util.list_named_actors(all_namespaces=True))
    return nodes, has_coordinator


def run_status(namespace: str, timeout_s: float = 10.0, out: TextIO | None = None,
               err: TextIO | None = None, address: str | None = None) -> int:
    """Print the holders of ``namespace``; needs Ray initialized (it neither inits nor
    shuts down). Exit code 0 when every holder answered, 1 when none exists or any did
    not answer. ``address`` is the cluster as the user named it, for messages (default:
    the GCS address Ray connected to)."""
    out = out or sys.stdout
    err = err or sys.stderr
    transport = _ray_transport(namespace)
    # On a thread of its own: the caller may be running an event loop (a notebook).
    with ThreadPoolExecutor(max_workers=1) as thread:
        holders = thread.submit(asyncio.run, holder_status(transport, timeout_s)).result()
    if not holders:
        gcs = transport.cluster_id
        where = gcs if address is None else repr(address) if address == gcs \
            else f"{address!r} ({gcs})"
        print(f"{PROG} status: no nemo-ckpt holders in namespace {namespace!r} on the "
              f"cluster at {where}; the job is not running there, or it uses another "
              f"namespace (pass --namespace, as in CheckpointConfig.namespace)", file=err)
        return 1
    nodes, has_coordinator = _cluster_view(namespace)
    answered = [h.info for h in holders if h.info is not None]
    # Snapshot ids start with their UTC time, so the greatest is the latest.
    last = max((i.last_snapshot_id for i in answered if i.last_snapshot_id), default=None)
    print(f"namespace {namespace}: {len(holders)} holders, coordinator "
          f"{'running' if has_coordinator else 'not running'}, last snapshot "
          f"{last or 'none'}", file=out)
    rows: list[tuple[object, ...]] = []
    for h in holders:
        i = h.info
        if i is None:
            rows.append((h.instance_id, f"UNREACHABLE: {h.error}", "-", "-", "-", "-", "-"))
            continue
        node = nodes.get(i.node_id, {})
        where = f"{i.node_id} {node.get('NodeManagerAddress', '?')}"
        if not node.get("Alive", False):
            where += " (node dead)"
        state = i.state.value + (f" for {i.operation_id}" if i.operation_id else "")
        lease = "-" if i.lease_expires_in_s is None else f"in {i.lease_expires_in_s:.1f}s"
        rows.append((i.instance_id, state, i.sessions, i.turns_in_flight,
                     i.last_snapshot_id or "-", lease, where))
    for line in table(("INSTANCE", "STATE", "SESSIONS", "TURNS IN FLIGHT",
                       "LAST SNAPSHOT", "LEASE EXPIRES", "NODE"), rows):
        print(line, file=out)
    unreachable = [h.instance_id for h in holders if h.info is None]
    if unreachable:
        out.flush()
        print(f"{PROG} status: {len(unreachable)} holder(s) did not answer: "
              f"{', '.join(unreachable)}; their sessions are lost if their node died",
              file=err)
        return 1
    return 0


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import ray

    if ray.is_initialized():
        # In-process use (tests, a notebook): reuse the caller's connection, leave it open.
        return run_status(args.namespace, args.timeout, out, err)
    from nemo_ckpt.connect import ClusterConnectionError, connect

    try:
        connect(args.address, namespace=args.namespace, log_to_driver=False,
                logging_level=logging.WARNING)
    except ClusterConnectionError as exc:
        print(f"{PROG} status: error: {exc}", file=err)
        return 1
    try:
        return run_status(args.namespace, args.timeout, out, err, address=args.address)
    finally:
        ray.shutdown()
