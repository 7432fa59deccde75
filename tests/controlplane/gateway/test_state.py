"""Applying routing notices to a gateway's snapshot. Pure."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.fleet.pools import PoolRole
from controlplane.gateway.state import (
    GatewayState,
    PoolTarget,
    WorkerTarget,
    build_table,
    newest,
    with_table_update,
)


def pool(pid: int, role: PoolRole, weight: int, *worker_ids: int) -> PoolTarget:
    return PoolTarget(
        pid, f"p{pid}", role, weight, tuple(WorkerTarget(w, f"w{w}", f"http://w{w}", pid, None) for w in worker_ids)
    )


def state(epoch: int = 3, canary: int = 0, workers: tuple[int, ...] = (1,)) -> GatewayState:
    table = build_table(
        id=7,
        model="tiny",
        salt="s",
        epoch=epoch,
        pools=[pool(1, PoolRole.STABLE, 10000 - canary, *workers), pool(2, PoolRole.CANARY, canary, 2)],
    )
    return GatewayState(tables={"tiny": table}, loaded_at=1.0)


def notice(epoch: int = 4, canary: int = 2000, **over: Any) -> dict[str, Any]:
    base = {
        "kind": "routing",
        "table": 7,
        "model": "tiny",
        "epoch": epoch,
        "salt": "s",
        "pools": [
            {"pool": 1, "role": "stable", "weight_bp": 10000 - canary},
            {"pool": 2, "role": "canary", "weight_bp": canary},
        ],
    }
    return {**base, **over}


def test_a_weight_notice_is_applied_with_the_workers_kept_and_acked_epoch_moved() -> None:
    updated = with_table_update(state(), notice())
    assert updated is not None
    table = updated.tables["tiny"]
    assert (table.epoch, table.pools[2].weight_bp, table.pools[1].workers) == (
        4,
        2000,
        state().tables["tiny"].pools[1].workers,
    )
    assert [(s.role, s.start, s.end) for s in table.layout.slots] == [
        (PoolRole.CANARY, 0, 2000),
        (PoolRole.STABLE, 2000, 10000),
    ]
    assert updated.epochs() == {"7": 4}


@pytest.mark.parametrize(
    "bad",
    [
        notice(epoch=3),
        notice(epoch=2),
        notice(table=8),
        notice(model="other"),
        notice(pools=[{"pool": 9, "role": "stable", "weight_bp": 10000}]),
        notice(pools=[{"pool": 1, "role": "leader", "weight_bp": 10000}]),
        {"kind": "routing", "table": 7},
        notice(epoch="x"),
    ],
)
def test_notices_that_cannot_stand_alone_wait_for_the_reload(bad: dict[str, Any]) -> None:
    assert with_table_update(state(), bad) is None


def test_a_snapshot_read_before_a_change_does_not_undo_it() -> None:
    applied = with_table_update(state(), notice(epoch=4, canary=2000))
    stale_read = state(epoch=3, canary=0, workers=(1, 5))  # older weights, newer worker list
    merged = newest(stale_read, applied)
    table = merged.tables["tiny"]
    assert (table.epoch, table.pools[2].weight_bp) == (4, 2000)
    assert [w.id for w in table.pools[1].workers] == [1, 5]


def test_a_newer_snapshot_wins_and_a_deleted_table_goes() -> None:
    assert newest(state(epoch=5, canary=500), state(epoch=4)).tables["tiny"].epoch == 5
    assert newest(GatewayState(loaded_at=2.0), state()).tables == {}


def test_a_tables_context_length_is_the_shortest_any_of_its_workers_reported() -> None:
    def worker(wid: int, pid: int, max_model_len: int) -> WorkerTarget:
        return WorkerTarget(wid, f"w{wid}", f"http://w{wid}", pid, None, max_model_len)

    stable = PoolTarget(1, "p1", PoolRole.STABLE, 9000, (worker(1, 1, 8192), worker(2, 1, 0)))
    canary = PoolTarget(2, "p2", PoolRole.CANARY, 1000, (worker(3, 2, 4096),))
    assert build_table(id=1, model="m", salt="s", epoch=1, pools=[stable, canary]).max_model_len == 4096
    assert build_table(id=1, model="m", salt="s", epoch=1, pools=[stable]).max_model_len == 8192
    unknown = PoolTarget(1, "p1", PoolRole.STABLE, 10000, (worker(2, 1, 0),))
    assert build_table(id=1, model="m", salt="s", epoch=1, pools=[unknown]).max_model_len is None


def test_an_output_cap_rides_on_the_notice_and_survives_a_stale_read() -> None:
    capped = with_table_update(state(), notice(epoch=4, canary=0, max_output_tokens=256))
    assert capped is not None and capped.tables["tiny"].max_output_tokens == 256
    # A notice that does not mention the cap leaves it; one that says null lifts it.
    kept = with_table_update(capped, notice(epoch=5, canary=1000))
    assert kept is not None and kept.tables["tiny"].max_output_tokens == 256
    lifted = with_table_update(kept, notice(epoch=6, max_output_tokens=None))
    assert lifted is not None and lifted.tables["tiny"].max_output_tokens is None
    # A read that began before the cap was set does not undo it.
    assert newest(state(epoch=3), capped).tables["tiny"].max_output_tokens == 256
    assert with_table_update(state(), notice(max_output_tokens="lots")) is None
