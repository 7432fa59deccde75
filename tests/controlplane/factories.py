"""Small factories for control-plane tests: real rows, made the way the
product makes them (profiles through add_revision, workers by registering)."""

from __future__ import annotations

import itertools
from typing import Any

from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from controlplane.accounts.roles import Role, grant_role
from controlplane.fleet.models import EnrollmentToken, Pool, Worker
from controlplane.profiles.models import Profile, ProfileRevision
from workers import contract

_seq = itertools.count(1)


def make_user(role: Role, username: str | None = None, password: str | None = None) -> Any:
    # No password unless a test logs in with one: hashing costs ~0.2 s each.
    user = get_user_model().objects.create_user(
        username=username or f"{role.group_name}{next(_seq)}", password=password
    )
    grant_role(user, role)
    return user


def api_client(user: Any | None = None) -> APIClient:
    client = APIClient()
    if user is not None:
        token, _ = Token.objects.get_or_create(user=user)
        client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def make_profile(name: str | None = None, engine_kind: str = "reference", **fields: Any) -> ProfileRevision:
    profile = Profile.objects.create(name=name or f"profile-{next(_seq)}", engine_kind=engine_kind)
    return profile.add_revision(fields or {"max_num_batched_tokens": 512}, comment="created")


def make_pool(name: str | None = None, revision: ProfileRevision | None = None) -> Pool:
    pool = Pool.objects.create(name=name or f"pool-{next(_seq)}")
    if revision is not None:
        pool.set_desired_revision(revision)
    return pool


def register_request(token: str, name: str, **overrides: Any) -> dict[str, Any]:
    body = {
        "contract_version": contract.CONTRACT_VERSION,
        "enroll_token": token,
        "name": name,
        "url": f"http://127.0.0.1:9/{name}",
        "engine_kind": "reference",
        "model": "tiny",
        "max_model_len": 512,
        "hardware": {"device": "cpu", "cpu_count": 2},
        "labels": {"zone": "a"},
    }
    body.update(overrides)
    return body


def heartbeat_request(state: str = "ready", running_revision_id: int | None = None, **overrides: Any) -> dict[str, Any]:
    body = {
        "contract_version": contract.CONTRACT_VERSION,
        "state": state,
        "load": {"num_requests_running": 1, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.1},
        "running_revision_id": running_revision_id,
        "running_profile": {},
        "hardware": {"device": "cpu", "cpu_count": 2},
        "apply_error": None,
    }
    body.update(overrides)
    return body


def enroll_worker(name: str | None = None, pool: Pool | None = None, **overrides: Any) -> tuple[Worker, str]:
    _, plaintext = EnrollmentToken.issue("test", pool=pool)
    req = contract.parse_register(register_request(plaintext, name or f"worker-{next(_seq)}", **overrides))
    return Worker.register(req)
