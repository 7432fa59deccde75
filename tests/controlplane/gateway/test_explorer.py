"""The request log's API on PostgreSQL: every filter alone and combined
against a hand-built set of rows, sorting and keyset pages, and exports
that equal the pages laid end to end."""

from __future__ import annotations

import csv
import io
import itertools
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction

from controlplane.accounts.roles import Role
from controlplane.gateway import explorer
from controlplane.gateway.models import RequestLog
from tests.controlplane.factories import api_client, make_profile, make_user
from tests.controlplane.gateway.factories import routed_model

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
PROMPT_LENGTHS = (100, 512, 1500, 9000, 40000)


@pytest.fixture
def rows() -> list[RequestLog]:
    """60 rows crossing every filtered attribute, each latency distinct."""
    _, pools, workers = routed_model(urls={"stable": ["http://127.0.0.1:9"], "canary": ["http://127.0.0.1:9"]})
    revisions = [make_profile().pk, make_profile().pk]
    made = []
    combos = itertools.product(("stable", "canary"), ("chunked", "monolithic"), (True, False, None), (200, 503, 598))
    for i, (role, mode, split, status) in enumerate(itertools.islice(itertools.cycle(combos), 60)):
        made.append(
            RequestLog(
                request_id=f"r{i}",
                created_at=T0 + timedelta(seconds=i),
                model="tiny" if i % 4 else "other",
                cohort=role,
                pool=pools[role],
                worker=workers[role][0],
                profile_revision_id=revisions[i % 2],
                status=status,
                error="" if status == 200 or i % 5 else "",
                stream=True,
                prefill_mode=mode,
                prompt_split=split,
                num_prefill_chunks=None if split is None else (3 if split else 1),
                prompt_tokens=PROMPT_LENGTHS[i % 5],
                ttft_seconds=None if status == 503 else 0.01 * ((i * 7) % 60),
                max_gap_seconds=0.02 * ((i * 11) % 60),
                e2e_seconds=0.5 + 0.03 * ((i * 13) % 60),
                tpot_seconds=0.001 * i,
                queue_seconds=0.002 * ((i * 17) % 60),
                prefill_seconds=0.003 * ((i * 19) % 60),
            )
        )
    return RequestLog.objects.bulk_create(made)


def _all_pages(client: Any, params: dict[str, Any], limit: int = 7) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        reply = client.get("/api/v1/requests/", {**params, "limit": limit, **({"cursor": cursor} if cursor else {})})
        assert reply.status_code == 200, reply.content
        out.extend(reply.json()["results"])
        cursor = reply.json()["next"]
        if cursor is None:
            return out


def _ids(rows: list[RequestLog], keep: Any) -> set[str]:
    return {r.request_id for r in rows if keep(r)}


def _bucket(n: int | None) -> str:
    return "<=512" if n <= 512 else "<=2K" if n <= 2048 else "<=8K" if n <= 8192 else "<=32K" if n <= 32768 else ">32K"


FILTERS: list[tuple[dict[str, str], Any]] = [
    (
        {"since": (T0 + timedelta(seconds=20)).isoformat(), "until": (T0 + timedelta(seconds=35)).isoformat()},
        lambda r: T0 + timedelta(seconds=20) <= r.created_at < T0 + timedelta(seconds=35),
    ),
    ({"model": "other"}, lambda r: r.model == "other"),
    ({"cohort": "canary"}, lambda r: r.cohort == "canary"),
    ({"pool": "tiny-stable"}, lambda r: r.pool.name == "tiny-stable"),
    ({"worker": "tiny-canary-0"}, lambda r: r.worker.name == "tiny-canary-0"),
    ({"prefill_mode": "monolithic"}, lambda r: r.prefill_mode == "monolithic"),
    ({"split": "chunked"}, lambda r: r.prompt_split is True),
    ({"split": "whole"}, lambda r: r.prompt_split is False),
    ({"status": "598"}, lambda r: r.status == 598),
    ({"status": "ok"}, lambda r: r.status == 200 and not r.error),
    ({"status": "failed"}, lambda r: r.status >= 500),
    ({"bucket": "<=512"}, lambda r: _bucket(r.prompt_tokens) == "<=512"),
    ({"bucket": ">32K"}, lambda r: _bucket(r.prompt_tokens) == ">32K"),
    ({"slow_by": "ttft", "slow_above": "0.3"}, lambda r: r.ttft_seconds is not None and r.ttft_seconds > 0.3),
    ({"slow_by": "max_gap", "slow_above": "0.5"}, lambda r: r.max_gap_seconds > 0.5),
    ({"slow_by": "e2e", "slow_above": "1.5"}, lambda r: r.e2e_seconds > 1.5),
]


