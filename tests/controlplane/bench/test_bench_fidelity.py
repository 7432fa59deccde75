"""bench_fidelity's reading of guidellm's report and its verdicts.

No guidellm here: the fixture is a report guidellm 0.8.1 wrote in a real
run of the benchmark (``bench_fidelity --quick``'s first run, 4 December
2026: ``data/guidellm_report.json``), with its per-request records and its
text/media statistics dropped (the parser reads neither; they made it 1 MB).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from django.core.management.base import CommandError

from controlplane.bench.management.commands.bench_fidelity import (
    MIN_P99_REQUESTS,
    ROWS,
    ClientFigures,
    compare,
    counts_text,
    markdown_lines,
    parse_report,
    parse_runs,
    table_lines,
)
from controlplane.metrics import figures

REPORT = Path(__file__).parent / "data" / "guidellm_report.json"


def report() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(REPORT.read_text())
    return data


def successful(bench: dict[str, Any], metric: str) -> dict[str, Any]:
    stats: dict[str, Any] = bench["metrics"][metric]["successful"]
    return stats


def test_report_is_read_in_seconds_with_guidellm_inter_token_latency_as_tpot() -> None:
    raw = report()["benchmarks"][0]
    (client,) = parse_report(report())
    assert client.values["ttft_p50"] == pytest.approx(
        successful(raw, "time_to_first_token_ms")["percentiles"]["p50"] / 1000
    )
    assert client.values["ttft_p99"] == pytest.approx(
        successful(raw, "time_to_first_token_ms")["percentiles"]["p99"] / 1000
    )
    # Chunkpilot's TPOT leaves the first token out, as guidellm's ITL does;
    # guidellm's own "TPOT" (latency / tokens) counts it and is larger.
    itl_p50 = successful(raw, "inter_token_latency_ms")["percentiles"]["p50"] / 1000
    guidellm_tpot_p50 = successful(raw, "time_per_output_token_ms")["percentiles"]["p50"] / 1000
    assert client.values["tpot_p50"] == pytest.approx(itl_p50)
    assert client.values["tpot_p50"] != pytest.approx(guidellm_tpot_p50, rel=0.01)
    assert client.values["tpot_p99"] == pytest.approx(
        successful(raw, "inter_token_latency_ms")["percentiles"]["p99"] / 1000
    )


def test_report_window_counts_and_rate_agree() -> None:
    raw = report()["benchmarks"][0]
    (client,) = parse_report(report())
    assert client.start == raw["start_time"] and client.end == raw["end_time"]
    assert client.duration_seconds == pytest.approx(raw["duration"])
    assert client.num_successful == successful(raw, "time_to_first_token_ms")["count"]
    assert client.num_successful > 0
    # guidellm's requests/s: successful requests over its measured window.
    rate = client.values["requests_per_second"]
    assert rate == pytest.approx(client.num_successful / client.duration_seconds, rel=1e-6)


def test_report_without_benchmarks_is_empty() -> None:
    assert parse_report({"benchmarks": []}) == []


def test_every_row_names_a_registry_figure() -> None:
    """The benchmark reads the registry's public names; a rename there must show here."""
    for row in ROWS:
        assert row.dashboard in figures.FIGURES, row.dashboard
        assert figures.FIGURES[row.dashboard].source == "scrape"
        if row.log is not None:
            assert row.log in figures.FIGURES, row.log
            assert figures.FIGURES[row.log].source == "requests"


def client_with(num_requests: int, **values: float | None) -> ClientFigures:
    return ClientFigures(
        start=0.0, end=60.0, num_successful=num_requests, num_errored=0, num_incomplete=0, values=dict(values)
    )


def verdict(compared: list[Any], label: str) -> str:
    (row,) = [c for c in compared if c.row.label == label]
    result: str = row.verdict
    return result


