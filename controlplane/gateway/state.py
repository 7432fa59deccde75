"""What a gateway knows: an immutable snapshot of the routing tables, the
workers each pool may use and the client keys. Pure: no Django.

The refresher builds a new ``GatewayState`` off the request path and swaps it
in with one assignment; a request reads ``holder.current`` once and uses that
snapshot throughout, so it never sees half of an update.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from controlplane.gateway.cohort import Layout, Role


def hash_key(plaintext: str) -> str:
    """Client keys are long random strings: a plain SHA-256 is enough, and
    the gateway compares hashes without ever holding the keys."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


@dataclass(frozen=True)
class WorkerTarget:
    id: int
    name: str
    url: str  # base URL, no trailing slash
    pool_id: int
    revision_id: int | None  # what it runs, for the request log


@dataclass(frozen=True)
class PoolTarget:
    id: int
    name: str
    role: Role
    weight_bp: int
    workers: tuple[WorkerTarget, ...]  # routable ones only: ready, not cordoned, not draining


@dataclass(frozen=True)
class TableTarget:
    id: int
    model: str
    salt: str
    epoch: int
    pools: dict[int, PoolTarget]
    layout: Layout

    def pool_for_role(self, role: Role) -> PoolTarget | None:
        for pool in self.pools.values():
            if pool.role == role:
                return pool
        return None


@dataclass(frozen=True)
class ClientKeyInfo:
    id: int
    is_admin: bool


@dataclass(frozen=True)
class GatewayState:
    tables: dict[str, TableTarget] = field(default_factory=dict)  # by model
    keys: dict[str, ClientKeyInfo] = field(default_factory=dict)  # by key hash
    loaded_at: float = 0.0  # time.monotonic() of the load; 0: never loaded

    def epochs(self) -> dict[str, int]:
        """What a gateway acks: the epoch of each table it applied, by table id."""
        return {str(table.id): table.epoch for table in self.tables.values()}


class StateHolder:
    """The one mutable cell: the refresher writes it, requests read it."""

    def __init__(self, state: GatewayState | None = None):
        self.current = state or GatewayState()

    def swap(self, state: GatewayState) -> None:
        self.current = state

    @property
    def age_seconds(self) -> float | None:
        loaded = self.current.loaded_at
        return None if not loaded else time.monotonic() - loaded


def build_table(
    *, id: int, model: str, salt: str, epoch: int, pools: list[PoolTarget]
) -> TableTarget:
    return TableTarget(
        id=id,
        model=model,
        salt=salt,
        epoch=epoch,
        pools={pool.id: pool for pool in pools},
        layout=Layout.build((pool.role, pool.id, pool.weight_bp) for pool in pools),
    )
