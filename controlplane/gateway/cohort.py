"""Which cohort a request belongs to. Pure: no Django, no I/O.

A request's sticky key (its conversation, else its user, else its API key)
is hashed with the routing table's salt into a bucket in [0, 10000): one
bucket per basis point. The table's weights lay the buckets out in a fixed
order, canary first, then baseline, then stable:

    0 ........ canary ........ | .... baseline .... | ...... stable ...... 10000

so raising the canary's weight only takes buckets from the ranges after it:
a key that was on the canary stays there, and a conversation keeps one
profile for as long as the canary grows. (Lowering it, as an abort does,
moves canary keys back; that is the point of an abort.) The salt makes the
layout independent between tables; changing it reshuffles every key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from controlplane.fleet.pools import PoolRole

NUM_BUCKETS = 10_000  # one per basis point


def bucket_of(salt: str, sticky_key: str) -> int:
    """sha256(salt + key) read as a number, modulo 10000. Stable across
    processes, hosts and Python versions (unlike ``hash()``). A lone
    surrogate (valid in a JSON ``user``, with no UTF-8 form) is hashed as
    its code point rather than failing the request."""
    digest = hashlib.sha256((salt + sticky_key).encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % NUM_BUCKETS


@dataclass(frozen=True)
class Slot:
    """Buckets [start, end) go to ``member`` (an opaque key, e.g. a pool id)."""

    start: int
    end: int
    role: PoolRole
    member: int


@dataclass(frozen=True)
class Layout:
    slots: tuple[Slot, ...]

    @classmethod
    def build(cls, weights: Iterable[tuple[PoolRole, int, int]]) -> Layout:
        """``weights``: (role, member, weight_bp) for each pool of a table.

        Members are laid out by role order, then by member, so every gateway
        that sees the same table builds the same layout. Zero weights take no
        buckets. Weights that do not sum to 10000 (the model validates them)
        leave the tail unassigned rather than guessing."""
        slots = []
        start = 0
        for role, member, weight_bp in sorted(weights, key=lambda w: (PoolRole(w[0]).order, w[1])):
            if weight_bp <= 0:
                continue
            end = min(start + weight_bp, NUM_BUCKETS)
            slots.append(Slot(start, end, PoolRole(role), member))
            start = end
        return cls(tuple(slots))

    def slot_for(self, bucket: int) -> Slot | None:
        # At most three slots: a scan beats bisect's call overhead.
        for slot in self.slots:
            if bucket < slot.end:
                return slot if bucket >= slot.start else None
        return None


def sticky_key(session: str | None, user: object, api_key_id: int | None) -> str | None:
    """The conversation (``x-chunkpilot-session``), else the body's ``user``,
    else the API key; None when the request carries none of them (the caller
    then draws a random key, so such requests spread by weight)."""
    if session:
        return session
    if isinstance(user, str) and user:
        return user
    if api_key_id is not None:
        return f"api-key:{api_key_id}"
    return None


def share_of(layout: Layout, role: PoolRole) -> int:
    """Basis points the layout gives ``role`` (for tests and the UI)."""
    return sum(slot.end - slot.start for slot in layout.slots if slot.role == role)
