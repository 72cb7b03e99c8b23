"""How long ``nemo-ckpt inspect`` and ``verify`` take on a big snapshot, without Ray.

Writes a snapshot of ``--sessions`` sessions of ``--state-bytes`` each over 4 instances
into a temporary folder, the way holders write it (``write_shard``, then the manifest),
then runs ``nemo-ckpt inspect`` and ``nemo-ckpt verify`` on it, each in a fresh process
as a user would (output to /dev/null), and prints their wall time and peak memory.

    .venv/bin/python -m benchmarks.cli_scale --sessions 1000000
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.manifest import encode_manifest
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.shards import write_shard
from nemo_ckpt.storage.snapshot_files import write_manifest

INSTANCES = 4


def write_snapshot(root: Path, sessions: int, state_bytes: int) -> int:
    folder = environment_folder(root)
    folder.prepare()
    pool = os.urandom(state_bytes + 4096)
    shards = []
    for h in range(INSTANCES):
        inst = f"holder-{h}"
        records = (SessionRecord(
            instance_id=inst, episode=EnvironmentEpisode(f"r{h}-{i:07d}", 0), turns=(b"t",),
            state=pool[i % 4096:i % 4096 + state_bytes],
            staging_keys=frozenset({f"r{h}-{i:07d}/t0"}), earlier_capture_keys=())
            for i in range(sessions // INSTANCES))
        shards.append(write_shard(folder, shard_file_name("cli", inst), inst, records))
    write_manifest(folder, encode_manifest(
        snapshot_id="cli", created_at=datetime.now(timezone.utc),
        instances=[f"holder-{h}" for h in range(INSTANCES)], shards=shards,
        restarted_rollouts=0, metrics={}))
    return sum(s.bytes for s in shards)


def timed_command(args: list[str]) -> tuple[float, int, int]:
    """Wall seconds, exit code and peak RSS (KiB) of ``nemo-ckpt ARGS``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "nemo_ckpt", *args],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return elapsed, done.returncode, max(peak, before)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=1_000_000)
    p.add_argument("--state-bytes", type=int, default=1024)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="nemo-ckpt-cli-"))
    try:
        t = time.perf_counter()
        size = write_snapshot(root, args.sessions, args.state_bytes)
        print(f"wrote {args.sessions} sessions x {args.state_bytes} B ({size / 1e6:.0f} MB, "
              f"{INSTANCES} shards) in {time.perf_counter() - t:.1f} s")
        for command in ("inspect", "verify"):
            elapsed, code, peak = timed_command([command, str(root)])
            print(f"nemo-ckpt {command}: {elapsed:.1f} s, exit {code}, peak RSS of the "
                  f"processes so far {peak / 1024:.0f} MiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
