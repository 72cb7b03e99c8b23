"""Calls across processes, each declared once: as a method of a Protocol.

A side's calls are the async methods of its Protocols (``nemo_ckpt.protocol.holder_api``,
``nemo_ckpt.protocol.coordinator_api``); everything else is made from them:

- ``call(Protocol.method, *args)``: one call as data (``Call``), for a fan-out or a relay
  to make on many actors; mypy checks the arguments against the method (``ParamSpec``);
- ``Proxy``: the caller's side, an object with the Protocol's methods whose every call
  goes out through the caller's ``invoke`` (or ``send``, for a method marked
  ``one_way``: its sender never waits for it);
- ``serves``: the callee's side, a class decorator that gives the class one method per
  Protocol method, each handing the call to the part that implements it; it checks, as
  the class is made, that every part's method takes what the Protocol's does.

Only the arguments that differ from the method's defaults travel (trailing defaults are
left off), so a call that does not use an option reads the same on the wire as before
the option existed (``nemo_ckpt.tracing``: ``trace``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

__all__ = ["Call", "Proxy", "call", "methods", "one_way", "serves", "wire_args"]

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=type)

_ONE_WAY = "__nemo_ckpt_one_way__"


def one_way(method: Callable[P, Coroutine[Any, Any, None]]
            ) -> Callable[P, Coroutine[Any, Any, None]]:
    """Mark a Protocol method as a message: a proxy sends it and does not wait."""
    setattr(method, _ONE_WAY, True)
    return method


@dataclass(frozen=True)
class Call(Generic[R]):
    """One call as data: the method's name, its arguments as they travel, whether it is a
    message, and the timeout a fan-out gives it (None: the caller's default)."""

    method: str
    args: tuple[Any, ...]
    one_way: bool = False
    timeout: float | None = None

    def within(self, timeout: float | None) -> Call[R]:
        """This call with its own timeout."""
        return Call(self.method, self.args, self.one_way, timeout)


def call(method: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]],
         *args: P.args, **kwargs: P.kwargs) -> Call[R]:
    """``method`` (a Protocol's, unbound) called with these arguments, as data."""
    return Call(method.__name__, wire_args(method, args, kwargs),
                bool(getattr(method, _ONE_WAY, False)))


@functools.cache
def _parameters(method: Callable[..., Any]) -> tuple[inspect.Parameter, ...]:
    return tuple(inspect.signature(method).parameters.values())[1:]  # without self


@functools.cache
def _shape(method: Callable[..., Any]) -> tuple[tuple[str, ...], tuple[Any, ...], int]:
    """``method``'s parameter names, their defaults (``_EMPTY`` for none), and how many
    have none: worked out once per method, as every call travels through here."""
    params = _parameters(method)
    return (tuple(p.name for p in params),
            tuple(_EMPTY if p.default is inspect.Parameter.empty else p.default
                  for p in params),
            sum(1 for p in params if p.default is inspect.Parameter.empty))


_EMPTY = object()


