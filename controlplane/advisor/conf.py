"""The advisor's tunables (``controlplane.conf``: settings, else environment, else these).

Every threshold of an answer is one of these, so an operator can set it; the
report shows the value it used beside each verdict.
"""

from __future__ import annotations

from controlplane.conf import Tunable

ADVISOR_MIN_REQUESTS = Tunable("ADVISOR_MIN_REQUESTS", 100, "fewer logged requests in the window: not enough data")
ADVISOR_MIN_SAMPLES = Tunable("ADVISOR_MIN_SAMPLES", 20, "fewer kept scrapes in the window: not enough data")
ADVISOR_MIN_GAPS = Tunable(
    "ADVISOR_MIN_GAPS", 50, "fewer decode gaps during (or outside) long prefills: head-of-line blocking not judged"
)
ADVISOR_LONG_PROMPT_TOKENS = Tunable("ADVISOR_LONG_PROMPT_TOKENS", 8192, "a prompt over this many tokens is long")
ADVISOR_LONG_TAIL_SHARE = Tunable("ADVISOR_LONG_TAIL_SHARE", 0.05, "long tail: at least this share of prompts is long")
ADVISOR_LONG_TAIL_P99_OVER_P50 = Tunable(
    "ADVISOR_LONG_TAIL_P99_OVER_P50", 8.0, "long tail: or the P99 prompt is at least this many times the median"
)
ADVISOR_SATURATED_SHARE = Tunable(
    "ADVISOR_SATURATED_SHARE",
    0.10,
    "concurrency held back: requests waited at max_num_seqs or a nearly full KV cache in this share of scrapes",
)
ADVISOR_KV_NEARLY_FULL = Tunable("ADVISOR_KV_NEARLY_FULL", 0.90, "KV cache usage at or above this is nearly full")
ADVISOR_QUEUE_P99_SECONDS = Tunable(
    "ADVISOR_QUEUE_P99_SECONDS", 1.0, "concurrency held back: or queue time P99 at least this, with preemptions"
)
ADVISOR_MEMORY_PEAK_TO_MEAN = Tunable(
    "ADVISOR_MEMORY_PEAK_TO_MEAN",
    1.5,
    "memory peak caps the batch: peak/mean at least this (and KV full or preemptions)",
)
ADVISOR_HOL_RATIO = Tunable(
    "ADVISOR_HOL_RATIO", 2.0, "head-of-line blocking: P99 decode gap during long prefills over the rest, at least this"
)
ADVISOR_CHUNK_TOO_SMALL_DROP = Tunable(
    "ADVISOR_CHUNK_TOO_SMALL_DROP", 0.15, "chunk too small: throughput per worker this share below the baseline"
)
ADVISOR_BUDGET_MIN_STALL_GAIN = Tunable(
    "ADVISOR_BUDGET_MIN_STALL_GAIN",
    2.0,
    "budget too large: stall P99 not at least this many times better than monolithic",
)
ADVISOR_STARVATION_RATIO = Tunable(
    "ADVISOR_STARVATION_RATIO", 3.0, "starvation: one kind's wait at least this many times the other's"
)
ADVISOR_LINK_BANDWIDTH_GBPS = Tunable(
    "ADVISOR_LINK_BANDWIDTH_GBPS", 25.0, "PD estimate: the prefill-to-decode link's bandwidth, GB/s"
)
ADVISOR_PD_MAX_TRANSFER_SHARE = Tunable(
    "ADVISOR_PD_MAX_TRANSFER_SHARE",
    0.5,
    "PD estimate: pays when the KV transfer is at most this share of the prefill time",
)
ADVISOR_WINDOW_SECONDS = Tunable("ADVISOR_WINDOW_SECONDS", 3600.0, "the window the kept report covers")
ADVISOR_INTERVAL_SECONDS = Tunable("ADVISOR_INTERVAL_SECONDS", 300.0, "beat recomputes the kept reports this often")
