"""Minute rollups keep the head of the vector (the counters and the charted
histograms) at the minute's first and last scrape, and the first's time, so
a chart's windows read minute rollups exactly and small (models.py).

The packed vector and the two heads (plain float64 bytes, ~1 KB each) pass
PostgreSQL's 2-KB TOAST target, which by default would move the largest out
of line: a second index probe and page for each row a chart reads.
``STORAGE MAIN`` has PostgreSQL compress them in the row instead (the heads
shrink; the zlib vector does not) and move nothing out unless the row cannot
fit a page."""

from typing import Any

from django.db import migrations, models


def _inline(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            'ALTER TABLE metrics_rollup ALTER COLUMN "values" SET STORAGE MAIN, '
            "ALTER COLUMN head_first SET STORAGE MAIN, ALTER COLUMN head_last SET STORAGE MAIN"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("metrics", "0002_scrape_round_shards"),
    ]

    operations = [
        migrations.AddField(
            model_name="rollup",
            name="first_ts",
            field=models.DateTimeField(help_text="the minute's first scrape (null: a row from before 0003)", null=True),
        ),
        migrations.AddField(
            model_name="rollup",
            name="head_first",
            field=models.BinaryField(help_text="the head of the totals at the minute's first scrape", null=True),
        ),
        migrations.AddField(
            model_name="rollup",
            name="head_last",
            field=models.BinaryField(help_text="the head of the totals at its last (of values)", null=True),
        ),
        migrations.RunPython(_inline, migrations.RunPython.noop, elidable=True),
    ]
