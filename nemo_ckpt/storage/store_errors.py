"""What a failed call to an object store means, said in one line a person can act on.

obstore's errors carry the request, the retries and the server's XML body over many
lines; the mistakes people make on a bucket (a bucket that does not exist, no
credentials or endpoint, a wrong endpoint, credentials that may not do it) each get a
sentence naming what to change, in the terms of the store (S3's ``AWS_*`` variables,
Azure's ``AZURE_*``). Anything else keeps its class and first line.

On a folder, a name that should hold a file we wrote but holds something else (a FIFO,
whose open would block for ever; a link, which would be read through; a device, a
folder) is ``NotARegularFileError``, refused before a byte is read.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from nemo_ckpt.storage.location import ObjectLocation

__all__ = ["NotARegularFileError", "is_store_error", "not_a_regular_file", "store_failure"]


@dataclass(frozen=True)
class _Store:
    """How one kind of store names its buckets, endpoint and credentials."""

    bucket: str  # what the store calls a bucket
    missing_codes: tuple[str, ...]  # error codes of a bucket that does not exist
    credentials: str  # the variables that hold credentials
    set_up: str  # the rest of what to set, after the credentials
    endpoint_hint: str  # what to check when no server answers
    allow_http: str  # the variable that lets the client talk to a plain-http endpoint

    def endpoint(self) -> str:
        raise NotImplementedError


class _S3(_Store):
    def endpoint(self) -> str:
        return os.environ.get("AWS_ENDPOINT_URL") or "AWS S3 (AWS_ENDPOINT_URL is not set)"


class _Azure(_Store):
    def endpoint(self) -> str:
        if os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() in ("1", "true"):
            return os.environ.get("AZURITE_BLOB_STORAGE_URL") or "http://127.0.0.1:10000"
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        return (f"https://{account}.blob.core.windows.net" if account
                else "Azure (AZURE_STORAGE_ACCOUNT_NAME is not set)")


_STORES: dict[str, _Store] = {
    "s3": _S3("bucket", ("NoSuchBucket",), "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
              "(and AWS_ENDPOINT_URL and AWS_REGION for a server other than AWS S3) on every "
              "node and the driver, or give the nodes an instance role",
              "check AWS_ENDPOINT_URL's host and port", "AWS_ALLOW_HTTP"),
    "az": _Azure("container", ("ContainerNotFound",),
                 "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY",
                 "(or AZURE_STORAGE_SAS_TOKEN instead of the key) on every node and the "
                 "driver, or give the nodes a managed identity",
                 "check AZURE_STORAGE_ACCOUNT_NAME (AZURITE_BLOB_STORAGE_URL for Azurite)",
                 "AZURE_ALLOW_HTTP"),
}


class NotARegularFileError(OSError):
    """A stored name that is not a regular file: nothing of it was read. Its message is
    one line naming the path, what is there and what to do."""


def not_a_regular_file(where: Path | str, mode: int | None) -> NotARegularFileError:
    """The refusal of ``where``, whose ``stat`` mode is ``mode`` (None: a link, which
    was not followed)."""
    kind = ("a symbolic link" if mode is None else "a FIFO" if stat.S_ISFIFO(mode)
            else "a folder" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file")
    return NotARegularFileError(
        f"{where} is {kind}, not a regular file as nemo-ckpt writes (it reads no other "
        f"kind): remove it")


def is_store_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from the store (obstore's errors, or an ``OSError``)."""
    return type(exc).__module__.startswith("obstore") or isinstance(exc, OSError)


def store_failure(location: ObjectLocation, exc: BaseException) -> OSError:
    """``exc``, a store's failure at ``location``, as an ``OSError`` of one line: a
    ``PermissionError`` when the store refused the credentials; a ``FileNotFoundError``
    (``exc`` itself) only for an object that is not there, not for a missing bucket."""
    text = str(exc)
    store = _STORES.get(location.scheme, _STORES["s3"])
    bucket = f"{location.scheme}://{location.bucket}"
    if any(code in text for code in store.missing_codes):
        return OSError(f"the {store.bucket} {bucket} does not exist at {store.endpoint()}; "
                       f"create it, or correct the {store.bucket} in the checkpoint path")
    if ("169.254.169.254" in text or type(exc).__name__ == "UnauthenticatedError"
            or "Account must be specified" in text):
        return OSError(f"no credentials for {bucket}: set {store.credentials} "
                       f"{store.set_up}")
    if "builder error" in text and store.endpoint().lower().startswith("http://"):
        # The client refuses to build a request to a plain-http endpoint unless told to;
        # all it says is "builder error".
        return OSError(f"the endpoint {store.endpoint()} for {bucket} is plain http, which "
                       f"the store's client refuses unless {store.allow_http}=true is set: "
                       f"set it on every node and the driver, or use an https:// endpoint")
    if "error sending request" in text:
        return OSError(f"no server answers at {store.endpoint()} for {bucket}; "
                       f"{store.endpoint_hint}")
    if type(exc).__name__ == "PermissionDeniedError" or "403 Forbidden" in text:
        return PermissionError(f"access denied to {location} by {store.endpoint()}: check "
                               f"{store.credentials} and the {store.bucket}'s permissions")
    if isinstance(exc, FileNotFoundError):
        return exc
    return OSError(f"{type(exc).__name__}: {(text.strip().splitlines() or [''])[0]}")
