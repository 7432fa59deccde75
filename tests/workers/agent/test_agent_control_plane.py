"""The agent against the real control plane: register with an enrollment
token, heartbeat, and apply the pool's desired profile revision.

The control plane is the real ASGI app under uvicorn on the test database;
the worker is the real ``serve`` process. Everything the test checks, it
reads from the control plane's rows.
"""

import json

import pytest

from tests.workers.server.support import wait_until, worker

PROFILE = {"max_num_batched_tokens": 256, "max_num_seqs": 8, "block_size": 32, "kv_cache_bytes": 16 << 20}


@pytest.fixture
def control_plane(web):
    """The real control plane, served by uvicorn (tests/conftest.py's ``web``)."""
    return web


def test_the_agent_registers_heartbeats_and_applies_a_profile_against_the_real_control_plane(
    control_plane, tiny_model, tmp_path
):
    from controlplane.fleet.models import EnrollmentToken, Pool, Worker
    from controlplane.profiles.models import Profile

    profile = Profile.objects.create(name="chunked", engine_kind="reference")
    first = profile.add_revision(PROFILE, comment="start")
    pool = Pool.objects.create(name="stable")
    pool.set_desired_revision(first)
    _, token = EnrollmentToken.issue("test", pool=pool)

    with worker(
        tiny_model,
        tmp_path / "worker.log",
        engine="reference",
        profile=json.dumps({"max_num_batched_tokens": 512, "block_size": 32}),
        extra=[
            "--max-model-len",
            "1024",
            "--control-plane",
            control_plane,
            "--enroll-token",
            token,
            "--name",
            "w-real",
        ],
    ):

        def row():
            return Worker.objects.filter(name="w-real").select_related("running_revision").first()

        # Registered into the token's pool, then moved onto the pool's revision.
        wait_until(
            lambda: (w := row()) is not None and w.running_revision_id == first.pk and w.state == Worker.State.READY,
            timeout=120,
        )
        w = row()
        assert w.pool_id == pool.pk and w.engine_kind == "reference" and w.max_model_len == 1024
        assert w.hardware["device"] == "cpu" and w.last_heartbeat_at is not None
        assert w.running_profile["max_num_batched_tokens"] == 256 and w.apply_error == ""
        assert set(w.load) >= {"num_requests_running", "kv_cache_usage_perc"}

        second = profile.add_revision({**PROFILE, "long_prefill_token_threshold": 64}, comment="cap chunks")
        pool.set_desired_revision(second)
        wait_until(lambda: (w := row()).running_revision_id == second.pk and w.state == Worker.State.READY, timeout=120)
        assert row().running_profile["long_prefill_token_threshold"] == 64


def test_a_worker_restarted_on_a_new_port_with_its_state_file_moves_the_control_planes_url(
    control_plane, tiny_model, tmp_path
):
    """`make demo` run twice: the worker comes back on another port, keeps
    its secret from the state file (so it never registers again) and the
    control plane must learn its new URL from the heartbeat."""
    from controlplane.fleet.models import EnrollmentToken, Worker

    _, token = EnrollmentToken.issue("test")
    state_file = tmp_path / "state" / "w-moved.json"
    args = [
        "--max-model-len",
        "512",
        "--control-plane",
        control_plane,
        "--name",
        "w-moved",
        "--state-file",
        str(state_file),
    ]
    profile = json.dumps({"max_num_batched_tokens": 128, "block_size": 32, "kv_cache_bytes": 8 << 20})

    def row():
        return Worker.objects.filter(name="w-moved").first()

    with worker(tiny_model, tmp_path / "first.log", profile=profile, extra=[*args, "--enroll-token", token]) as (
        first_url,
        _,
    ):
        wait_until(
            lambda: (w := row()) is not None and w.state == Worker.State.READY and w.url == first_url, timeout=120
        )
    assert state_file.exists()
    registered_at = row().registered_at

    with worker(tiny_model, tmp_path / "second.log", profile=profile, extra=args) as (second_url, _):  # no token now
        assert second_url != first_url
        wait_until(lambda: row().url == second_url and row().state == Worker.State.READY, timeout=120)
    assert row().registered_at == registered_at, "it heartbeat with its kept secret; it did not register again"
