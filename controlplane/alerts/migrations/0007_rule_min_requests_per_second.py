"""A rule may need load before it judges (``min_requests_per_second``), and
two shipped rules stop alerting on a healthy demo: memory peak/mean is
judged only under load, and a worker is missing after a minute of silence
(a restart finds every worker silent since it stopped). Shipped rules an
operator has changed keep their values."""

from django.db import migrations, models


def quieter_shipped_rules(apps, schema_editor):
    from controlplane.alerts import defaults

    AlertRule = apps.get_model("alerts", "AlertRule")
    AlertRule.objects.filter(key="memory-peak-to-mean-high", min_requests_per_second=None).update(
        min_requests_per_second=defaults.MEMORY_RULE_MIN_REQUESTS_PER_SECOND
    )
    AlertRule.objects.filter(key="worker-missing", for_seconds=0.0).update(
        for_seconds=defaults.WORKER_MISSING_FOR_SECONDS
    )


class Migration(migrations.Migration):
    dependencies = [("alerts", "0006_inbound_alert_resolution")]

    operations = [
        migrations.AddField(
            model_name="alertrule",
            name="min_requests_per_second",
            field=models.FloatField(
                blank=True,
                help_text="judge only groups serving at least this many requests/s over the window; an idle one "
                "counts as ok (an idle engine's memory peak/mean is high by nature)",
                null=True,
            ),
        ),
        migrations.RunPython(quieter_shipped_rules, migrations.RunPython.noop),
    ]
