"""Joining a running Ray cluster: the address check, Ray's token authentication, and
connection failures as one line that names the address the user typed and Ray's cause.

``ray.init(address=...)`` on a bad address retries for ~20 s and prints a line per retry
before a traceback that names the address Ray rewrote (``127.0.0.1`` becomes the node's
IP). ``connect`` checks first, in about a second, what ray.init would fail on:

1. the address resolves (``auto`` finds a cluster started by ``ray start`` on this node);
2. something answers at it;
3. the cluster's GCS accepts this process's credentials. Ray 2.60 clusters started by
   ``ray start --head`` use token authentication when a token exists on the head; a
   process then needs ``RAY_AUTH_MODE=token`` and the same token (``RAY_AUTH_TOKEN``, a
   file named by ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``). Ray turns token mode
   on by itself only for ``address="auto"``: it does not send a token to an address typed
   by hand unless ``RAY_AUTH_MODE=token`` says so, and neither does this module;
4. the other way round, a process in token mode joins only a cluster that uses token
   authentication: one without it accepts the driver, but every actor the driver starts
   then dies ("all references to the actor were removed").

Then it calls ``ray.init``; anything that still fails there is reported the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nemo_ckpt.errors import NemoCkptError

__all__ = [
    "ClusterConnectionError",
    "ray_address",
    "token_source",
    "connect",
]

AUTH_MODE_VAR = "RAY_AUTH_MODE"
TOKEN_VAR = "RAY_AUTH_TOKEN"
TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")
_TOKEN_PLACES = (f"{TOKEN_VAR}, a file named by {TOKEN_PATH_VAR}, or "
                 f"{DEFAULT_TOKEN_FILE}")
_PROBE_TIMEOUT_S = 5.0


class ClusterConnectionError(NemoCkptError):
    """Ray could not connect to the cluster at the address the user gave.

    The message is one line: the address as typed, what failed, what to do, and Ray's
    own cause in brackets.
    """

    def __init__(self, address: str, problem: str) -> None:
        self.address = address
        self.problem = problem
        super().__init__(f"cannot connect to a Ray cluster at {address!r}: {problem}")


# --- the address ----------------------------------------------------------------------


def ray_address(text: str) -> str:
    """An ``--address`` value: ``auto``, ``HOST:PORT`` or ``ray://HOST:PORT``.

    For argparse's ``type=``: raises ``argparse.ArgumentTypeError`` (a usage error) for
    anything else, before Ray is imported.
    """
    value = text.strip()
    if value == "auto":
        return value
    expected = ("expected HOST:PORT of the cluster's head (e.g. 10.0.0.10:6379), "
                "ray://HOST:PORT for Ray Client, or 'auto' for the cluster started by "
                "`ray start` on this node")
    if value == "local":
        raise argparse.ArgumentTypeError(
            f"'local' would start a new, empty Ray instance; {expected}")
    rest = value[len("ray://"):] if value.startswith("ray://") else value
    host, sep, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # an IPv6 literal
    if not sep or not host or re.search(r"[\s/]", host):
        raise argparse.ArgumentTypeError(f"{text!r} is not a cluster address; {expected}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no valid port (1-65535); {expected}")
    return value


# --- Ray's token authentication ---------------------------------------------------------


def _token_mode() -> bool:
    return os.environ.get(AUTH_MODE_VAR, "").strip().lower() == "token"


def token_source() -> str | None:
    """Where Ray reads this process's token from, in Ray's order, or None if nowhere.

    ``RAY_AUTH_TOKEN`` first, then the file ``RAY_AUTH_TOKEN_PATH`` names, then
    ``~/.ray/auth_token``. It reads no token, only whether one is there.
    """
    if os.environ.get(TOKEN_VAR, "").strip():
        return TOKEN_VAR
    named = os.environ.get(TOKEN_PATH_VAR)
    if named:
        path = Path(named).expanduser()
        return f"{TOKEN_PATH_VAR}={named}" if _has_text(path) else None
    default = DEFAULT_TOKEN_FILE.expanduser()
    return str(DEFAULT_TOKEN_FILE) if _has_text(default) else None


def _has_text(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except (OSError, UnicodeDecodeError):
        return False


def _auth_problem(cause: str) -> str:
    """What to do when the cluster refused this process's credentials."""
    source = token_source()
    if not _token_mode():
        mode = os.environ.get(AUTH_MODE_VAR) or "unset"
        found = (f"; a token is in {source}, but Ray sends it to an address given by hand "
                 f"only with {AUTH_MODE_VAR}=token") if source else ""
        return (f"the cluster uses Ray's token authentication and this process sends no "
                f"token ({AUTH_MODE_VAR} is {mode}{found}): export {AUTH_MODE_VAR}=token "
                f"and put the cluster's token in {_TOKEN_PLACES} [Ray: {cause}]")
    if source is None:
        return (f"{AUTH_MODE_VAR}=token but this process has no token: put the cluster's "
                f"token in {_TOKEN_PLACES} [Ray: {cause}]")
    return (f"the cluster refused the token from {source}: it is not the token the "
            f"cluster was started with (on the head: `ray get-auth-token`, or "
            f"{DEFAULT_TOKEN_FILE}) [Ray: {cause}]")


# --- errors as one line -----------------------------------------------------------------


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return line if len(line) <= limit else line[:limit - 3].rstrip() + "..."


