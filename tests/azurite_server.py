"""Azurite's Blob service (from npm; ``make install`` puts it under ``.venv/npm``) on
127.0.0.1, with one container: the ``az://`` store the object-store tests run against.

Clients find it the standard way for Azure, through the ``AZURE_*`` environment
(``env()``) with obstore's emulator switch; Azurite's own well-known development
account and key are the credentials.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import shutil
import subprocess
import sys
import time
from email.utils import formatdate
from pathlib import Path

from tests.s3_server import BUCKET, LocalS3Server

# Azurite's fixed development account (documented by Azure, not a secret).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")
_API_VERSION = "2021-08-06"


def azurite_binary() -> str:
    beside = Path(sys.executable).parent.parent / "npm" / "node_modules" / ".bin" / "azurite-blob"
    found = str(beside) if beside.exists() else shutil.which("azurite-blob")
    if not found:
        raise RuntimeError("Azurite is missing: run `make install` (it installs azurite from "
                           "npm into .venv/npm; node and npm must be on the PATH)")
    return found


class AzuriteServer(LocalS3Server):
    """``azurite-blob`` with one container (``ckpt``), its data under ``data_dir``."""

    name = "azurite"
    scheme = "az"

    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_USE_EMULATOR": "true",
                "AZURITE_BLOB_STORAGE_URL": self.endpoint,
                "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
                "AZURE_STORAGE_ACCOUNT_KEY": ACCOUNT_KEY}

    def version(self) -> str:
        done = subprocess.run([azurite_binary(), "--version"], capture_output=True,
                              text=True)
        return f"Azurite {done.stdout.strip()}"

    def _command(self) -> list[str]:
        return [azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                "--location", str(self.data_dir / "azurite"), "--silent",
                "--skipApiVersionCheck"]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"azurite exited with {self._proc.returncode}; see "
                                   f"{self.data_dir / 'azurite.out'}")
            try:
                status = self._create_container()
                if status in (201, 409):  # made, or there from an earlier start
                    return
                raise RuntimeError(f"azurite refused to create the container: {status}")
            except OSError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise
                time.sleep(0.1)

    def _create_container(self) -> int:
        """Create the container with a SharedKey-signed request (Azure's REST API)."""
        headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": _API_VERSION}
        signed = ("PUT" + "\n" * 12
                  + "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
                  + f"/{ACCOUNT}/{ACCOUNT}/{BUCKET}\nrestype:container")
        digest = hmac.new(base64.b64decode(ACCOUNT_KEY), signed.encode(), hashlib.sha256)
        headers["Authorization"] = (f"SharedKey {ACCOUNT}:"
                                    f"{base64.b64encode(digest.digest()).decode()}")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("PUT", f"/{ACCOUNT}/{BUCKET}?restype=container", headers=headers)
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()