@pytest.mark.parametrize(
    ("label", "client", "dashboard", "expected"),
    [
        ("TTFT P50", 0.100, 0.109, "met"),  # 1.09x: inside 10%
        ("TTFT P50", 0.100, 0.089, "NOT met"),  # 0.89x
        ("TTFT P99", 0.100, 0.114, "met"),  # P99: 15%
        ("TTFT P99", 0.100, 0.116, "NOT met"),
        ("TPOT P50", 0.0017, 0.0050, "NOT met"),  # issue 29's run A: 2.98x
        ("requests/s", 2.00, 2.05, "met"),  # 1.025x: inside 3%
        ("requests/s", 2.00, 2.40, "NOT met"),  # a rate extrapolated over idle edges
    ],
)
def test_dashboard_is_judged_against_the_client(label: str, client: float, dashboard: float, expected: str) -> None:
    row = next(r for r in ROWS if r.label == label)
    assert row.client is not None
    c = client_with(MIN_P99_REQUESTS, **{row.client: client})
    compared = compare(c, {row.dashboard: dashboard}, {})
    assert verdict(compared, label) == expected
    (mine,) = [x for x in compared if x.row.label == label]
    assert mine.reference == "client"
    assert mine.ratio == pytest.approx(dashboard / client)


def test_p99_on_fewer_than_200_requests_is_not_judged() -> None:
    compared = compare(
        client_with(MIN_P99_REQUESTS - 1, ttft_p99=0.1, ttft_p50=0.05), {"ttft_p99": 0.5, "ttft_p50": 0.05}, {}
    )
    assert verdict(compared, "TTFT P99").startswith("not judged")
    assert verdict(compared, "TTFT P50") == "met"  # P50s are judged at any count


def test_stall_is_judged_against_the_log_and_itl_has_no_reference() -> None:
    compared = compare(
        client_with(300),
        {"stall_p99": 0.705, "itl_p99": 0.01},
        {"client_stall_p99": 1.334},
    )
    (stall,) = [c for c in compared if c.row.label == "stall P99"]
    assert stall.reference == "log" and stall.verdict == "NOT met"
    assert stall.ratio == pytest.approx(0.705 / 1.334)
    assert verdict(compared, "ITL P99") == "no reference"


def test_missing_dashboard_figure_is_no_data_not_zero() -> None:
    compared = compare(client_with(300, ttft_p50=0.1), {"ttft_p50": None}, {"client_ttft_p50": 0.1})
    (row,) = [c for c in compared if c.row.label == "TTFT P50"]
    assert row.verdict == "no data" and row.ratio is None
    assert row.log_ratio == pytest.approx(1.0)


def test_tables_show_milliseconds_and_ratios() -> None:
    compared = compare(client_with(300, ttft_p50=0.1234), {"ttft_p50": 0.2468}, {"client_ttft_p50": 0.1234})
    line = next(line for line in table_lines(compared) if line.startswith("TTFT P50"))
    assert "123.40" in line and "246.80" in line and "2.00×" in line and "NOT met" in line
    md = next(line for line in markdown_lines("run", compared) if line.startswith("| TTFT P50"))
    assert md.split(" | ")[1:5] == ["123.40", "246.80", "123.40", "2.00×"]
    assert not any(math.isnan(c.ratio) for c in compared if c.ratio is not None)


def test_runs_are_parsed_and_bad_ones_named() -> None:
    runs = parse_runs("2:256:64, 4.5:1024:128")
    assert [(r.rate, r.prompt_tokens, r.output_tokens) for r in runs] == [(2.0, 256, 64), (4.5, 1024, 128)]
    with pytest.raises(CommandError, match="'2:256'"):
        parse_runs("2:256")
    with pytest.raises(CommandError, match="output >= 2"):
        parse_runs("2:256:1")
    with pytest.raises(CommandError, match="at least one"):
        parse_runs(" , ")


def test_engine_stall_is_shown_beside_not_judged() -> None:
    compared = compare(client_with(300), {"engine_stall_p99": 0.7}, {"client_stall_p99": 1.3})
    (row,) = [c for c in compared if c.row.label == "engine stall P99"]
    assert row.verdict == "engine-side, not judged"
    assert row.ratio == pytest.approx(0.7 / 1.3)


def test_counts_say_what_is_missing() -> None:
    assert counts_text({"ttft_samples": 224.0, "cancelled_requests": None}) == "ttft_samples 224, cancelled_requests —"
