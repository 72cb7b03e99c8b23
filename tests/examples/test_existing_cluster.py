"""The existing-cluster path, as a user meets it: a head started with `ray start --head`
that uses Ray's token authentication, and the minimal example, the demo and
`nemo-ckpt status` run against it as separate processes.

The head runs in a subprocess (`ray start --head --block`, free ports, its own temp dir
and HOME), is started once for the module and stopped by its own process id; every
process it spawned is gone when the module ends. Each client gets a HOME of its own, so
no token file of the machine's user is read or written.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def free_ports(n: int) -> list[int]:
    """``n`` ports nothing listens on now (so another Ray on this machine is not hit)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (raylet, GCS, workers, actors)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Head:
    address: str  # as a user types it: 127.0.0.1, which Ray rewrites to the node's IP
    token: str
    pid: int


def client_env(home: Path, **auth: str) -> dict[str, str]:
    """A user's shell: no Ray auth settings but ``auth``, and a HOME of its own."""
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", **auth)
    return env


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    # A short folder: Ray's socket paths under it must fit in 107 bytes.
    home = Path(tempfile.mkdtemp(prefix="nck-head-"))
    token = secrets.token_hex(16)
    gcs, client, agent, dashboard = free_ports(4)
    env = client_env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    log = open(home / "head.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
         f"--dashboard-port={dashboard}", "--include-dashboard=false", "--num-cpus=2",
         f"--temp-dir={home / 'ray'}", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in (home / "head.log").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("`ray start --head` did not come up:\n"
                                   + (home / "head.log").read_text()[-3000:])
            time.sleep(0.2)
        yield Head(address=f"127.0.0.1:{gcs}", token=token, pid=proc.pid)
    finally:
        below = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in below:  # anything that ignored the shutdown, by its own id
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(home, ignore_errors=True)


def run(argv: list[str], env: dict[str, str], timeout: float = 120,
        cwd: Path | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)
    return done, time.monotonic() - started


def status(address: str, env: dict[str, str], *extra: str
           ) -> tuple[subprocess.CompletedProcess[str], float]:
    return run([str(BIN / "nemo-ckpt"), "status", "--address", address, *extra], env,
               timeout=60)


MINIMAL = [sys.executable, str(ROOT / "examples" / "minimal_driver.py")]
DEMO = [sys.executable, str(ROOT / "examples" / "turn_level_recovery.py")]


# --- refused: one line, in seconds, naming the address typed and Ray's cause ------------


@pytest.mark.timeout(120)
def test_without_ray_auth_mode_status_and_the_example_fail_fast_with_the_fix(
        head: Head, tmp_path: Path) -> None:
    # The token is where Ray looks by default, but Ray sends it to an address typed by
    # hand only with RAY_AUTH_MODE=token.
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(head.token)
    env = client_env(tmp_path)
    for argv in ([str(BIN / "nemo-ckpt"), "status", "--address", head.address],
                 [*MINIMAL, "--address", head.address, "--checkpoint-dir",
                  str(tmp_path / "ckpt")]):
        done, seconds = run(argv, env)
        assert done.returncode == 1, done.stderr
        assert seconds < 15, "no 20 s of ray.init retries"
        (line,) = done.stderr.splitlines()
        assert f"cannot connect to a Ray cluster at '{head.address}': the cluster uses " \
               f"Ray's token authentication" in line
        assert "export RAY_AUTH_MODE=token" in line
        assert "a token is in ~/.ray/auth_token" in line
        assert line.endswith("[Ray: RPC error: InvalidAuthToken: Authentication token is "
                             "missing or incorrect]")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ray"]


@pytest.mark.timeout(60)
def test_a_wrong_token_is_named_as_such(head: Head, tmp_path: Path) -> None:
    done, seconds = status(head.address, client_env(tmp_path, RAY_AUTH_MODE="token",
                                                    RAY_AUTH_TOKEN="not-the-token"))
    assert done.returncode == 1 and seconds < 15
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"nemo-ckpt status: error: cannot connect to a Ray cluster at "
                           f"'{head.address}': the cluster refused the token from "
                           f"RAY_AUTH_TOKEN")
    assert "InvalidAuthToken" in line