@pytest.mark.parametrize("params, keep", FILTERS, ids=[",".join(p) for p, _ in FILTERS])
def test_each_filter_alone_returns_exactly_its_rows(rows: list[RequestLog], params: dict[str, str], keep: Any) -> None:
    client = api_client(make_user(Role.VIEWER))
    got = {r["request_id"] for r in _all_pages(client, params)}
    expected = _ids(rows, keep)
    assert expected and got == expected


def test_the_revision_filter_returns_that_revisions_rows(rows: list[RequestLog]) -> None:
    client = api_client(make_user(Role.VIEWER))
    revision = rows[1].profile_revision_id
    got = {r["request_id"] for r in _all_pages(client, {"revision": str(revision)})}
    assert got == _ids(rows, lambda r: r.profile_revision_id == revision) and len(got) == 30


COMBINED = [
    (
        {"cohort": "canary", "split": "chunked", "pool": "tiny-canary", "status": "200"},
        lambda r: r.cohort == "canary" and r.prompt_split is True and r.status == 200,
    ),
    (
        {
            "model": "tiny",
            "prefill_mode": "monolithic",
            "slow_by": "e2e",
            "slow_above": "1.0",
            "since": (T0 + timedelta(seconds=10)).isoformat(),
        },
        lambda r: (
            r.model == "tiny"
            and r.prefill_mode == "monolithic"
            and r.e2e_seconds > 1.0
            and r.created_at >= T0 + timedelta(seconds=10)
        ),
    ),
    (
        {"worker": "tiny-stable-0", "status": "failed", "bucket": "<=512", "split": "whole"},
        lambda r: (
            r.worker.name == "tiny-stable-0"
            and r.status >= 500
            and _bucket(r.prompt_tokens) == "<=512"
            and r.prompt_split is False
        ),
    ),
]


@pytest.mark.parametrize("params, keep", COMBINED, ids=["canary-chunked-ok", "slow-monolithic", "failed-whole"])
def test_filters_combine_as_and(rows: list[RequestLog], params: dict[str, str], keep: Any) -> None:
    client = api_client(make_user(Role.VIEWER))
    got = {r["request_id"] for r in _all_pages(client, params)}
    expected = _ids(rows, keep)
    assert expected and got == expected


@pytest.mark.parametrize(
    "sort, column",
    [
        ("time", "created_at"),
        ("ttft", "ttft_seconds"),
        ("max_gap", "max_gap_seconds"),
        ("e2e", "e2e_seconds"),
        ("queue", "queue_seconds"),
        ("prefill", "prefill_seconds"),
        ("tpot", "tpot_seconds"),
    ],
)
@pytest.mark.parametrize("order", ["desc", "asc"])
def test_pages_follow_the_sort_without_gaps_or_repeats(
    rows: list[RequestLog], sort: str, column: str, order: str
) -> None:
    client = api_client(make_user(Role.VIEWER))
    got = _all_pages(client, {"sort": sort, "order": order}, limit=9)
    ranked = sorted(
        (r for r in rows if getattr(r, column) is not None),
        key=lambda r: (getattr(r, column), r.pk),
        reverse=order == "desc",
    )
    assert [r["request_id"] for r in got] == [r.request_id for r in ranked]


