"""``python manage.py bench_metrics_page``: one worker's ``/metrics`` page,
rendered and parsed, the old path against the new (``controlplane.bench.metrics_page``)."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.bench import metrics_page


class Command(BaseCommand):
    help = "Time one worker's /metrics page: render and parse, old path against new."

    def add_arguments(self, parser: CommandParser) -> None:
        metrics_page.add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        code = metrics_page.main(argparse.Namespace(**options))
        if code:
            raise CommandError("the two paths' pages differ")
