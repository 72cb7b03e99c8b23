"""Where a checkpoint lives: a local folder, or an object-store URL.

A checkpoint path reaches nemo-ckpt as a ``str`` or a ``pathlib.Path``, from RL's
driver, the CLI or the config. A URL must not be taken for a relative folder:
``Path("s3://nemo/demo")`` is the local folder ``s3:/nemo/demo``, and a snapshot written
there is silently not where the user looks. So every entry point parses its path here
first: a URL is recognised (one that ``Path`` already collapsed to ``scheme:/`` is
refused, with the URL to pass instead), and a folder stays a folder.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from nemo_ckpt.errors import CheckpointPathError

__all__ = ["LocalLocation", "ObjectLocation", "Location", "parse_location", "join_location",
           "as_path_or_url", "base_name", "levels_below", "parent_location"]

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")
# What Path() makes of a URL: "s3://b/p" -> "s3:/b/p". One letter is a Windows drive.
_COLLAPSED_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


@dataclass(frozen=True)
class LocalLocation:
    """A folder on a filesystem every node and the driver mount at the same path."""

    path: Path

    def __str__(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class ObjectLocation:
    """``<scheme>://<bucket>/<prefix>``: a prefix in an object-store bucket."""

    scheme: str
    bucket: str
    prefix: str  # no leading or trailing "/"; "" for the bucket's root

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix \
            else f"{self.scheme}://{self.bucket}"


Location = LocalLocation | ObjectLocation


def parse_location(path: str | os.PathLike[str]) -> Location:
    """The location ``path`` names. Raises ``CheckpointPathError`` for a URL that is
    malformed or whose ``Path`` form lost its ``//``."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise CheckpointPathError(str(text), f"checkpoint path {text!r} is not text")
    return _parse_text(text)


# Every file operation parses its checkpoint path again, and a job uses a handful of
# paths: parse each once (locations are frozen, so sharing them is safe).
@functools.lru_cache(maxsize=1024)
def _parse_text(text: str) -> Location:
    url = _URL.match(text)
    if url is None:
        collapsed = _COLLAPSED_URL.match(text)
        if collapsed is not None:
            scheme = collapsed["scheme"].lower()
            raise CheckpointPathError(
                text, f"checkpoint path {text!r} looks like a {scheme}:// URL that "
                      f"pathlib.Path collapsed (it drops one '/'); pass the URL as a str, "
                      f"e.g. '{scheme}://{text[collapsed.end():]}'")
        return LocalLocation(Path(text))
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise CheckpointPathError(
            text, f"checkpoint URL {text!r} has a query or fragment; name the bucket and "
                  f"prefix only ({scheme}://bucket/prefix), and give endpoint and "
                  f"credentials the standard way (environment, config files)")
    if not parts.netloc:
        raise CheckpointPathError(
            text, f"checkpoint URL {text!r} names no bucket; write {scheme}://bucket/prefix")
    prefix = parts.path.strip("/")
    if any(seg in ("", ".", "..") for seg in prefix.split("/")) and prefix:
        raise CheckpointPathError(
            text, f"checkpoint URL {text!r} has an empty, '.' or '..' segment in its "
                  f"prefix; write {scheme}://bucket/a/b")
    return ObjectLocation(scheme, parts.netloc, prefix)


def join_location(where: str | os.PathLike[str], *names: str) -> str:
    """``where`` (a folder or a URL) with ``names`` below it, as text."""
    location = parse_location(where)
    if isinstance(location, ObjectLocation):
        return "/".join([str(location), *names])
    return str(location.path.joinpath(*names))


def as_path_or_url(where: str | os.PathLike[str]) -> Path | str:
    """``where`` as a caller hands it on: a ``Path`` for a folder, the URL's text for an
    object store (never a ``Path``, which would collapse its ``//``)."""
    location = parse_location(where)
    return location.path if isinstance(location, LocalLocation) else str(location)


def base_name(where: str | os.PathLike[str]) -> str:
    """The last segment of a folder's path or a URL's prefix (``""`` for a bucket)."""
    location = parse_location(where)
    if isinstance(location, LocalLocation):
        return location.path.name
    return location.prefix.rsplit("/", 1)[-1]


def levels_below(root: str | os.PathLike[str], where: str | os.PathLike[str]) -> int | None:
    """How many segments ``where`` lies below ``root`` (both folders, or both URLs of one
    bucket); None when it is not strictly below. Folders are compared absolute, without
    resolving links (every node mounts them at the same path)."""
    outer, inner = parse_location(root), parse_location(where)
    if isinstance(outer, LocalLocation) and isinstance(inner, LocalLocation):
        a = Path(os.path.abspath(outer.path)).parts
        b = Path(os.path.abspath(inner.path)).parts
    elif isinstance(outer, ObjectLocation) and isinstance(inner, ObjectLocation):
        if (outer.scheme, outer.bucket) != (inner.scheme, inner.bucket):
            return None
        a = tuple(outer.prefix.split("/")) if outer.prefix else ()
        b = tuple(inner.prefix.split("/")) if inner.prefix else ()
    else:
        return None
    if len(b) <= len(a) or b[:len(a)] != a:
        return None
    return len(b) - len(a)


def parent_location(where: str | os.PathLike[str], levels: int) -> str:
    """``where`` with its last ``levels`` segments dropped, as text."""
    location = parse_location(where)
    if isinstance(location, LocalLocation):
        path = Path(os.path.abspath(location.path))
        for _ in range(levels):
            path = path.parent
        return str(path)
    parts = location.prefix.split("/") if location.prefix else []
    if levels > len(parts):
        raise CheckpointPathError(str(location), f"{location} has no folder {levels} up")
    return str(ObjectLocation(location.scheme, location.bucket,
                              "/".join(parts[:len(parts) - levels])))