def wire_args(method: Callable[..., Any], args: tuple[Any, ...],
              kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """``args`` and ``kwargs`` of ``method`` as positional arguments, without the
    trailing ones equal to their defaults; a wrong name or count is a ``TypeError`` here,
    at the caller, not in another process."""
    names, defaults, required = _shape(method)
    if len(args) > len(names):
        raise TypeError(f"{method.__name__}() takes {len(names)} arguments, "
                        f"{len(args)} given")
    values = list(args)
    for index in range(len(args), len(names)):
        if names[index] in kwargs:
            values.append(kwargs[names[index]])
        elif defaults[index] is _EMPTY:
            raise TypeError(f"{method.__name__}() is missing its argument "
                            f"{names[index]!r}")
        else:
            values.append(defaults[index])
    if kwargs:
        unknown = set(kwargs) - set(names[len(args):])
        if unknown:
            raise TypeError(f"{method.__name__}() got unexpected or repeated arguments "
                            f"{sorted(unknown)}")
    while len(values) > required and _is_default(values[-1], defaults[len(values) - 1]):
        values.pop()
    return tuple(values)


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def methods(*protocols: type) -> dict[str, Callable[..., Any]]:
    """The calls the Protocols declare, by name (their own and inherited ones)."""
    return dict(_methods(protocols))


@functools.cache
def _methods(protocols: tuple[type, ...]) -> dict[str, Callable[..., Any]]:
    found: dict[str, Callable[..., Any]] = {}
    for protocol in protocols:
        for klass in reversed(protocol.__mro__):
            if klass is object or not getattr(klass, "_is_protocol", False):
                continue
            for name, member in vars(klass).items():
                if not name.startswith("_") and inspect.iscoroutinefunction(member):
                    found[name] = member
    return found


class _Sent:
    """What a proxy's message returns: awaiting it costs nothing (it is already sent)."""

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # pragma: no cover - makes this a generator


class Proxy:
    """An object with ``protocols``' methods; each call becomes a ``Call`` handed to
    ``invoke`` (its awaitable is the call's answer) or, for a ``one_way`` method, to
    ``send``. Typed by its maker as the Protocol (``cast``), so mypy checks its callers."""

    def __init__(self, protocols: tuple[type, ...],
                 invoke: Callable[[Call[Any]], Awaitable[Any]],
                 send: Callable[[Call[Any]], None] | None = None) -> None:
        self._methods = _methods(protocols)  # shared: never changed
        self._invoke = invoke
        self._send = send

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        declared = self.__dict__.get("_methods", {}).get(name)
        if declared is None:
            raise AttributeError(f"{name!r} is not a call of this interface")
        is_message = bool(getattr(declared, _ONE_WAY, False))
        invoke, send = self._invoke, self._send

        def make(*args: Any, **kwargs: Any) -> Awaitable[Any]:
            made: Call[Any] = Call(name, wire_args(declared, args, kwargs), is_message)
            if not is_message:
                return invoke(made)
            if send is None:
                raise TypeError(f"{name} is a message, and this proxy was made without a "
                                f"way to send one")
            send(made)
            return _Sent()

        make.__name__ = name
        setattr(self, name, make)  # made once: the next call finds it without this
        return make


def serves(routes: Mapping[type, tuple[str, type] | None]) -> Callable[[C], C]:
    """A class decorator: for each Protocol of ``routes``, give the class each of its
    methods, which hands the call to the part ``(attribute, its class)`` named (None: the
    class implements that Protocol itself). As the class is made, every Protocol method
    must exist where it is routed, async, with the same parameters; a mismatch is a
    ``TypeError`` naming it, so a Protocol and its implementation cannot drift apart."""

    def decorate(cls: C) -> C:
        for protocol, part in routes.items():
            for name, declared in methods(protocol).items():
                if part is None:
                    _check(declared, getattr(cls, name, None), f"{cls.__name__}.{name}")
                    continue
                attribute, part_class = part
                _check(declared, getattr(part_class, name, None),
                       f"{part_class.__name__}.{name} ({protocol.__name__})")
                setattr(cls, name, _route(attribute, name, declared))
        return cls

    return decorate


def _route(attribute: str, name: str, declared: Callable[..., Any]) -> Callable[..., Any]:
    async def routed(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await getattr(getattr(self, attribute), name)(*args, **kwargs)

    routed.__name__ = routed.__qualname__ = name
    routed.__doc__ = declared.__doc__
    return routed


def _check(declared: Callable[..., Any], implemented: Any, where: str) -> None:
    if implemented is None or not inspect.iscoroutinefunction(implemented):
        raise TypeError(f"{where} is declared but not implemented as an async method")
    want = [(p.name, p.kind, p.default) for p in _parameters(declared)]
    have = [(p.name, p.kind, p.default) for p in _parameters(implemented)]
    if want != have:
        raise TypeError(f"{where} takes {have}, its Protocol declares {want}")
