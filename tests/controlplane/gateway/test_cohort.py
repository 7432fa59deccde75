"""The bucketing hash and the layout: pure, so tables of cases and every bucket."""

from __future__ import annotations

import uuid

import pytest

from controlplane.fleet.pools import PoolRole
from controlplane.gateway.cohort import NUM_BUCKETS, Layout, bucket_of, share_of, sticky_key

CANARY, BASELINE, STABLE = 1, 2, 3  # pool ids


def layout(canary: int, stable: int, baseline: int = 0) -> Layout:
    return Layout.build(
        [(PoolRole.STABLE, STABLE, stable), (PoolRole.CANARY, CANARY, canary), (PoolRole.BASELINE, BASELINE, baseline)]
    )


def role_of(lay: Layout, bucket: int) -> PoolRole | None:
    slot = lay.slot_for(bucket)
    return slot.role if slot else None


def test_split_accuracy_twenty_percent_of_5000_keys_land_on_the_canary() -> None:
    lay = layout(canary=2000, stable=8000)
    salt = "a1b2c3d4e5f60718"
    keys = [f"user-{i}" for i in range(5000)]
    on_canary = sum(role_of(lay, bucket_of(salt, key)) == PoolRole.CANARY for key in keys)
    assert 0.18 <= on_canary / 5000 <= 0.22, on_canary


@pytest.mark.parametrize("salt", ["s1", "another-salt", uuid.UUID(int=7).hex])
def test_split_accuracy_holds_for_random_keys_and_any_salt(salt: str) -> None:
    lay = layout(canary=2000, stable=8000)
    keys = [uuid.UUID(int=i * 7919 + 13).hex for i in range(5000)]
    share = sum(role_of(lay, bucket_of(salt, k)) == PoolRole.CANARY for k in keys) / 5000
    assert abs(share - 0.20) <= 0.02


def test_the_bucket_is_a_pure_function_of_salt_and_key() -> None:
    # Pinned values (the first 8 bytes of sha256(salt + key), modulo 10000): any
    # gateway, host, restart or Python computes these, so a key keeps its cohort.
    assert bucket_of("salt", "conversation-42") == 9453
    assert bucket_of("other-salt", "conversation-42") == 9688
    assert [bucket_of("s", str(i)) for i in range(3)] == [1579, 6695, 9434]
    assert all(0 <= bucket_of("x", str(i)) < NUM_BUCKETS for i in range(1000))


def test_a_user_holding_a_lone_surrogate_still_gets_a_stable_bucket() -> None:
    """Valid JSON (``"user": "a\\ud800b"``) that has no UTF-8 form: it made the gateway answer 500."""
    bucket = bucket_of("s", "a\ud800b")
    assert 0 <= bucket < NUM_BUCKETS and bucket == bucket_of("s", "a\ud800b")
    assert bucket_of("s", "caf\u00e9") == bucket_of("s", "café")  # other keys hash as before


def test_buckets_are_laid_out_canary_then_baseline_then_stable() -> None:
    lay = layout(canary=1000, baseline=1000, stable=8000)
    assert [(s.start, s.end, s.role) for s in lay.slots] == [
        (0, 1000, PoolRole.CANARY),
        (1000, 2000, PoolRole.BASELINE),
        (2000, 10000, PoolRole.STABLE),
    ]
    assert share_of(lay, PoolRole.STABLE) == 8000


@pytest.mark.parametrize(
    ("steps"),
    [[0, 500, 1000, 2500, 5000, 10000], [100, 101, 2000], [2500, 2500, 5000]],
)
def test_raising_the_canary_weight_never_moves_a_canary_bucket_back(steps: list[int]) -> None:
    """Every bucket, every step of a rollout: once canary, canary for as long as the weight grows."""
    previous = None
    for canary in steps:
        lay = layout(canary=canary, stable=NUM_BUCKETS - canary)
        roles = [role_of(lay, b) for b in range(NUM_BUCKETS)]
        if previous is not None:
            moved_back = [
                b for b in range(NUM_BUCKETS) if previous[b] == PoolRole.CANARY and roles[b] != PoolRole.CANARY
            ]
            assert moved_back == []
        assert roles.count(PoolRole.CANARY) == canary
        previous = roles


def test_raising_canary_and_baseline_together_moves_nobody_back_to_stable() -> None:
    before = layout(canary=1000, baseline=1000, stable=8000)
    after = layout(canary=2500, baseline=2500, stable=5000)
    for bucket in range(NUM_BUCKETS):
        was, now = role_of(before, bucket), role_of(after, bucket)
        if was == PoolRole.CANARY:
            assert now == PoolRole.CANARY
        if was == PoolRole.BASELINE:
            assert now in (PoolRole.CANARY, PoolRole.BASELINE)


def test_zero_weights_take_no_buckets_and_every_bucket_has_an_owner() -> None:
    lay = layout(canary=0, stable=10000)
    assert [s.role for s in lay.slots] == [PoolRole.STABLE]
    assert all(role_of(lay, b) == PoolRole.STABLE for b in range(NUM_BUCKETS))


@pytest.mark.parametrize(
    ("session", "user", "key_id", "expected"),
    [
        ("conv-1", "alice", 7, "conv-1"),
        (None, "alice", 7, "alice"),
        ("", "alice", 7, "alice"),
        (None, None, 7, "api-key:7"),
        (None, 12, 7, "api-key:7"),  # a non-string user is ignored
        (None, None, None, None),
    ],
)
def test_the_sticky_key_is_session_else_user_else_api_key(session, user, key_id, expected) -> None:  # type: ignore[no-untyped-def]
    assert sticky_key(session, user, key_id) == expected
