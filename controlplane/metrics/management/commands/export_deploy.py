"""``python manage.py export_deploy``: write the Grafana dashboard, the
Prometheus scrape config, rules and their unit tests, and the Alertmanager
config from the figure registry (``controlplane.metrics.shipped``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from controlplane.metrics import shipped


class Command(BaseCommand):
    help = "Write deploy/ (Grafana dashboard, Prometheus config, rules and rule tests, Alertmanager config)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--out", type=Path, default=Path(settings.BASE_DIR) / "deploy")

    def handle(self, *args: Any, **opts: Any) -> None:
        out: Path = opts["out"]
        for relative, text in shipped.files().items():
            path = out / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            self.stdout.write(f"wrote {path}")
