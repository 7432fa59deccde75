"""The simulated GPU every sim test shares: loading the database takes seconds."""

from __future__ import annotations

import pytest

from workers.engines.sim.steptime import AicDevice

SYSTEM, BACKEND, MODEL = "h200_sxm", "vllm", "meta-llama/Meta-Llama-3.1-8B"


@pytest.fixture(scope="session")
def h200() -> AicDevice:
    return AicDevice(SYSTEM, BACKEND, MODEL)
