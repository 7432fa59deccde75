"""``python manage.py export_deploy``: write the Grafana dashboard and the
Prometheus rule file from the figure registry (``controlplane.metrics.deploy``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from controlplane.metrics import deploy


class Command(BaseCommand):
    help = "Write deploy/grafana/chunkpilot.json and deploy/prometheus/rules.yml from the figure registry."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--out", type=Path, default=Path(settings.BASE_DIR) / "deploy")

    def handle(self, *args: Any, **opts: Any) -> None:
        out: Path = opts["out"]
        for path, text in ((out / "grafana" / "chunkpilot.json", deploy.dashboard_json()),
                           (out / "prometheus" / "rules.yml", deploy.rules_yaml())):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            self.stdout.write(f"wrote {path}")
