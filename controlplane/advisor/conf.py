"""The advisor's tunables (``controlplane.conf``: settings, else environment, else these).

Every threshold of an answer is one row of ``verdicts.Thresholds`` (field,
default, unit, meaning); each becomes the tunable ``ADVISOR_<FIELD>`` here,
so an operator can set it and the report shows the value it used beside
each verdict. Add a threshold there, never here.
"""

from __future__ import annotations

from typing import Any

from controlplane.advisor.verdicts import THRESHOLDS
from controlplane.conf import Tunable


def tunable_name(field: str) -> str:
    return f"ADVISOR_{field.upper()}"


def threshold(field: str) -> Tunable[Any]:
    """The tunable of ``Thresholds.<field>``."""
    found: Tunable[Any] = globals()[tunable_name(field)]
    return found


for _row in THRESHOLDS:
    globals()[tunable_name(_row.field)] = Tunable(
        tunable_name(_row.field), _row.default, f"{_row.meaning} ({_row.unit})"
    )

ADVISOR_WINDOW_SECONDS = Tunable("ADVISOR_WINDOW_SECONDS", 3600.0, "the window the kept report covers")
ADVISOR_INTERVAL_SECONDS = Tunable("ADVISOR_INTERVAL_SECONDS", 300.0, "beat recomputes the kept reports this often")