@pytest.mark.timeout(60)
def test_token_mode_without_a_token_is_refused_before_ray_aborts(
        head: Head, tmp_path: Path) -> None:
    done, _ = status(head.address, client_env(tmp_path, RAY_AUTH_MODE="token"))
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert "RAY_AUTH_MODE=token but this process has no token" in line
    assert "Check failed" not in done.stderr


@pytest.mark.timeout(60)
def test_token_mode_against_a_cluster_without_token_auth_is_refused(
        cluster: Any, tmp_path: Path) -> None:
    # The session's embedded cluster has no token authentication: a driver in token
    # mode would connect, then lose every actor it starts.
    done, _ = status(cluster.address, client_env(tmp_path, RAY_AUTH_MODE="token",
                                                 RAY_AUTH_TOKEN="some-token"))
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert f"at '{cluster.address}': this process has RAY_AUTH_MODE=token but the cluster " \
           f"does not use token authentication" in line


# --- with the token: the minimal example, the demo and status -------------------------------


@pytest.mark.timeout(180)
def test_the_minimal_example_recovers_on_the_token_cluster_with_a_token_file(
        head: Head, tmp_path: Path) -> None:
    token_file = tmp_path / "cluster-token"
    token_file.write_text(head.token)
    env = client_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    done, _ = run([*MINIMAL, "--address", head.address, "--namespace", "t-minimal",
                   "--checkpoint-dir", str(tmp_path / "ckpt")], env, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("namespace t-minimal: session holders holder-0; see them "
                               f"with: nemo-ckpt status --address {head.address} "
                               f"--namespace t-minimal")
    assert any(line.startswith("restored ") and "3 rollouts continue mid-rollout, 1 start "
               "over, 1 finished result(s) handed back" in line for line in lines)
    assert lines[-1].startswith("VERIFIED: 6 rollouts x 6 turns")
    snapshot = tmp_path / "ckpt" / "step-1"
    assert (snapshot / "environment" / "manifest.json").is_file()
    assert (snapshot / "data_plane.json").is_file()
    # Its holders went with it.
    done, _ = status(head.address, env, "--namespace", "t-minimal")
    assert done.returncode == 1 and "no nemo-ckpt holders in namespace 't-minimal' on the " \
        f"cluster at '{head.address}'" in done.stderr


@pytest.mark.timeout(240)
def test_the_demo_prints_its_namespace_and_status_finds_its_holders(
        head: Head, tmp_path: Path) -> None:
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(head.token)
    env = client_env(tmp_path, RAY_AUTH_MODE="token")
    demo = subprocess.Popen(
        [*DEMO, "--address", head.address, "--rollouts", "8", "--turns", "16",
         "--rollouts-per-worker", "2", "--turn-seconds", "0.08", "--snapshot-every", "0.5",
         "--crash-after-snapshots", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
         "--json", str(tmp_path / "report.json")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert demo.stderr is not None
        command = None
        for line in demo.stderr:
            found = re.search(r"see them while the run lasts: (nemo-ckpt status .*)$", line)
            if found:
                command = found.group(1).split()
                break
        assert command is not None, "the demo printed no namespace"
        assert command[1:4] == ["status", "--address", head.address]
        namespace = command[command.index("--namespace") + 1]
        # The command as printed, run by a user in another shell while the demo runs.
        # (Retried: for a moment around the crash the namespace has no holders, or its
        # holders and no coordinator.)
        for _ in range(10):
            done, _ = run([str(BIN / "nemo-ckpt"), *command[1:]], env, timeout=60)
            if done.returncode == 0 and "coordinator running" in done.stdout:
                break
            time.sleep(0.5)
        assert done.returncode == 0, done.stderr
        first = done.stdout.splitlines()[0]
        assert first.startswith(f"namespace {namespace}: 1 holders, coordinator running")
        assert "holder-0" in done.stdout
        out, err = demo.communicate(timeout=200)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, out + err
    assert "VERIFIED" in out
    assert (tmp_path / "report.json").is_file()
