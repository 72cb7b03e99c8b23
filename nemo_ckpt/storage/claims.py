"""Claims of operations in progress, judged on the reader's own clock.

A claim is a small file an operation writes, and rewrites to renew, in a folder others
share: a checkpoint folder (``nemo_ckpt.storage.path_claims``: two jobs must not write
one path) or the blob store's root (``nemo_ckpt.trees.blob_claims``: snapshots' holds
and a collection's claim).
Its reader may run on another host, whose wall clock has any offset from the writer's,
so a claim carries no time to compare: it carries its owner, its ttl (a duration) and a
*beat*, a nonce drawn at every write. A reader keeps what it has seen (``ClaimWatch``)
and takes a claim as abandoned only once it has seen the same beat for longer than
``STALE_FACTOR`` x its ttl on its own monotonic clock. A claim seen for the first time
is live: a reader that must decide at once cannot tell a dead claim from a live one.

What remains assumed of clocks: their rates agree within ``RATE_TOLERANCE``; their
offsets may be anything. A writer renews well within its ttl and stops relying on its
claim once the ttl has passed on its own clock since its last write.

Claims written by nemo-ckpt before this scheme hold an ``expires_at`` (the writer's
wall clock) and no ttl or beat: they are read with ``LEGACY_TTL_S`` and their content
as the beat (each renewal changed the expiry), never by comparing that time. New claims
still write an ``expires_at``, for older readers only; nothing here reads it.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import xxhash

from nemo_ckpt.errors import NemoCkptError
from nemo_ckpt.storage.folder import ABSENT, Folder, remove_if_holds, write_conditionally
from nemo_ckpt.storage.stored_json import load_stored_json

__all__ = ["Claim", "ClaimWatch", "encode_claim", "decode_claim", "write_claim",
           "LEGACY_TTL_S", "MAX_CLAIM_BYTES", "RATE_TOLERANCE", "STALE_FACTOR"]

# Clock rates of the hosts that share a checkpoint root differ by at most this much.
RATE_TOLERANCE = 0.1
# A writer's ttl, on its clock, is at most 1 / (1 - RATE_TOLERANCE) of it on a reader's;
# the rest is room for the reads' own latency.
STALE_FACTOR = 1.2
# The ttl of a claim an older nemo-ckpt wrote (two leases of the default lease_s).
LEGACY_TTL_S = 60.0
# The most a claim is read as: one we write is a few hundred bytes.
MAX_CLAIM_BYTES = 64 << 10
# Folders a watch remembers, the least recently read forgotten first: a folder forgotten
# only makes its claims look new again, live, so this bounds memory, not safety.
_MAX_FOLDERS = 1024


@dataclass(frozen=True)
class Claim:
    """An operation in progress: who runs it, how long (seconds, on the writer's clock)
    it holds unless rewritten, and the beat of its latest write."""

    operation: str
    owner: str
    ttl_s: float
    beat: str
    # Which incarnation of the owner's coordinator wrote it ("" when unknown): one that
    # Ray declared dead may run again, and must not take a successor's claims for its
    # own leftovers.
    incarnation: str = ""
    # The version of the manifest in the claimed folder when the operation first claimed
    # it (``ABSENT``: none): its commit replaces only that one. None: not recorded.
    base: str | None = None


def encode_claim(operation: str, owner: str, ttl_s: float, incarnation: str = "",
                 beat: str | None = None, base: str | None = None) -> tuple[bytes, str]:
    """A new write of the claim, and its beat (``beat``, or a fresh one)."""
    beat = beat or uuid.uuid4().hex
    # expires_at: only for readers of nemo-ckpt before the beat (see the module docstring).
    fields = {"operation": operation, "owner": owner, "ttl_s": ttl_s, "beat": beat,
              "incarnation": incarnation, "expires_at": time.time() + ttl_s}
    if base is not None:
        fields["base"] = base
    return json.dumps(fields).encode(), beat


def write_claim(folder: Folder, name: str, data: bytes, expect: str = ABSENT) -> None:
    """Write the claim ``data`` (from ``encode_claim``: its beat makes it this write's
    own) as ``name``, only if ``expect`` holds (``ABSENT``: create it; else the version
    it replaces). ``FileExistsError`` when another writer's claim is there, never for
    this write's own bytes (``write_conditionally``: a retry that met its own landed
    write). A create that fails otherwise may have landed before its error: the claim is
    removed again, since the caller gives up on it, and a claim no operation runs under
    refuses or holds up the others until it is seen abandoned. (A renewal that fails
    leaves the claim its operation holds: it ends with the operation.)"""
    try:
        write_conditionally(folder, name, data, expect, sync=False)
    except FileExistsError:
        raise
    except BaseException:
        if expect == ABSENT:
            with contextlib.suppress(OSError, NemoCkptError):
                remove_if_holds(folder, name, (data,))
        raise


def decode_claim(data: bytes) -> Claim:
    """The claim in ``data``; ``ValueError`` (or ``KeyError``, ``TypeError``) when it is
    not one (a half-written or foreign file: ``StoredJsonError`` for one too large or
    nested too deeply)."""
    fields = load_stored_json(data, "a claim", MAX_CLAIM_BYTES)
    if "beat" not in fields:  # an older nemo-ckpt's
        return Claim(str(fields["operation"]), str(fields["owner"]), LEGACY_TTL_S,
                     xxhash.xxh3_64_hexdigest(data))
    ttl_s = float(fields["ttl_s"])
    if not 0 <= ttl_s < math.inf:
        raise ValueError(f"a claim's ttl of {ttl_s!r}")
    base = fields.get("base")
    return Claim(str(fields["operation"]), str(fields["owner"]), ttl_s, str(fields["beat"]),
                 str(fields.get("incarnation", "")), None if base is None else str(base))


class ClaimWatch:
    """What one reader has seen of claims, timed on its own ``clock`` (a monotonic
    clock; a fake one in tests and the simulation). Keep one for as long as the reader
    lives: a claim can be found abandoned only by a watch that has seen it before.
    Safe to share between threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        # folder -> operation -> ((owner, beat), when first seen with that beat)
        self._seen: dict[str, dict[str, tuple[tuple[str, str], float]]] = {}

    def observe(self, where: str, claims: Iterable[Claim]) -> dict[str, float]:
        """Record ``claims``, all the claims read from ``where`` now, and return how
        long, in seconds on this clock, each one's operation has left before it is taken
        as abandoned (0 or less: abandoned). Claims no longer there are forgotten."""
        now = self.clock()
        left: dict[str, float] = {}
        with self._lock:
            before = self._seen.pop(where, {})
            seen: dict[str, tuple[tuple[str, str], float]] = {}
            for claim in claims:
                stamp = (claim.owner, claim.beat)
                prior = before.get(claim.operation)
                since = prior[1] if prior is not None and prior[0] == stamp else now
                seen[claim.operation] = (stamp, since)
                left[claim.operation] = since + STALE_FACTOR * claim.ttl_s - now
            if seen:
                self._seen[where] = seen
                if len(self._seen) > _MAX_FOLDERS:
                    del self._seen[next(iter(self._seen))]
        return left

    def live(self, where: str, claims: Iterable[Claim]) -> list[Claim]:
        """Of ``claims`` (all those read from ``where`` now), the ones not abandoned."""
        claims = list(claims)
        left = self.observe(where, claims)
        return [c for c in claims if left[c.operation] > 0]
