"""What a gateway knows: an immutable snapshot of the routing tables, the
workers each pool may use and the client keys. Pure: no Django.

The refresher builds a new ``GatewayState`` off the request path and swaps it
in with one assignment; a request reads ``holder.current`` once and uses that
snapshot throughout, so it never sees half of an update.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from controlplane.fleet.pools import PoolRole
from controlplane.gateway.cohort import Layout


@dataclass(frozen=True)
class WorkerTarget:
    id: int
    name: str
    url: str  # base URL, no trailing slash
    pool_id: int
    revision_id: int | None  # what it runs, for the request log
    max_model_len: int = 0  # as the worker reported it; 0: unknown


@dataclass(frozen=True)
class PoolTarget:
    id: int
    name: str
    role: PoolRole
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
    max_output_tokens: int | None = None  # the route's cap on a request's output; None: none

    @property
    def max_model_len(self) -> int | None:
        """The longest context every routable worker takes (a request may land
        on any of them); None when no worker has reported one."""
        lengths = [w.max_model_len for pool in self.pools.values() for w in pool.workers if w.max_model_len]
        return min(lengths) if lengths else None

    def pool_for_role(self, role: PoolRole) -> PoolTarget | None:
        for pool in self.pools.values():
            if pool.role == role:
                return pool
        return None


@dataclass(frozen=True)
class ClientKeyInfo:
    id: int
    is_admin: bool
    max_output_tokens: int | None = None  # the key's cap on a request's output; None: none


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
    *, id: int, model: str, salt: str, epoch: int, pools: list[PoolTarget], max_output_tokens: int | None = None
) -> TableTarget:
    return TableTarget(
        id=id,
        model=model,
        salt=salt,
        epoch=epoch,
        pools={pool.id: pool for pool in pools},
        layout=Layout.build((pool.role, pool.id, pool.weight_bp) for pool in pools),
        max_output_tokens=max_output_tokens,
    )


def with_table_update(state: GatewayState, notice: Mapping[str, Any]) -> GatewayState | None:
    """``state`` with one table's new layout taken from a routing notice, or
    None when the notice cannot be applied on its own (a table or a pool this
    state does not know, an epoch that is not newer, a malformed notice): the
    caller then waits for the reload it does anyway. A weight change reaches
    the request path this way without a database round trip, which is what
    bounds an abort's time to every gateway's ack."""
    try:
        table_id, epoch = int(notice["table"]), int(notice["epoch"])
        model, salt = str(notice["model"]), str(notice["salt"])
        lines = [(int(p["pool"]), PoolRole(p["role"]), int(p["weight_bp"])) for p in notice["pools"]]
        current = state.tables.get(model)
        if current is None or current.id != table_id or epoch <= current.epoch:
            return None
        cap = notice.get("max_output_tokens", current.max_output_tokens)  # a notice without it changes nothing
        max_output_tokens = None if cap is None else int(cap)
    except (KeyError, TypeError, ValueError):
        return None
    known = {pool.id: pool for table in state.tables.values() for pool in table.pools.values()}
    if any(pool_id not in known for pool_id, _, _ in lines):
        return None
    pools = [replace(known[pool_id], role=role, weight_bp=weight_bp) for pool_id, role, weight_bp in lines]
    table = build_table(
        id=table_id, model=model, salt=salt, epoch=epoch, pools=pools, max_output_tokens=max_output_tokens
    )
    tables = {**state.tables, model: table}
    return replace(state, tables=tables)


def newest(loaded: GatewayState, current: GatewayState) -> GatewayState:
    """The snapshot just read from the database, except that a table the
    current state holds at a later epoch keeps that epoch's layout (with the
    fresh worker lists): a read that began before a change committed must not
    undo the change its notice already applied, nor the ack already given."""
    held_by_id = {table.id: table for table in current.tables.values()}
    fresh_pools = {pool.id: pool for table in loaded.tables.values() for pool in table.pools.values()}
    tables: dict[str, TableTarget] = {}
    for model, table in loaded.tables.items():
        held = held_by_id.get(table.id)
        if held is not None and held.epoch > table.epoch:
            pools = [
                replace(pool, workers=fresh_pools[pool.id].workers) if pool.id in fresh_pools else pool
                for pool in held.pools.values()
            ]
            table = build_table(
                id=held.id,
                model=held.model,
                salt=held.salt,
                epoch=held.epoch,
                pools=pools,
                max_output_tokens=held.max_output_tokens,
            )
        tables[model] = table
    return replace(loaded, tables=tables)
