"""Where a holder's memory goes, without Ray: one process holds N sessions the way a
holder does (``actors.holder.session_table``), captures them and writes their shard, and prints
the resident cost per session and what the capture and the write add at their peak.

    .venv/bin/python -m benchmarks.holder_memory --sessions 250000 --state-bytes 1024

The benchmark's ``holder peak`` (``benchmarks.snapshot_bench --scale``) measures the same in a
real holder process, where Ray's own buffers come on top; this separates the two.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import tempfile
from pathlib import Path

from actors.holder.session_table import Held, SessionTable
from actors.holder.shards import write_held_shard
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.phases import join_captured
from nemo_ckpt.storage.checkpoint_folder import folder_at


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _settle() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=250_000)
    parser.add_argument("--state-bytes", type=int, default=1024)
    args = parser.parse_args(argv)
    n = args.sessions
    _settle()
    base = _status("VmRSS")
    table = SessionTable("holder-0")
    for i in range(n):
        # The benchmark's rollout ids (benchmarks/scale.py).
        table.put(Held.fresh(EnvironmentEpisode(f"rollout-{i:07d}", 0),
                             os.urandom(args.state_bytes)))
    _settle()
    state = table.held_bytes
    resident = _status("VmRSS") - base
    _reset_peak()
    held = list(table)
    index = join_captured([h.row for h in held])
    captured = _status("VmRSS") - base
    with tempfile.TemporaryDirectory() as tmp:
        write_held_shard(folder_at(Path(tmp)), "shard.msgpack", "holder-0", held, index)
    peak = _status("VmHWM") - base
    print(f"{n} sessions x {args.state_bytes} B, {state / 2**20:.1f} MiB of state")
    print(f"  resident:            {resident / state:.3f} x the state "
          f"({(resident - state) / n:.0f} B per session over it)")
    print(f"  after the capture:   {captured / state:.3f} x "
          f"(+{(captured - resident) / n:.0f} B per session; the index is "
          f"{len(index) / n:.0f} B per session)")
    print(f"  peak, capture+write: {peak / state:.3f} x "
          f"(+{(peak - resident) / n:.0f} B per session over resident)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
