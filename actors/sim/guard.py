"""The guard of the simulation's blocking work: a daemon thread that watches the one
blocking call running now and, when it waits in the kernel for what never comes, moves
its actor's clocks on, reports it and unblocks it."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from actors.sim.actor import SimActor
from actors.sim.view import WorldView

__all__ = ["GUARD", "GUARD_S", "Guard"]

# Real seconds a blocking call may take before the guard acts: sim calls take
# milliseconds, so this only trips on a call that waits for something that never comes.
GUARD_S = 0.5

# The simulation's own modules: a blocked call is reported where the project's code waits.
_OWN_MODULES = ("nemo_ckpt.testing", "actors.sim")


class Guard:
    """Watches the one blocking call running now, from a daemon thread. A call that has
    slept in the kernel for ``GUARD_S`` (a FIFO's open, a lock's wait) first sees its
    actor's clocks move on (``thread_skip``: virtual time does not pass while a call
    runs, so a wait on a clock would spin); after another ``GUARD_S`` it is reported and
    unblocked. Only the time the thread sleeps counts, where the system says
    (``/proc``): a call that waits for a core or for the GIL on a loaded machine is not
    blocked, and counting it would make a seed's schedule depend on the machine's load."""

    def __init__(self) -> None:
        self.world: WorldView | None = None
        self.serial = 0  # counts the calls run
        self.busy = False  # whether one runs now
        self.thread_id = 0
        self._stat = Path("/proc/self/stat")
        self._thread: threading.Thread | None = None

    def start(self, world: WorldView) -> None:
        self.world = world
        self.thread_id = threading.get_ident()
        self._stat = Path(f"/proc/self/task/{threading.get_native_id()}/stat")
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="sim-blocking-guard")
            self._thread.start()

    def _sleeping(self) -> bool:
        """Whether the watched thread sleeps in the kernel, other than on a futex (the
        GIL's, which the loaded machine may keep from it); True where ``/proc`` is not."""
        try:
            stat = self._stat.read_bytes()
            wchan = self._stat.with_name("wchan").read_bytes()
        except OSError:
            return True
        return stat[stat.rindex(b")") + 2:][:1] == b"S" and not wchan.startswith(b"futex")

    def _watch(self) -> None:
        seen, slept, stage = 0, 0.0, 0
        while True:
            time.sleep(GUARD_S / 4)
            serial, world = self.serial, self.world
            if not self.busy or world is None:
                seen, stage = 0, 0
                continue
            if serial != seen:
                seen, slept, stage = serial, 0.0, 0
                continue
            if self._sleeping():
                slept += GUARD_S / 4
            if slept < GUARD_S * (stage + 1):
                continue
            stage += 1
            if stage == 1:
                world.thread_skip = world.call_deadline_s
                continue
            running, name = world.running, world.running_name
            world.thread_skip = 10 * 3600.0
            report = None
            if stage == 2 and world.on_blocked is not None and running is not None:
                # Reported before the call is freed: reported after, the call could
                # return first and its schedule end without the violation (a loaded
                # machine did so).
                report = partial(_report, world.on_blocked, running, name, self._where())
            world.unblock(report)

    def _where(self) -> str:
        """The innermost function of the project that the blocked call is in."""
        frame = sys._current_frames().get(self.thread_id)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith(("nemo_ckpt", "actors")) and \
                    not module.startswith(_OWN_MODULES):
                return f"{frame.f_code.co_name} ({module}:{frame.f_lineno})"
            frame = frame.f_back
        return "?"


def _report(on_blocked: Callable[[SimActor, str, str], None], running: SimActor,
            name: str, where: str, fifos: int) -> None:
    if fifos:
        where += f", opening a FIFO ({fifos} opened for writing to free it)"
    on_blocked(running, name, where)


# One per process: one thread runs blocking calls, the one the loop runs on.
GUARD = Guard()
