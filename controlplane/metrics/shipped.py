"""Every file ``deploy/`` ships, by its path under it: what ``manage.py
export_deploy`` writes and a test keeps current. Apart from ``deploy.py``
because the rules' unit tests (``rule_tests.py``) read that module's rules:
this one takes both, and neither takes the other's way round."""

from __future__ import annotations

from controlplane.metrics import deploy, rule_tests


def files() -> dict[str, str]:
    """Every shipped file by its path under ``deploy/``."""
    return {
        "grafana/chunkpilot.json": deploy.dashboard_json(),
        "prometheus/prometheus.yml": deploy.prometheus_yaml(),
        "prometheus/rules.yml": deploy.rules_yaml(),
        "prometheus/rules.test.yml": rule_tests.rule_tests_yaml(),
        "alertmanager/alertmanager.yml": deploy.alertmanager_yaml(),
    }
