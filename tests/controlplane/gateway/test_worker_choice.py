"""Which worker of a pool a gateway sends a request to (``Gateway.pick_worker``).
Pure: a gateway over a snapshot, its clock moved by hand."""

from __future__ import annotations

from collections import Counter

from controlplane.fleet.pools import PoolRole
from controlplane.gateway.proxy import Gateway, ProxySettings
from controlplane.gateway.state import PoolTarget, StateHolder, WorkerTarget


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def pool_of(*worker_ids: int) -> PoolTarget:
    workers = tuple(WorkerTarget(w, f"w{w}", f"http://w{w}", 1, None) for w in worker_ids)
    return PoolTarget(1, "p1", PoolRole.STABLE, 10000, workers)


def gateway(clock: Clock | None = None) -> Gateway:
    return Gateway(
        StateHolder(), record=lambda rec: None, settings=ProxySettings(eject_seconds=10), clock=clock or Clock()
    )


def picks(gw: Gateway, pool: PoolTarget, n: int, tried: set[int] | None = None) -> list[int | None]:
    chosen = [gw.pick_worker(pool, tried or set()) for _ in range(n)]
    return [w.id if w is not None else None for w in chosen]


def test_the_worker_with_fewest_requests_in_flight_from_this_gateway_wins() -> None:
    gw, pool = gateway(), pool_of(1, 2, 3)
    gw.outstanding.update({1: 2, 2: 0, 3: 1})
    assert picks(gw, pool, 6) == [2] * 6
    gw.outstanding[2] = 5
    assert picks(gw, pool, 6) == [3] * 6


def test_ties_rotate_so_equal_workers_share_the_requests() -> None:
    gw, pool = gateway(), pool_of(1, 2, 3)
    assert Counter(picks(gw, pool, 30)) == {1: 10, 2: 10, 3: 10}
    # The turn passes among the tied ones only: a busier worker is left out.
    gw.outstanding[2] = 1
    assert set(picks(gw, pool, 30)) == {1, 3}


def test_an_ejected_worker_is_chosen_only_when_nothing_else_is_left() -> None:
    clock = Clock()
    gw, pool = gateway(clock), pool_of(1, 2)
    gw.ejected_until[1] = clock.now + 10
    gw.outstanding[2] = 50  # however busy the other one is
    assert picks(gw, pool, 4) == [2] * 4
    # Every worker ejected: the least busy of them, rather than no worker at all.
    gw.ejected_until[2] = clock.now + 10
    assert picks(gw, pool, 4) == [1] * 4
    # The other one tried already: the ejected one is the last resort.
    assert picks(gw, pool, 2, tried={2}) == [1, 1]
    # Past its ejection it counts like any worker again.
    gw.ejected_until[1] = clock.now + 10
    gw.ejected_until.pop(2)
    gw.outstanding[2] = 0
    clock.now += 11
    gw.outstanding[1] = 0
    assert Counter(picks(gw, pool, 4)) == {1: 2, 2: 2}


def test_workers_already_tried_for_this_request_are_skipped() -> None:
    gw, pool = gateway(), pool_of(1, 2, 3)
    gw.outstanding.update({1: 0, 2: 3, 3: 3})
    assert set(picks(gw, pool, 9, tried={1})) == {2, 3}  # the least busy one was tried: the others share
    assert picks(gw, pool, 3, tried={1, 3}) == [2, 2, 2]
    assert picks(gw, pool, 1, tried={1, 2, 3}) == [None]
    assert picks(gw, pool_of(), 1) == [None]  # a pool with no routable worker
