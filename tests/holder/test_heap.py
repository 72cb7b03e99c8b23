"""A holder's memory beyond its sessions: the heap trimmer, and compact session records."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
from typing import Any

import pytest

from actors.holder import heap
from actors.holder.actor import SessionHolder
from actors.holder.heap import CALL_OVERHEAD_BYTES, HeapTrimmer
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.sessions import SessionClient
from tests.virtual_time import on_virtual_time, virtual_runtime

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingTrim:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return True


def trimmer(**kw: Any) -> tuple[HeapTrimmer, CountingTrim, FakeClock]:
    trim, clock = CountingTrim(), FakeClock()
    kw.setdefault("trim_after_bytes", 1 * MiB)
    return HeapTrimmer(trim=trim, clock=clock, **kw), trim, clock


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# --- HeapTrimmer --------------------------------------------------------------------------


async def test_it_trims_only_once_enough_bytes_arrived() -> None:
    t, trim, clock = trimmer()
    t.note(MiB // 2)
    clock.now += 5
    assert not await t.maybe_trim()
    t.note(MiB // 2)  # with the per-call overhead, now over 1 MiB
    clock.now += 0.2
    assert await t.maybe_trim()
    assert trim.calls == 1 and t.trims == 1 and t.pending_bytes == 0
    clock.now += 5
    assert not await t.maybe_trim()  # nothing new arrived
    assert trim.calls == 1


async def test_small_calls_count_their_per_call_overhead() -> None:
    t, trim, clock = trimmer()
    for _ in range(MiB // CALL_OVERHEAD_BYTES):
        t.note(0)
    clock.now += 0.2
    assert await t.maybe_trim()
    assert trim.calls == 1


async def test_it_waits_until_the_calls_pause() -> None:
    t, trim, clock = trimmer(quiet_s=0.25)
    t.note(2 * MiB)
    clock.now += 0.125
    assert not await t.maybe_trim()
    t.note(0)
    clock.now += 0.125
    assert not await t.maybe_trim()  # the last call was only 0.125 s ago
    clock.now += 0.125
    assert await t.maybe_trim()
    assert trim.calls == 1


async def test_calls_that_never_pause_still_get_a_trim_after_the_max_delay() -> None:
    t, trim, clock = trimmer(quiet_s=0.1, max_delay_s=10.0, min_interval_s=1.0)
    trims_at = []
    for step in range(500):  # 25 s of a call every 50 ms
        clock.now += 0.05
        t.note(MiB)
        if await t.maybe_trim():
            trims_at.append(step)
    # The first call made a trim due; it runs 10 s (200 calls) later, and so on.
    assert len(trims_at) == 2
    assert 199 <= trims_at[0] <= 201 and 199 <= trims_at[1] - trims_at[0] <= 202


async def test_it_trims_at_most_once_per_interval() -> None:
    t, trim, clock = trimmer(quiet_s=0.0, min_interval_s=1.0)
    for _ in range(50):  # 5 s of bursts, checked every 0.1 s
        t.note(2 * MiB)
        clock.now += 0.1
        await t.maybe_trim()
    assert trim.calls == 5


async def test_a_request_makes_a_trim_due_without_bytes_but_still_rate_limited() -> None:
    t, trim, clock = trimmer(min_interval_s=1.0)
    t.request()
    assert await t.maybe_trim()
    t.request()
    clock.now += 0.5
    assert not await t.maybe_trim()
    clock.now += 0.5
    assert await t.maybe_trim()
    assert trim.calls == 2


async def test_without_glibc_it_never_trims(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "trim_supported", lambda: False)
    t = HeapTrimmer(trim_after_bytes=1)
    t.note(10 * MiB)
    t.request()
    assert not t.enabled and not t.due()
    assert not await t.maybe_trim()


@pytest.mark.skipif(not heap.trim_supported(), reason="malloc_trim needs glibc")
@pytest.mark.skipif(not heap.trim_supported(), reason="malloc_trim needs glibc")
def test_malloc_trim_returns_memory_freed_between_live_chunks() -> None:
    # 64 KiB chunks come from the heap (below the mmap threshold); freeing every other
    # one leaves free pages between live chunks, which only malloc_trim hands back.
    chunks = [bytes([i % 251]) * (64 << 10) for i in range(1024)]  # 64 MiB, all touched
    del chunks[::2]
    before = rss_bytes()
    assert heap.malloc_trim()
    assert before - rss_bytes() > 16 * MiB
    assert len(chunks) == 512


# --- the holder's watchdog drives it ---------------------------------------------------------


@on_virtual_time
async def test_the_holder_trims_after_a_burst_of_opens_and_after_a_snapshot() -> None:
    runtime = virtual_runtime()
    trim = CountingTrim()
    heap_trimmer = HeapTrimmer(trim_after_bytes=1 * MiB, quiet_s=0.1, min_interval_s=0.3,
                               trim=trim, clock=runtime.clock.monotonic,
                               run_blocking=runtime.run_blocking)
    h = SessionHolder("holder-0", node_id="node-a", runtime=runtime, trimmer=heap_trimmer)
    for k in range(8):
        await h.open_session(Ep(f"r{k}", 0), bytes(256 << 10))  # 2 MiB in all
    await asyncio.sleep(0.5)
    assert trim.calls == 1
    await asyncio.sleep(0.5)
    assert trim.calls == 1  # idle: nothing new arrived

    await h.pause("snap-1", drain_timeout_s=1, lease_s=10)
    heap_trimmer.note(4 * MiB)  # bytes that arrive while paused wait for the resume
    await asyncio.sleep(0.5)
    assert trim.calls == 1
    await h.commit_snapshot("snap-1")
    await asyncio.sleep(0.5)
    assert trim.calls == 2


# --- session records: one slotted object per session ------------------------------------------


def a_record() -> SessionRecord:
    return SessionRecord("holder-0", Ep("r", 2), (b"t0", b"t1"), b"state",
                         frozenset({"r/0", "r-a1/0"}), ("r", "r-a1"))


def test_a_session_record_has_no_instance_dict_and_stays_frozen() -> None:
    r = a_record()
    assert not hasattr(r, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.state = b"other"  # type: ignore[misc]


def test_a_session_record_round_trips_through_pickle_and_the_wire_format() -> None:
    import ray.cloudpickle

    r = a_record()
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(r, protocol=protocol)) == r
    assert ray.cloudpickle.loads(ray.cloudpickle.dumps(r)) == r
    assert SessionRecord.from_wire(r.to_wire()) == r
    assert r.continued().earlier_capture_keys == ("r", "r-a1", "r-a2")


async def test_session_records_travel_through_ray_calls(ckpt: Any, namespace: str) -> None:
    infos = await asyncio.wait_for(ckpt.ensure_holders(), 60)
    client = await SessionClient.connect(instance_id=infos[0].instance_id,
                                         namespace=namespace)
    ep = Ep("slotted", 0)
    opened = await asyncio.wait_for(client.open(ep, b"s0"), 30)
    async with client.turn(ep) as turn:
        turn.complete(b"t0", b"s1", ["slotted/0"])
    got = await asyncio.wait_for(client.get(ep), 30)
    assert (opened.state, got.turns, got.state, got.staging_keys) == (
        b"s0", (b"t0",), b"s1", frozenset({"slotted/0"}))
    assert turn.session == got.head()
    assert await asyncio.wait_for(client.read_turns(ep), 30) == (b"t0",)


# --- the coordinator's process: startup objects out of the collector's scans ---------------


def test_freezing_startup_objects_takes_them_out_of_every_collection() -> None:
    import subprocess
    import sys

    code = ("import gc, json; from actors.holder.heap import freeze_startup_objects; "
            "before = gc.get_freeze_count(); freeze_startup_objects(); "
            "print(json.dumps([before, gc.get_freeze_count(), gc.get_count()[2]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    before, after, gen2 = json.loads(out)
    assert before == 0 and after > 1000 and gen2 == 0


async def test_a_coordinator_in_a_driver_process_leaves_the_drivers_objects_alone(
    ckpt: Any,
) -> None:
    import gc

    from actors.coordinator.actor import CheckpointCoordinator
    from actors.ray_transport import RayTransport

    before = gc.get_freeze_count()
    CheckpointCoordinator(ckpt.config, RayTransport(ckpt.config))
    assert gc.get_freeze_count() == before
