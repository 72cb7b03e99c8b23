"""Handing a holder's freed heap memory back to the OS.

A holder's resident memory should be the sessions it holds. Every Ray call that brings
a state in also allocates buffers for the request and its reply (in Ray's and gRPC's
threads as well as the actor's), and frees them when the call returns. glibc's
allocator keeps freed memory mapped for reuse: it gives pages back to the OS only from
the top of a heap (and only after a large free), while the freed buffers sit between
the chunks of states that stay alive. So after a burst of opens or turns the holder
keeps that garbage resident: measured here, 2,500 opens of 1 KiB states into one holder
left ~10 MB free but resident (about 4 KiB per call, 4x the state), 2,500 opens of
64 KiB states ~35 MB (0.2x the state).

``malloc_trim(0)`` walks every arena and returns every whole free page to the OS
(``madvise(MADV_DONTNEED)``), including pages in the middle of a heap. It costs a few
milliseconds after such a burst (~4 ms with 160 MB or 650 MB of sessions held, ~0.2 ms
when there is nothing to free), up to ~40-65 ms when hundreds of MB of sessions were
just freed in scattered chunks. It holds each arena's lock while it trims that arena,
so threads that allocate from that arena wait; running it off the event loop thread
therefore does not spare the loop entirely, but it does while other arenas are trimmed.

``HeapTrimmer`` decides when: once enough bytes have arrived through session calls since
the last trim (an idle holder never trims), and only when the calls have paused (the
end of a burst): during a burst the allocator reuses the freed buffers anyway, and
trimming them would only make the next calls fault their pages back in. Under calls
that never pause it trims anyway once a trim has been due for a while, and never more
than once per period. A restore or snapshot that finished asks for one too. Only on
glibc Linux; elsewhere it never trims, detected once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

__all__ = ["HeapTrimmer", "malloc_trim", "trim_supported", "CALL_OVERHEAD_BYTES",
           "freeze_startup_objects"]

log = logging.getLogger("nemo_ckpt.heap")

# What one session call leaves freed on the heap besides its payload (request and reply
# buffers, protobuf and gRPC bookkeeping): ~4 KiB per open measured (see the module
# docstring). Counting it makes many small calls due for a trim as well as a few big ones.
CALL_OVERHEAD_BYTES = 4 << 10
# Trim once this much has arrived since the last trim: below it the garbage a trim could
# return is a few MB at most, and sparse calls do not trigger a pass over every arena.
DEFAULT_TRIM_AFTER_BYTES = 4 << 20
# The calls have paused when none arrived for this long (the watchdog looks every 0.1 s).
DEFAULT_QUIET_S = 0.1
# Under calls that never pause, trim anyway once a trim has been due for this long.
DEFAULT_MAX_DELAY_S = 10.0
# At most one trim per this many seconds: bounds the cost whatever the traffic.
DEFAULT_MIN_INTERVAL_S = 1.0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        # Only glibc answers this; musl and others raise.
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        fn = ctypes.CDLL(None).malloc_trim  # the C library the process already uses
    except (AttributeError, OSError, ValueError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim_supported() -> bool:
    """Whether this process can return freed heap memory with glibc's ``malloc_trim``."""
    return _malloc_trim() is not None


def malloc_trim() -> bool:
    """Return the heap's free whole pages to the OS; True if any memory was released.

    A no-op returning False where the C library is not glibc. ctypes releases the GIL
    for the call, so it may run in a worker thread.
    """
    fn = _malloc_trim()
    return fn is not None and fn(0) == 1


class HeapTrimmer:
    """Calls ``malloc_trim`` after a burst of session calls, rate-limited.

    The owner reports each session call's payload with ``note``, asks for a trim after
    operations that churn the heap with ``request``, and calls ``maybe_trim`` from a
    periodic task when the holder may spend a few milliseconds on it.

    Args:
        trim_after_bytes: Bytes noted (payload plus ``CALL_OVERHEAD_BYTES`` per call)
            that make a trim due.
        quiet_s: A due trim waits until no call was noted for this long...
        max_delay_s: ...or until it has been due for this long.
        min_interval_s: Least time between two trims.
        trim: The trim itself (default ``malloc_trim``); returns whether it released
            memory.
        clock: Monotonic seconds (for tests).
        run_blocking: Where the trim runs (a thread; inline on a virtual-time loop,
            whose clock a thread's completion would never wake).
    """

    def __init__(
        self,
        trim_after_bytes: int = DEFAULT_TRIM_AFTER_BYTES,
        quiet_s: float = DEFAULT_QUIET_S,
        max_delay_s: float = DEFAULT_MAX_DELAY_S,
        min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
        trim: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        run_blocking: Callable[..., Awaitable[Any]] = asyncio.to_thread,
    ) -> None:
        self.trim_after_bytes = trim_after_bytes
        self.quiet_s = quiet_s
        self.max_delay_s = max_delay_s
        self.min_interval_s = min_interval_s
        self._trim = trim if trim is not None else malloc_trim
        self._clock = clock
        self._run_blocking = run_blocking
        # Without glibc nothing can be returned: never due, so nothing is scheduled.
        self.enabled = trim is not None or trim_supported()
        self.pending_bytes = 0
        self._due_since: float | None = None  # when the bytes or a request made it due
        self._last_call: float | None = None
        self._last_trim: float | None = None
        self.trims = 0
        self.last_trim_seconds = 0.0

    def note(self, payload_bytes: int) -> None:
        """Count one session call that brought ``payload_bytes`` of states and records."""
        self.pending_bytes += payload_bytes + CALL_OVERHEAD_BYTES
        self._last_call = self._clock()
        if self._due_since is None and self.pending_bytes >= self.trim_after_bytes:
            self._due_since = self._last_call

    def request(self) -> None:
        """Make a trim due whatever arrived (after a snapshot or restore finished)."""
        if self._due_since is None:
            self._due_since = self._clock()

    def due(self) -> bool:
        """Whether ``maybe_trim`` would trim now."""
        if not self.enabled or self._due_since is None:
            return False
        now = self._clock()
        if self._last_trim is not None and now - self._last_trim < self.min_interval_s:
            return False
        quiet = self._last_call is None or now - self._last_call >= self.quiet_s
        return quiet or now - self._due_since >= self.max_delay_s

    async def maybe_trim(self) -> bool:
        """Trim in a worker thread if due; returns whether it trimmed.

        The event loop keeps serving calls meanwhile, except while it allocates from the
        arena being trimmed (see the module docstring).
        """
        if not self.due():
            return False
        self.pending_bytes = 0
        self._due_since = None
        self._last_trim = self._clock()
        start = time.perf_counter()
        released = await self._run_blocking(self._trim)
        self.last_trim_seconds = time.perf_counter() - start
        self.trims += 1
        log.debug("malloc_trim in %.1f ms (released memory: %s)",
                  self.last_trim_seconds * 1e3, released)
        return True


def freeze_startup_objects() -> None:
    """Exclude every object alive now from the cyclic garbage collector's scans.

    For a long-lived actor process, once it is set up: the objects of Ray, pydantic and
    the other imports live as long as the process, yet every full (generation 2)
    collection walks all of them. In the coordinator that walk took 45-57 ms, often in
    the middle of a snapshot's pause; after this call it takes ~3 ms. Objects frozen
    here are still freed by reference counting; only a reference cycle among them would
    never be collected, which is why this runs once, at startup, after a collection.
    """
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a bulk step builds many containers (a
    restore decodes one list per session): every few hundred allocations would start a
    collection that walks them all, which made such a step several times slower.
    Nothing here forms cycles; reference counting still frees everything."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
