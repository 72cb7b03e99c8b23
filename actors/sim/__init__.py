"""The real driver, coordinator and holders in one process, under a virtual clock
(``nemo_ckpt.testing.virtual_time``) and a seeded transport: the world the deterministic
simulation (``tests/simulation/``) runs. It runs the real actor classes in-process, as
``actors/ray_transport.py`` runs them on Ray; a run is a pure function of its seed (no
wall time; one guard thread only watches for a call that blocks).

- ``SimWorld`` (``actors.sim.world``) holds nodes and actors. Every actor (holder,
  coordinator, and the driver and environment workers as pseudo-actors) has its own
  clocks, and every task it starts is its own: killing it cancels them all, as a process
  death would. Ray as it behaves: a death is noticed after ``death_delay`` (calls to the
  dead fail then, or at their timeout) and its name resolves to the dead actor until
  released; ``stall`` freezes actors (their messages, answers and blocking work wait), and
  a stall past its detection delay makes Ray declare them dead: their calls fail and their
  names are released, yet they run again as zombies once the stall ends.
- Delivery (``actors.sim.delivery``): each call arrives after a seeded delay, pickled as
  between processes, runs as a task of the callee, and its result travels back after
  another delay; a fault may lose a message, deliver it twice or lose its answer; each
  actor admits ``concurrency`` calls per group (``method_group``), the rest wait in FIFO
  order.
- An actor's runtime (``actors.sim.runtime``): its clocks (a steady offset of its wall
  clock, a monotonic clock of its own origin, a rate that differs a little from true time,
  and jumps) and ``run_blocking`` as a thread model, with seeded costs and injected
  faults; a call that blocks is reported and unblocked (``actors.sim.guard``).
- ``SimTransport`` (``actors.sim.transport``) implements ``nemo_ckpt.transport.Transport``
  over the world, as seen from one actor.

Files are real (a temporary folder per world), so the format code is the real one.
"""

from actors.sim.actor import ActorDied, IoFault, SimActor, current_actor
from actors.sim.delivery import method_group
from actors.sim.transport import SimTransport
from actors.sim.world import SimWorld

__all__ = [
    "ActorDied",
    "IoFault",
    "SimActor",
    "SimTransport",
    "SimWorld",
    "current_actor",
    "method_group",
]
