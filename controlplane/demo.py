"""What ``python manage.py demo`` seeds and runs.

``processes()`` is the one place that lists the demo's processes, in start
order; a new component (the gateway, the load generator) adds its
``ProcessSpec`` there. Everything runs on the embedded default unless
``DATABASE_URL``/``REDIS_URL`` say otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from controlplane.accounts.roles import Role, grant_role
from controlplane.fleet.models import EnrollmentToken, Pool
from controlplane.gateway import demo as gateway_demo
from controlplane.launcher import (
    PYTHON,
    Enrollment,
    ProcessSpec,
    celery_beat_argv,
    celery_worker_argv,
    free_port,
    web_argv,
    worker_argv,
)
from controlplane.profiles.models import Profile

ADMIN_USERNAME = "admin"
# The tiny model knows 32K positions; the demo caps workers at 4K so the
# monolithic profile's budget (which must cover a whole prompt) stays small.
DEMO_MAX_MODEL_LEN = 4096

# Steady client traffic through the gateway, so the figures have something to
# show: the load generator's long-tail mix (one prompt in ten of thousands of
# tokens), at these requests per second to the simulated GPU fleet and to the
# reference workers. 0 turns one off.
DEMO_TRAFFIC_RATE = float(os.environ.get("CHUNKPILOT_DEMO_RATE", "0.5"))
DEMO_GPU_TRAFFIC_RATE = float(os.environ.get("CHUNKPILOT_DEMO_GPU_RATE", "4"))

# The simulated GPU fleet: H200s serving a Llama-3.1-8B-shaped model, step
# times from NVIDIA AIConfigurator's measured kernel database (the sim engine;
# no real inference: every page marks these workers "simulated").
SIM_MODEL = "llama-3.1-8b-sim"
SIM_OPTIONS = ("--sim-system", "h200_sxm", "--sim-backend", "vllm", "--sim-model", "meta-llama/Meta-Llama-3.1-8B")
SIM_MAX_MODEL_LEN = 16384
# (process name, pool, how many workers the process hosts): one process per
# pool, ``serve --count``; a count above 1 names its workers NAME-0, NAME-1, …
DEMO_SIM_WORKERS = [("gpu", "stable", 3), ("gpu-canary", "canary", 1), ("gpu-lab", "lab", 1)]
# Reference workers, doing real inference on the tiny model: a pool serving
# it and a lab worker of their own (name, pool). The lab pools are in no
# routing table: experiments run on them; the simulated lab worker is
# labelled demo_pool=lab, which "New experiment" picks by default.
DEMO_WORKERS = [("ref-1", "tiny"), ("ref-2", "tiny"), ("ref-lab", "tiny-lab")]

GPU_CHUNKED = {"prefill_mode": "chunked", "max_num_seqs": 128}
TINY_CHUNKED = {"prefill_mode": "chunked", "max_num_seqs": 32}
# Profiles as (name, engine kind, [(fields, comment), ...]): the chunked ones
# have two revisions so their pages have a diff to show.
DEMO_PROFILES: list[tuple[str, str, list[tuple[dict[str, Any], str]]]] = [
    (
        "gpu-chunked",
        "sim",
        [
            ({**GPU_CHUNKED, "max_num_batched_tokens": 2048, "long_prefill_token_threshold": 512}, "Sarathi-style"),
            ({**GPU_CHUNKED, "max_num_batched_tokens": 8192, "long_prefill_token_threshold": 2048}, "bigger chunks"),
        ],
    ),
    (
        "gpu-monolithic",
        "sim",
        [({"prefill_mode": "monolithic", "max_num_batched_tokens": SIM_MAX_MODEL_LEN, "max_num_seqs": 128}, "classic")],
    ),
    (
        "chunked",
        "reference",
        [
            ({**TINY_CHUNKED, "max_num_batched_tokens": 512, "long_prefill_token_threshold": 256}, "Sarathi-style"),
            ({**TINY_CHUNKED, "max_num_batched_tokens": 1024, "long_prefill_token_threshold": 512}, "bigger chunks"),
        ],
    ),
    (
        "monolithic",
        "reference",
        [
            (
                {"prefill_mode": "monolithic", "max_num_batched_tokens": DEMO_MAX_MODEL_LEN, "max_num_seqs": 32},
                "classic baseline",
            )
        ],
    ),
]
# Pool → (profile, revision) it should run.
DEMO_POOLS = {
    "stable": ("gpu-chunked", 1),
    "canary": ("gpu-chunked", 2),
    "lab": ("gpu-chunked", 1),
    "tiny": ("chunked", 1),
    "tiny-lab": ("chunked", 1),
}


@dataclass
class DemoContext:
    host: str
    port: int
    data_dir: Path
    admin_password: str
    enroll_tokens: dict[str, str] = field(default_factory=dict)  # pool → plaintext token
    model_dir: Path | None = None
    client_key: str = ""  # the gateway key of the load generator
    gateway_port: int = 8080

    @property
    def model_name(self) -> str:
        """What clients ask the gateway for: the workers serve the model
        under its directory's name."""
        return self.model_dir.name if self.model_dir is not None else "tiny-model"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """What every child needs to find the same database and Redis."""
        env = {"CHUNKPILOT_DATA_DIR": str(self.data_dir), "EXTERNAL_URL": self.url}
        if self.model_dir is not None:  # experiments build replay prompts with the served model's tokenizer
            env["EXPERIMENT_TOKENIZER_DIR"] = str(self.model_dir)
        return env


ADMIN_PASSWORD_FILE = "admin_password"


