"""A pool's part in a routing table. Pure: no Django.

The gateway lays a table's buckets out in this order (``gateway.cohort``),
and a request's cohort is the role of the pool that served it, so metrics,
alerts and rollouts name cohorts with these values too.
"""

from __future__ import annotations

from enum import StrEnum


class PoolRole(StrEnum):
    """In layout order: canary first, then baseline, then stable."""

    CANARY = "canary"
    BASELINE = "baseline"
    STABLE = "stable"

    @property
    def order(self) -> int:
        return _ROLE_ORDER[self]


_ROLE_ORDER = {PoolRole.CANARY: 0, PoolRole.BASELINE: 1, PoolRole.STABLE: 2}
ROLES: tuple[str, ...] = tuple(role.value for role in PoolRole)