def _root_cause(error: BaseException) -> str:
    """The innermost error's message: Ray wraps its real cause, sometimes as the text of
    a formatted traceback inside another error's message."""
    seen: set[int] = set()
    inner = error
    while id(inner) not in seen:
        seen.add(id(inner))
        nxt = inner.__cause__ or inner.__context__
        if nxt is None:
            break
        inner = nxt
    message = getattr(inner, "message", None)  # AuthenticationError: without Ray's help text
    text = message if isinstance(message, str) else str(inner)
    if "Traceback (most recent call last)" in text:
        # The last "SomeError: message" line of the embedded traceback is the cause.
        raised = [line for line in text.splitlines()
                  if re.match(r"^[\w.]+(Error|Exception): ", line)]
        if raised:
            text = raised[-1].split(": ", 1)[1]
    return _one_line(text or type(inner).__name__)


def _is_auth_failure(error: BaseException) -> bool:
    import ray.exceptions

    auth_error = getattr(ray.exceptions, "AuthenticationError", None)  # Ray >= 2.5x
    return (auth_error is not None and isinstance(error, auth_error)) \
        or "InvalidAuthToken" in str(error)


@contextlib.contextmanager
def _stderr_to_sink() -> Iterator[None]:
    """Keep Ray's C++ log lines (a warning per failed RPC) off this process's stderr;
    the failure is reported from the exception instead."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


# --- connect ------------------------------------------------------------------------------


def _resolve(address: str) -> str:
    from ray._private.services import canonicalize_bootstrap_address

    resolved = canonicalize_bootstrap_address(address)
    if resolved is None:  # only for 'local', which ray_address refuses
        raise ValueError("no cluster address")
    return resolved


def _preflight(address: str) -> None:
    """Fail in seconds, with one line, where ray.init would retry for ~20 s."""
    try:
        resolved = _resolve(address)
    except Exception as exc:
        raise ClusterConnectionError(address, _root_cause(exc)) from None
    # Ray connects to the resolved address (127.0.0.1 becomes the node's IP): say so.
    there = "" if resolved == address else f" (Ray resolves it to {resolved})"
    host, _, port = resolved.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ClusterConnectionError(
            address, f"nothing answers there{there}: {exc.strerror or exc}; check the "
                     f"head's address and that its GCS port is open from here") from None

    try:
        from ray._private.authentication import authentication_token_setup as ray_auth
    except ImportError:  # a Ray without token authentication: ray.init checks the rest
        return
    mode_given = os.environ.get(AUTH_MODE_VAR)
    if address == "auto":
        # What ray.init does for 'auto' only: use a token that exists on this node.
        ray_auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    if _token_mode() and token_source() is None:
        # Ray's C++ client aborts the process when token mode has no token: refuse first.
        raise ClusterConnectionError(address, _auth_problem(
            "Token authentication is enabled but no authentication token was found"))
    try:
        _probe_gcs(resolved)
    except Exception as exc:
        if _is_auth_failure(exc):
            raise ClusterConnectionError(address, _auth_problem(_root_cause(exc))) from None
        raise ClusterConnectionError(
            address, f"something answers there{there} but not as a Ray GCS "
                     f"[Ray: {_root_cause(exc)}]") from None
    if _token_mode():
        # A cluster without token authentication accepts a token, but its workers send
        # none back, and a driver in token mode then loses every actor it starts.
        with _auth_mode("disabled"):
            try:
                _probe_gcs(resolved)
            except Exception:
                return  # the cluster does require a token: token mode is right
        why = (f"this process has {AUTH_MODE_VAR}=token" if mode_given is not None else
               f"Ray turned token mode on for 'auto' (a token is in {token_source()})")
        raise ClusterConnectionError(
            address, f"{why} but the cluster does not use token authentication, so its "
                     f"workers could not call back into this driver: export "
                     f"{AUTH_MODE_VAR}=disabled for this cluster, or restart it with "
                     f"{AUTH_MODE_VAR}=token and a token on every node")


def _probe_gcs(resolved: str) -> None:
    """One connection to the GCS with this process's credentials; raises Ray's error."""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # not in its stubs

    with _stderr_to_sink():
        GcsClient(address=resolved)


@contextlib.contextmanager
def _auth_mode(mode: str) -> Iterator[None]:
    """This process under another RAY_AUTH_MODE, as Ray's own auth set-up switches it:
    the environment variable, then Ray's cached config and token."""
    from ray._raylet import (  # type: ignore[attr-defined]  # not in its stubs
        AuthenticationTokenLoader,
        Config,
    )

    saved = os.environ.get(AUTH_MODE_VAR)
    os.environ[AUTH_MODE_VAR] = mode
    try:
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
        yield
    finally:
        if saved is None:
            os.environ.pop(AUTH_MODE_VAR, None)
        else:
            os.environ[AUTH_MODE_VAR] = saved
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def connect(address: str, **init_kwargs: Any) -> None:
    """``ray.init(address=address, **init_kwargs)``, failing in seconds and in one line.

    Raises ``ClusterConnectionError``, whose one-line message names the address as the
    caller typed it, what went wrong and what to do, and Ray's own cause in brackets.
    """
    import ray

    if not address.startswith("ray://"):  # Ray Client has its own handshake and errors
        _preflight(address)
    try:
        ray.init(address=address, **init_kwargs)
    except Exception as exc:
        if _is_auth_failure(exc):
            raise ClusterConnectionError(address, _auth_problem(_root_cause(exc))) from None
        raise ClusterConnectionError(address, f"ray.init failed [Ray: {_root_cause(exc)}]") \
            from None
