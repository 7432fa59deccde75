"""The Requests pages rendered by Django: the list with its filters, a bad
filter named, the detail's timeline, gap chart, facts and links, and the
rollout page's link to its canary's chunked requests."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.gateway.models import RequestLog
from controlplane.rollouts.models import Rollout
from tests.controlplane.rollouts.factories import Fleet, make_fleet

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(db: Any) -> Fleet:
    return make_fleet(num_stable=1, num_canary=1)


def _log(fleet: Fleet, request_id: str, role: str, split: bool | None, **fields: Any) -> RequestLog:
    pool = fleet.canary if role == "canary" else fleet.stable
    defaults: dict[str, Any] = dict(
        created_at=timezone.now(),
        model=fleet.table.model,
        cohort=role,
        pool=pool,
        worker=fleet.workers[role][0],
        status=200,
        prefill_mode="chunked",
        prompt_split=split,
        num_prefill_chunks=3 if split else 1,
        ttft_seconds=0.1,
    )
    return RequestLog.objects.create(request_id=request_id, **{**defaults, **fields})


def test_the_list_filters_and_links_each_row(fleet: Fleet, viewer_client: Client) -> None:
    _log(fleet, "canary-chunked", "canary", True)
    _log(fleet, "canary-whole", "canary", False)
    _log(fleet, "stable-chunked", "stable", True)
    html = viewer_client.get("/requests/", {"cohort": "canary", "split": "chunked"}).content.decode()
    rows = RequestLog.objects.filter(cohort="canary", prompt_split=True)
    assert f'href="/requests/{rows[0].pk}/"' in html
    others = RequestLog.objects.exclude(pk=rows[0].pk)
    assert all(f'href="/requests/{r.pk}/"' not in html for r in others)
    assert "as=csv" in html and "as=jsonl" in html and "cohort=canary" in html


def test_a_bad_filter_is_a_400_that_names_the_field(viewer_client: Client) -> None:
    reply = viewer_client.get("/requests/", {"bucket": "huge"})
    assert reply.status_code == 400
    assert "<strong>bucket</strong>" in reply.content.decode()


def test_the_pages_need_a_signed_in_viewer(client: Client) -> None:
    assert client.get("/requests/").status_code in (302, 403)


def test_the_detail_shows_timeline_gaps_facts_and_links(fleet: Fleet, viewer_client: Client) -> None:
    row = _log(
        fleet,
        "detailed",
        "canary",
        True,
        queue_seconds=0.002,
        prefill_seconds=0.05,
        computed_tokens=96,
        cached_tokens=32,
        prompt_tokens=128,
        preemptions=0,
        e2e_seconds=0.4,
        profile_revision=fleet.target_revision,
        timeline={"chunks": [[0.003, 32], [0.02, 32], [0.04, 32]], "gaps": [0.01, 0.3, 0.02]},
    )
    html = viewer_client.get(f"/requests/{row.pk}/").content.decode()
    for label in (
        "arrived",
        "scheduled (left the queue)",
        "prefill chunk 1",
        "prefill chunk 3",
        "first token",
        "ended",
    ):
        assert f"<td>{label}</td>" in html
    assert html.count("<rect ") == 3 and 'id="gaps"' in html and 'id="timeline"' in html
    assert "yes, 3 chunks" in html and "96 / 32" in html
    assert f'href="/workers/{row.worker_id}/"' in html
    assert f'href="/profiles/{fleet.target_revision.profile_id}/"' in html


def test_the_rollout_page_links_to_its_canarys_chunked_requests(fleet: Fleet, viewer_client: Client) -> None:
    rollout = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        actor="tester",
    )
    early = _log(fleet, "before", "canary", True, created_at=rollout.created - timedelta(minutes=5))
    during = _log(fleet, "during", "canary", True, created_at=rollout.created + timedelta(seconds=5))
    whole = _log(fleet, "whole", "canary", False, created_at=rollout.created + timedelta(seconds=5))
    html = viewer_client.get(f"/rollouts/{rollout.pk}/").content.decode()
    start = html.index('id="canary-requests" href="') + len('id="canary-requests" href="')
    link = html[start : html.index('"', start)].replace("&amp;", "&")
    query = {k: v[0] for k, v in parse_qs(urlparse(link).query).items()}
    assert query["pool"] == fleet.canary.name and query["cohort"] == "canary" and query["split"] == "chunked"
    listing = viewer_client.get(link).content.decode()
    assert f'href="/requests/{during.pk}/"' in listing
    assert f'href="/requests/{early.pk}/"' not in listing and f'href="/requests/{whole.pk}/"' not in listing


def test_timeline_labels_never_overlap_and_stay_inside_the_chart() -> None:
    from controlplane.gateway.explorer import TimelineEvent
    from dashboards.requests.pages import CHART_WIDTH, timeline_layout

    # close together at both ends, as a fast request's are: the old layout
    # clipped "scheduled (left the queue)" at the left edge and stacked the rest
    events = [
        TimelineEvent("arrived", 0.0),
        TimelineEvent("scheduled (left the queue)", 0.0004),
        *(TimelineEvent(f"prefill chunk {i}", 0.001 * i, 32) for i in range(1, 6)),
        TimelineEvent("first token", 0.0052),
        TimelineEvent("ended", 0.4),
    ]
    layout = timeline_layout(events)
    spans = [(m.row, *m.text_span) for m in layout.marks]
    for row, left, right in spans:
        assert 0 <= left and right <= CHART_WIDTH, (row, left, right)
    for i, (row, left, right) in enumerate(spans):
        for other_row, other_left, other_right in spans[i + 1 :]:
            assert row != other_row or right <= other_left or other_right <= left, "labels overlap"
    assert max(m.text_y for m in layout.marks) < layout.height
    # the burst reads left to right on few lines, not one label a line
    assert max(m.row for m in layout.marks) <= 2, [(m.label, m.row) for m in layout.marks]
    assert layout.marks[-1].text_span[1] == CHART_WIDTH  # "ended", flush with the right edge


def test_the_gap_chart_has_an_axis_from_zero_to_the_largest_gap(fleet: Fleet, viewer_client: Client) -> None:
    row = _log(fleet, "gappy", "stable", True, timeline={"chunks": [[0.003, 32]], "gaps": [0.01, 0.3, 0.02]})
    html = viewer_client.get(f"/requests/{row.pk}/").content.decode()
    gaps = html.split('<svg id="gaps"', 1)[1].split("</svg>", 1)[0]
    assert 'data-axis="y"' in gaps and ">0.3000 s</text>" in gaps and ">0 s</text>" in gaps
    assert 'data-axis="x"' in gaps and "gap 3 (in token order)" in gaps
