from __future__ import annotations

from typing import Any

import pytest

from controlplane.alerts import defaults
from controlplane.alerts.models import AlertRule


@pytest.fixture
def shipped_rules(db: Any) -> None:
    """The shipped rules, switched off: a migration installs them, but a
    transactional test elsewhere in the run flushes every table."""
    defaults.install(AlertRule)
    AlertRule.objects.update(enabled=False)
