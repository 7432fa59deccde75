"""Equal conditions, on a real reference worker (tiny model) driven step by
step in this process: arms interleave across repeats; repeat r of every
arm sends the same number of requests (paired, at equal offered load); and
every arm builds its own prefix hits from the workload's sharing on a
cache reset before it, instead of inheriting the earlier arm's (the
reference engine keeps its cache across profile changes: without the reset
the second arm of a repeat found every prompt cached)."""

from __future__ import annotations

import random

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.experiments.models import ArmStatus, Experiment, Phase, Workload
from controlplane.fleet.models import Worker
from tests.controlplane.experiments.test_runner_ramp import fast, run_to_the_end, served, worker  # noqa: F401
from workers.replay import Observed, capture

pytestmark = pytest.mark.django_db(transaction=True)
ARMS = [
    {"name": "baseline", "fields": {"prefill_mode": "monolithic", "max_num_batched_tokens": 512, "max_num_seqs": 16}},
    {
        "name": "chunk-64",
        "fields": {
            "prefill_mode": "chunked",
            "max_num_batched_tokens": 128,
            "long_prefill_token_threshold": 64,
            "max_num_seqs": 16,
        },
    },
]


def shared_workload() -> Workload:
    """3 requests/s; 200-400-token prompts, 60% of them starting with a
    cached prefix of 80% of their tokens: about half the prompt tokens hit."""
    rng = random.Random(1)
    observed = []
    for i in range(300):
        prompt = rng.randint(200, 400)
        cached = int(prompt * 0.8) // 16 * 16 if rng.random() < 0.6 else 0
        observed.append(Observed(i / 3, prompt, rng.randint(4, 8), cached))
    return Workload._store(None, "shared", "loadgen", {}, capture(observed, 100.0))


def test_arms_interleave_and_each_repeat_starts_cold_on_the_same_requests(worker: Worker) -> None:  # noqa: F811
    workload = shared_workload()
    exp = Experiment.create(
        name="equal", workload=workload, workers=[worker], arms=ARMS, duration_seconds=4, warmup_seconds=1, repeats=2
    )
    exp = run_to_the_end(exp, max_steps=30)
    assert exp.phase == Phase.SUCCEEDED, exp.message
    arms = {a.name: a for a in exp.arms.all()}
    assert all(a.status == ArmStatus.SUCCEEDED for a in arms.values()), [a.error for a in arms.values()]

    started = [
        (e.after["arm"], e.after["repeat"])
        for e in AuditEvent.objects.filter(action="experiment.arm_started", object_id=str(exp.pk)).order_by(
            "time", "pk"
        )
    ]
    assert [s for s in started if s[1] is not None] == [
        ("baseline", 0),
        ("chunk-64", 0),
        ("chunk-64", 1),
        ("baseline", 1),
    ]

    workload_share = workload.workload_spec().prefix_hit_share
    assert 0.4 < workload_share < 0.6
    for repeat in range(2):
        a, b = (next(r for r in arms[n].results if r["repeat"] == repeat) for n in ("baseline", "chunk-64"))
        assert a["client"]["num_requests"] == b["client"]["num_requests"] == round(3 * 4)  # paired, at the rate
        share_a, share_b = a["figures"]["prefix_hit_share"], b["figures"]["prefix_hit_share"]
        # Each arm rebuilt the workload's sharing from a cold cache: the
        # second did not find the first's prompts cached.
        assert 0.2 < share_a < 0.75 and 0.2 < share_b < 0.75, (repeat, share_a, share_b)
        assert abs(share_a - share_b) < 0.1, (repeat, share_a, share_b)

    for arm in arms.values():
        c = arm.conditions(exp)
        assert (c.num_repeats, c.requests_sent, c.requests_completed) == (2, 24, 24)
        assert c.achieved_rate == pytest.approx(3.0)
    assert exp.recommendation["outcome"] in ("winner", "no_significant_winner")
    assert set(exp.recommendation["versus_baseline"]) == {"chunk-64"}