def test_the_export_equals_the_pages_in_csv_and_json_lines(rows: list[RequestLog]) -> None:
    client = api_client(make_user(Role.VIEWER))
    params = {"cohort": "canary", "sort": "ttft"}
    tricky = next(r for r in rows if r.cohort == "canary" and r.ttft_seconds is not None)
    tricky.error = 'said "no", then \\ a backslash,\nnewline\ttab and ünïcode'
    tricky.save()
    pages = _all_pages(client, params)
    assert tricky.error in [p["error"] for p in pages]
    jsonl = client.get("/api/v1/requests/export/", {**params, "as": "jsonl"})
    assert jsonl.status_code == 200 and jsonl["Content-Type"].startswith("application/jsonl")
    lines = [json.loads(line) for line in b"".join(jsonl.streaming_content).decode().splitlines()]
    assert lines == pages
    reply = client.get("/api/v1/requests/export/", {**params, "as": "csv"})
    assert reply.status_code == 200 and reply["Content-Type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(b"".join(reply.streaming_content).decode())))
    assert [r["request_id"] for r in table] == [p["request_id"] for p in pages]
    assert [r["error"] for r in table] == [p["error"] for p in pages]
    assert [float(r["ttft_seconds"]) for r in table] == [p["ttft_seconds"] for p in pages]


@pytest.mark.parametrize(
    "params, field",
    [
        ({"cohort": "purple"}, "cohort"),
        ({"since": "yesterday"}, "since"),
        ({"pool": "nope"}, "pool"),
        ({"status": "bad"}, "status"),
        ({"bucket": "<=1"}, "bucket"),
        ({"slow_by": "ttft"}, "slow_above"),
        ({"slow_above": "1"}, "slow_by"),
        ({"sort": "speed"}, "sort"),
        ({"limit": "0"}, "limit"),
        ({"cursor": "!!"}, "cursor"),
        ({"split": "maybe"}, "split"),
        ({"prefill_mode": "x"}, "prefill_mode"),
        ({"revision": "r1"}, "revision"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(params: dict[str, str], field: str) -> None:
    client = api_client(make_user(Role.VIEWER))
    reply = client.get("/api/v1/requests/", params)
    assert reply.status_code == 400 and field in reply.json()
    assert client.get("/api/v1/requests/export/", {**params, "as": "csv"}).status_code == 400


def test_the_detail_has_the_timeline_and_the_gaps(rows: list[RequestLog]) -> None:
    row = rows[0]
    row.timeline = {"chunks": [[0.001, 32], [0.004, 32], [0.009, 12]], "gaps": [0.01, 0.2, 0.01]}
    row.ttft_seconds, row.queue_seconds, row.e2e_seconds = 0.012, 0.0005, 0.5
    row.save()
    reply = api_client(make_user(Role.VIEWER)).get(f"/api/v1/requests/{row.pk}/")
    assert reply.status_code == 200
    body = reply.json()
    assert [e["label"] for e in body["timeline"]] == [
        "arrived",
        "scheduled (left the queue)",
        "prefill chunk 1",
        "prefill chunk 2",
        "prefill chunk 3",
        "first token",
        "ended",
    ]
    assert [e["num_tokens"] for e in body["timeline"] if e["label"].startswith("prefill")] == [32, 32, 12]
    assert body["gaps"] == [0.01, 0.2, 0.01] and body["request"]["pool"] == "tiny-stable"


def test_anonymous_callers_are_refused() -> None:
    assert api_client().get("/api/v1/requests/").status_code == 401


NOT_OK_INDEX = {sort: "gap" if sort == "max_gap" else sort for sort in explorer.SORTS}  # sort → index suffix


@pytest.mark.parametrize("sort", list(explorer.SORTS))
@pytest.mark.parametrize("status", ["598", "429", "failed"])
def test_a_failure_filter_sorted_by_a_figure_can_walk_the_not_ok_index(
    rows: list[RequestLog], status: str, sort: str
) -> None:
    """PostgreSQL uses a partial index only when the query's WHERE implies its
    predicate (``NOT_OK``): a filter rewritten so that it no longer does would
    bring back the 10M-row walks (``bench_requests``: 190-280 ms a first page).
    With the log's other indexes dropped (rolled back after) and scans that
    would read every row priced out, the plan must walk the partial one."""
    query = explorer.parse({"status": status, "sort": sort})
    sql, params = query.queryset().values_list("id")[: query.limit + 1].query.sql_with_params()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexname LIKE 'reqlog%%' "
            "AND indexname NOT LIKE 'reqlog_notok%%'",
            [RequestLog._meta.db_table],
        )
        for (name,) in cursor.fetchall():
            cursor.execute(f'DROP INDEX "{name}"')
        for scan in ("seqscan", "bitmapscan", "sort", "incremental_sort"):
            cursor.execute(f"SET LOCAL enable_{scan} = off")
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(line for (line,) in cursor.fetchall())
        transaction.set_rollback(True)
    assert f" reqlog_notok_{NOT_OK_INDEX[sort]} " in plan, plan


def test_an_empty_numeric_filter_is_left_out_as_the_schema_says(rows: list[RequestLog]) -> None:
    """The filter form sends every field, empty or not: an empty number is no
    filter (and no 400), and the published schema admits the empty value."""
    client = api_client(make_user(Role.VIEWER))
    everything = {r["request_id"] for r in _all_pages(client, {})}
    for name in ("slow_above", "revision", "limit"):
        reply = client.get("/api/v1/requests/", {name: ""})
        assert reply.status_code == 200, reply.content
        export = client.get("/api/v1/requests/export/", {name: "", "as": "jsonl"})
        assert export.status_code == 200
        lines = b"".join(export.streaming_content).decode().splitlines()
        assert {json.loads(line)["request_id"] for line in lines} == everything
    schema = client.get("/api/schema/", {"format": "json"}).json()
    for path, names in (
        ("/api/v1/requests/", ("slow_above", "revision", "limit")),
        ("/api/v1/requests/export/", ("slow_above", "revision")),
    ):
        params = {p["name"]: p["schema"] for p in schema["paths"][path]["get"]["parameters"]}
        for name in names:
            assert {"type": "string", "enum": [""]} in params[name]["anyOf"], (path, name)
