"""The validation panel: seeded traffic scenarios, each one a workload
(``workers.replay.WorkloadSpec``: length distributions, rate, burstiness,
prefix sharing) that ``workers.replay.sample`` turns into the same requests
for every run. Pure, free of Django.

Lengths are fractions of the workers' context (``max_model_len``), so the
panel means the same on the tiny model (2,048 tokens) and on a GPU model;
rates are the tiny model's on two CPU cores and scale with ``rate_scale``.

Each scenario names its two profiles: the *baseline* (monolithic, or a
chunked profile whose budget never splits a prompt) and the tuned chunked
profile, and which of the two the pool runs now (*observed*): the advisor
judges that run's live figures only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from workers.loadgen import PlannedRequest
from workers.replay import Histogram, WorkloadSpec, sample

MONOLITHIC = "monolithic"
UNSPLIT = "chunked-unsplit"  # chunked in name only: the budget takes any prompt whole
CHUNKED = "chunked"
MAX_NUM_SEQS = 32


def profiles(max_model_len: int, *, budget: int = 256, chunk_cap: int = 128) -> dict[str, dict[str, Any]]:
    """The three profiles the panel runs, for a context of ``max_model_len``."""
    return {
        MONOLITHIC: {
            "prefill_mode": "monolithic",
            "max_num_batched_tokens": max_model_len,
            "max_num_seqs": MAX_NUM_SEQS,
        },
        UNSPLIT: {"prefill_mode": "chunked", "max_num_batched_tokens": max_model_len, "max_num_seqs": MAX_NUM_SEQS},
        CHUNKED: {
            "prefill_mode": "chunked",
            "max_num_batched_tokens": budget,
            "long_prefill_token_threshold": chunk_cap,
            "max_num_seqs": MAX_NUM_SEQS,
        },
    }


def _uniform(rng: random.Random, low: int, high: int, n: int) -> list[int]:
    return [rng.randint(low, max(low, high)) for _ in range(n)]


@dataclass(frozen=True)
class Mix:
    """A workload's shape: lengths as (low, high) token ranges or fractions
    of the context, each part with its share of the requests."""

    parts: tuple[tuple[float, tuple[float, float], tuple[int, int]], ...]  # (share, prompt range, output range)
    rate_per_second: float
    burstiness: float = 1.0
    prefix_hit_share: float = 0.0
    prefix_request_share: float = 0.0

    def spec(self, max_model_len: int, duration_seconds: float, seed: int, rate_scale: float = 1.0) -> WorkloadSpec:
        rng = random.Random(seed)
        prompts: list[int] = []
        outputs: list[int] = []
        for share, (lo, hi), (out_lo, out_hi) in self.parts:
            n = max(1, round(share * 1000))
            prompts += _uniform(rng, _tokens(lo, max_model_len), _tokens(hi, max_model_len), n)
            outputs += _uniform(rng, out_lo, out_hi, n)
        return WorkloadSpec(
            prompt_tokens=Histogram.of(prompts),
            output_tokens=Histogram.of(outputs),
            rate_per_second=self.rate_per_second * rate_scale,
            burstiness=self.burstiness,
            prefix_hit_share=self.prefix_hit_share,
            prefix_request_share=self.prefix_request_share,
            num_requests=round(self.rate_per_second * rate_scale * duration_seconds),
            duration_seconds=duration_seconds,
        )


def _tokens(value: float, max_model_len: int) -> int:
    """A length: a fraction of the context when below 1, else tokens."""
    return max(1, round(value * max_model_len)) if value < 1 else int(value)


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    mix: Mix
    duration_seconds: float
    seed: int
    baseline: str = MONOLITHIC  # MONOLITHIC or UNSPLIT: the side that does not split prompts
    observed: Literal["baseline", "chunked"] = "baseline"  # the profile the pool runs now

    def observed_profile(self) -> str:
        return self.baseline if self.observed == "baseline" else CHUNKED

    def plan(
        self,
        *,
        max_model_len: int,
        vocabulary: list[int],
        rate_scale: float = 1.0,
        duration_scale: float = 1.0,
    ) -> list[PlannedRequest]:
        """The scenario's requests: the same for every run with the same arguments."""
        duration = self.duration_seconds * duration_scale
        spec = self.mix.spec(max_model_len, duration, self.seed, rate_scale)
        return sample(
            spec, vocabulary=vocabulary, seed=self.seed, duration_seconds=duration, max_model_len=max_model_len
        )


# Decoders (short prompts, longer answers) with a long-prompt tail arriving among them.
LONG_TAIL = Mix(((0.85, (32, 128), (48, 96)), (0.15, (0.75, 0.92), (8, 32))), rate_per_second=1.8)

# Rates keep the tiny model (one thread, on a shared two-core host) below
# capacity but for the chat scenario: an overloaded run measures its queue.
PANEL: tuple[Scenario, ...] = (
    Scenario(
        "short-low-rate",
        "short prompts at a low rate: no prefill long enough to stall anyone",
        Mix(((1.0, (32, 192), (16, 48)),), rate_per_second=3.0),
        duration_seconds=40,
        seed=11,
    ),
    Scenario(
        "long-tail",
        "long prompts (75-92% of the context) arriving while short requests decode",
        LONG_TAIL,
        duration_seconds=50,
        seed=12,
    ),
    Scenario(
        "chat-near-capacity",
        "chat-like turns (a tenth to 40% of the context, some history cached) near the workers' capacity",
        Mix(((1.0, (0.1, 0.4), (32, 96)),), rate_per_second=3.5, prefix_hit_share=0.3, prefix_request_share=0.6),
        duration_seconds=32,
        seed=13,
    ),
    Scenario(
        "long-prompts-low-concurrency",
        "long prompts (60-90% of the context), short answers, rarely two at once",
        Mix(((1.0, (0.6, 0.9), (16, 48)),), rate_per_second=1.0),
        duration_seconds=50,
        seed=14,
    ),
    Scenario(
        "unsplit-budget",
        "the long tail on a chunked pool whose budget (the whole context) never splits a prompt",
        LONG_TAIL,
        duration_seconds=50,
        seed=15,
        baseline=UNSPLIT,
    ),
    Scenario(
        "tuned-chunked",
        "the long tail on a chunked pool tuned right (the advisor reads the chunked run)",
        LONG_TAIL,
        duration_seconds=50,
        seed=16,
        observed="chunked",
    ),
    Scenario(
        "bursty-idle",
        "bursts of short and medium prompts with idle spells between them (arrival gaps' CV 4)",
        Mix(((1.0, (32, 400), (16, 48)),), rate_per_second=3.0, burstiness=4.0),
        duration_seconds=40,
        seed=17,
    ),
    Scenario(
        "prefix-shared",
        "long prompts sharing a long common prefix (85% of prompt tokens cached) among decoders",
        Mix(
            ((0.7, (32, 128), (48, 96)), (0.3, (0.6, 0.9), (16, 48))),
            rate_per_second=2.2,
            prefix_hit_share=0.85,
            prefix_request_share=1.0,
        ),
        duration_seconds=50,
        seed=18,
    ),
)

# The slow test's reduced panel: one row that pays and one that does not.
REDUCED = ("short-low-rate", "long-tail")


def select(names: list[str] | tuple[str, ...] | None) -> list[Scenario]:
    """The panel's scenarios by name (all when ``names`` is empty); ValueError names an unknown one."""
    if not names:
        return list(PANEL)
    known = {s.name: s for s in PANEL}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return [known[n] for n in names]
