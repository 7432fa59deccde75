"""The experiment runner's tunables (``controlplane.conf``: settings, else environment, else these)."""

from __future__ import annotations

from controlplane.conf import Tunable

EXPERIMENT_LEASE_SECONDS = Tunable(
    "EXPERIMENT_LEASE_SECONDS",
    15.0,
    "a runner holds its experiment this long between renewals; then another resumes it",
)
EXPERIMENT_SWEEP_INTERVAL_SECONDS = Tunable(
    "EXPERIMENT_SWEEP_INTERVAL_SECONDS", 10.0, "beat resumes experiments whose runner was lost this often"
)
EXPERIMENT_APPLY_TIMEOUT_SECONDS = Tunable(
    "EXPERIMENT_APPLY_TIMEOUT_SECONDS", 180.0, "an arm fails when its workers are not ready on its profile after this"
)
EXPERIMENT_DRAIN_TIMEOUT_SECONDS = Tunable(
    "EXPERIMENT_DRAIN_TIMEOUT_SECONDS", 60.0, "the longest wait for client requests in flight on cordoned workers"
)
EXPERIMENT_TOKENIZER_DIR = Tunable(
    "EXPERIMENT_TOKENIZER_DIR", "", "checkpoint whose tokenizer builds replay prompts; empty: stand-in token ids"
)
