"""What a failed call to an object store means, said in one line a person can act on.

obstore's errors carry the request, the retries and the server's XML body over many
lines; the mistakes people make on a bucket (a bucket that does not exist, no
credentials or endpoint, a wrong endpoint, credentials that may not do it) each get a
sentence naming what to change. Anything else keeps its class and first line.
"""

from __future__ import annotations

import os

from nemo_ckpt.location import ObjectLocation

__all__ = ["is_store_error", "store_failure"]

# What the environment is read for, named in the messages (obstore reads them too).
_CREDENTIALS = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"


def is_store_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from the store (obstore's errors, or an ``OSError``)."""
    return type(exc).__module__.startswith("obstore") or isinstance(exc, OSError)


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL") or "AWS S3 (AWS_ENDPOINT_URL is not set)"


def store_failure(location: ObjectLocation, exc: BaseException) -> OSError:
    """``exc``, a store's failure at ``location``, as an ``OSError`` of one line: a
    ``PermissionError`` when the store refused the credentials, a ``FileNotFoundError``
    only for an object that is not there (a missing bucket is not that)."""
    text = str(exc)
    bucket = f"{location.scheme}://{location.bucket}"
    if "NoSuchBucket" in text:
        return OSError(f"the bucket {bucket} does not exist at {_endpoint()}; create it, "
                       f"or correct the bucket in the checkpoint path")
    if "169.254.169.254" in text or type(exc).__name__ == "UnauthenticatedError":
        return OSError(f"no credentials for {bucket}: set {_CREDENTIALS} (and "
                       f"AWS_ENDPOINT_URL and AWS_REGION for a server other than AWS S3) on "
                       f"every node and the driver, or give the nodes an instance role")
    if "error sending request" in text:
        return OSError(f"no server answers at {_endpoint()} for {bucket}; check "
                       f"AWS_ENDPOINT_URL's host and port")
    if type(exc).__name__ == "PermissionDeniedError" or "403 Forbidden" in text:
        return PermissionError(f"access denied to {location} by {_endpoint()}: check "
                               f"{_CREDENTIALS} and the bucket's permissions")
    if isinstance(exc, FileNotFoundError):
        return exc
    return OSError(f"{type(exc).__name__}: {(text.strip().splitlines() or [''])[0]}")
