"""The gateway's part of ``manage.py demo``: a routing table for each demo
model, a client key for the load generators, and the gateway process.

    from controlplane.gateway import demo as gateway_demo

    key = gateway_demo.seed({model: ("stable", "canary")})  # in seed(), once the pools exist
    specs.append(gateway_demo.process_spec(ctx))     # in processes(), after the web server
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from controlplane.fleet.models import Pool
from controlplane.gateway.models import ClientKey, PoolSpec, RoutingTable
from controlplane.launcher import ProcessSpec, gateway_argv

ACTOR = "system:demo"
DEMO_KEY_NAME = "demo: load generator"
GATEWAY_PORT = 8080


@transaction.atomic
def seed(tables: dict[str, tuple[str, str | None]]) -> str:
    """A routing table per model, ``{model: (stable pool, canary pool or
    None)}`` (everything on the stable pool, the canary at 0 until a rollout
    moves it), and a fresh admin client key for the load generators (keys of
    earlier runs are revoked). Returns the key. Safe on every start: an
    existing table keeps its weights and salt."""
    for model, (stable_pool, canary_pool) in tables.items():
        if RoutingTable.objects.filter(model=model).exists():
            continue
        table = RoutingTable.create_audited(model, actor=ACTOR)
        specs = [PoolSpec(Pool.objects.get(name=stable_pool), "stable", 10000)]
        if canary_pool is not None:
            specs.append(PoolSpec(Pool.objects.get(name=canary_pool), "canary", 0))
        table.configure(
            specs,
            actor=ACTOR,
            reason="demo seed",
            require_ready=False,  # the workers start after the seed
        )
    for old in ClientKey.objects.filter(name=DEMO_KEY_NAME):
        old.delete_audited(ACTOR)
    _, plaintext = ClientKey.issue(DEMO_KEY_NAME, is_admin=True, actor=ACTOR)
    return plaintext


def process_spec(ctx: Any, port: int = GATEWAY_PORT) -> Any:
    """``manage.py rungateway`` as a demo process (``ctx``: the demo's DemoContext)."""
    return ProcessSpec(
        "gateway",
        gateway_argv(port, host=ctx.host),
        env=ctx.env(),
        ready_url=f"http://{ctx.host}:{port}/health",
    )