def ensure_admin(password: str | None) -> str:
    """The admin user, with ``password`` (CHUNKPILOT_ADMIN_PASSWORD) or else
    the one kept in the data directory, generated on the first start and
    kept there (owner-only) as the secret key is: a restart does not change
    the password an operator just wrote down. Returns it."""
    from django.contrib.auth import get_user_model

    if not password:
        kept = Path(settings.DATA_DIR) / ADMIN_PASSWORD_FILE
        if kept.is_file() and kept.read_text().strip():
            password = kept.read_text().strip()
        else:
            password = secrets.token_urlsafe(12)
            kept.touch(mode=0o600)
            kept.write_text(password + "\n")
    User = get_user_model()
    user, _ = User.objects.get_or_create(username=ADMIN_USERNAME, defaults={"is_staff": True, "is_superuser": True})
    user.is_staff = user.is_superuser = True
    user.set_password(password)
    user.save()
    grant_role(user, Role.ADMIN)
    return password


def tiny_model_ready(model_dir: Path) -> bool:
    """Whether ``model_dir`` already holds the shipped tiny model (the
    demo's start then copies nothing, and says nothing about it)."""
    # Imported here: only the demo's start asks, and a checkout without the
    # workers' server (worker_server_available) never does.
    from workers.engines.reference.tiny import is_built

    return is_built(model_dir, seed=0)


@transaction.atomic
def seed(ctx: DemoContext) -> None:
    """Profiles, pools, one fresh enrollment token per pool, and the gateway's
    routing table and client key. Safe to run on every start: existing rows
    are kept, tokens and keys of earlier runs revoked."""
    actor = "system:demo"
    for name, engine_kind, revisions in DEMO_PROFILES:
        if not Profile.objects.filter(name=name).exists():
            profile = Profile(name=name, engine_kind=engine_kind)
            with profile.changing(actor):  # one profile.create row, with its last revision
                profile.save()
                for fields, comment in revisions:
                    profile.add_revision(fields, comment=comment)
    for pool_name, (profile_name, revision) in DEMO_POOLS.items():
        if not Pool.objects.filter(name=pool_name).exists():
            pool = Pool(name=pool_name)
            with pool.changing(actor):
                pool.save()
                pool.set_desired_revision(Profile.objects.get(name=profile_name).revisions.get(revision=revision))
    EnrollmentToken.objects.filter(name__startswith="demo:").delete()
    for pool in Pool.objects.filter(name__in=DEMO_POOLS):
        _, plaintext = EnrollmentToken.issue(f"demo: {pool.name}", actor=actor, pool=pool)
        ctx.enroll_tokens[pool.name] = plaintext
    ctx.client_key = gateway_demo.seed({SIM_MODEL: ("stable", "canary"), ctx.model_name: ("tiny", None)})


def worker_server_available() -> bool:
    return importlib.util.find_spec("workers.server.cli") is not None


def processes(ctx: DemoContext) -> list[ProcessSpec]:
    """Every process of the demo, in start order. Add new ones here."""
    env = ctx.env()
    specs = [
        ProcessSpec("web", web_argv(ctx.port, host=ctx.host), env=env, ready_url=f"{ctx.url}/login/"),
        ProcessSpec(
            "celery-worker",
            celery_worker_argv("demo@%h", concurrency=2),
            env=env,
            ready_text="ready.",
        ),
        ProcessSpec(
            "celery-beat",
            celery_beat_argv(ctx.data_dir / "celerybeat-schedule"),
            env=env,
            ready_text="beat: Starting",
        ),
        gateway_demo.process_spec(ctx, port=ctx.gateway_port),
    ]
    if ctx.model_dir is not None:
        workers = [(name, pool, count, "sim") for name, pool, count in DEMO_SIM_WORKERS]
        workers += [(name, pool, 1, "reference") for name, pool in DEMO_WORKERS]
        for name, pool, count, engine in workers:
            port = free_port(count, below_ephemeral=True)  # it binds once its device has loaded
            enrollment = Enrollment(
                ctx.url,
                ctx.enroll_tokens[pool],
                name,
                ctx.data_dir / "demo" / f"{name}.json",
                labels={"demo_pool": pool},
            )
            simulated = engine == "sim"
            argv = worker_argv(
                ctx.model_dir,
                port,
                max_model_len=SIM_MAX_MODEL_LEN if simulated else DEMO_MAX_MODEL_LEN,
                engine=engine,
                host="127.0.0.1",
                enrollment=enrollment,
                extra=(*SIM_OPTIONS, "--served-model-name", SIM_MODEL, "--count", str(count)) if simulated else (),
            )
            # Up once its HTTP server answers; /health says 503 until the
            # engine has loaded, which the fleet page shows as it happens.
            specs.append(
                ProcessSpec(name, argv, env=env, ready_url=f"http://127.0.0.1:{port}/health", ready_on_any_status=True)
            )
        for name, model, rate in (
            ("traffic-gpu", SIM_MODEL, DEMO_GPU_TRAFFIC_RATE),
            ("traffic", ctx.model_name, DEMO_TRAFFIC_RATE),
        ):
            if rate > 0:
                specs.append(ProcessSpec(name, traffic_argv(ctx, model, rate), env=env))
    return specs


def traffic_argv(ctx: DemoContext, model: str, rate: float) -> list[str]:
    """The load generator: the long-tail mix to ``model`` through the gateway, for ever."""
    return [
        *(PYTHON, "-m", "workers", "loadgen", "--url", f"http://{ctx.host}:{ctx.gateway_port}"),
        *("--api-key", ctx.client_key, "--model", model, "--scenario", "long-tail", "--rate", str(rate)),
        *("--duration", "300", "--rounds", "0", "--wait", "600"),
        # many conversations, so a canary at 10% gets its share
        *("--sticky-keys", "200"),
    ]


__all__ = ["DemoContext", "ensure_admin", "seed", "processes", "tiny_model_ready", "worker_server_available"]
