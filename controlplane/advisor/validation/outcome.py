"""What switching did: a scenario's outcome from the client side, and the
rule that says whether chunking paid. Pure, free of Django.

A run's outcome is read from the requests as their client saw them (each
request's time to first token, its largest gap between two token events,
its time per output token) and the run's wall time. The rule compares a
monolithic run with a chunked run of the same seeded requests:

* a chunked run that loses more than ``MAX_THROUGHPUT_LOSS`` of the
  monolithic output throughput does not pay, whatever else it gains;
* it pays when it meets the TBT objective (stall P99 at most the objective:
  the largest gap a user waits between two tokens) where monolithic does not;
* or when it raises goodput (requests per second within the TTFT and TPOT
  objectives) by at least ``MIN_GOODPUT_GAIN`` of the monolithic goodput;
* else it does not pay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from workers.figures import percentile
from workers.loadgen import RequestRecord

MAX_THROUGHPUT_LOSS = 0.10
MIN_GOODPUT_GAIN = 0.05


@dataclass(frozen=True)
class Objectives:
    ttft_seconds: float
    tbt_seconds: float  # the largest gap between two tokens a user should wait (stall), at P99
    tpot_seconds: float

    def to_json(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Outcome:
    """One run of one scenario, as its clients saw it."""

    num_requests: int
    num_ok: int
    wall_seconds: float
    stall_p99_seconds: float | None  # P99 over requests of each one's largest token gap
    tbt_p99_seconds: float | None  # P99 over every gap between two token events
    tpot_p99_seconds: float | None
    ttft_p50_seconds: float | None
    ttft_p99_seconds: float | None
    output_tokens_per_second: float
    goodput: float  # requests per second within the TTFT and TPOT objectives
    prefix_hit_share: float  # prompt tokens the prefix cache served / prompt tokens
    failure_reasons: tuple[str, ...] = ()  # the first few distinct ones, so a failed request says why

    def meets_tbt(self, objectives: Objectives) -> bool:
        return self.stall_p99_seconds is not None and self.stall_p99_seconds <= objectives.tbt_seconds

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def outcome_of(records: Sequence[RequestRecord], wall_seconds: float, objectives: Objectives) -> Outcome:
    ok = [r for r in records if r.success]
    stalls = [r.max_gap_seconds for r in ok if r.max_gap_seconds is not None]
    gaps = [g for r in ok for g in r.itl_seconds]
    tpots = [r.tpot_seconds for r in ok if r.tpot_seconds is not None]
    ttfts = [r.ttft_seconds for r in ok if r.ttft_seconds is not None]
    good = [
        r
        for r in ok
        if r.ttft_seconds is not None
        and r.ttft_seconds <= objectives.ttft_seconds
        and (r.tpot_seconds is None or r.tpot_seconds <= objectives.tpot_seconds)
    ]
    prompt = sum(r.prompt_tokens for r in ok)
    return Outcome(
        num_requests=len(records),
        num_ok=len(ok),
        wall_seconds=wall_seconds,
        stall_p99_seconds=percentile(stalls, 99),
        tbt_p99_seconds=percentile(gaps, 99),
        tpot_p99_seconds=percentile(tpots, 99),
        ttft_p50_seconds=percentile(ttfts, 50),
        ttft_p99_seconds=percentile(ttfts, 99),
        output_tokens_per_second=sum(r.output_tokens for r in ok) / wall_seconds if wall_seconds > 0 else 0.0,
        goodput=len(good) / wall_seconds if wall_seconds > 0 else 0.0,
        prefix_hit_share=sum(min(r.cached_tokens, r.prompt_tokens) for r in ok) / prompt if prompt else 0.0,
        failure_reasons=tuple(
            dict.fromkeys(
                f"{r.status or 'no response'}: {r.error or f'finish_reason {r.finish_reason}'}"
                for r in records
                if not r.success
            )
        )[:3],
    )


@dataclass(frozen=True)
class Judgement:
    pays: bool
    reason: str


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def chunking_pays(
    monolithic: Outcome,
    chunked: Outcome,
    objectives: Objectives,
    *,
    max_throughput_loss: float = MAX_THROUGHPUT_LOSS,
    min_goodput_gain: float = MIN_GOODPUT_GAIN,
) -> Judgement:
    """Did switching from ``monolithic`` to ``chunked`` pay? (See the module's rule.)"""
    base, new = monolithic.output_tokens_per_second, chunked.output_tokens_per_second
    loss = 1 - new / base if base > 0 else (0.0 if new > 0 else math.nan)
    if math.isnan(loss):
        return Judgement(False, "neither run produced a token")
    if loss > max_throughput_loss:
        return Judgement(False, f"chunked loses {loss:.0%} of the output throughput ({base:.0f} → {new:.0f} tok/s)")
    if chunked.meets_tbt(objectives) and not monolithic.meets_tbt(objectives):
        return Judgement(
            True,
            f"stall P99 {_ms(monolithic.stall_p99_seconds)} → {_ms(chunked.stall_p99_seconds)}: chunked meets the "
            f"{_ms(objectives.tbt_seconds)} TBT objective, monolithic does not",
        )
    gain = chunked.goodput - monolithic.goodput
    if gain > 0 and gain >= min_goodput_gain * monolithic.goodput:
        return Judgement(True, f"goodput {monolithic.goodput:.2f} → {chunked.goodput:.2f} req/s (+{gain:.2f})")
    met = "both meet" if monolithic.meets_tbt(objectives) else "neither meets"
    if chunked.meets_tbt(objectives) is False and monolithic.meets_tbt(objectives):
        met = "monolithic meets, chunked does not meet"
    return Judgement(
        False,
        f"{met} the {_ms(objectives.tbt_seconds)} TBT objective (stall P99 {_ms(monolithic.stall_p99_seconds)} → "
        f"{_ms(chunked.stall_p99_seconds)}); goodput {monolithic.goodput:.2f} → {chunked.goodput:.2f} req/s",
    )
