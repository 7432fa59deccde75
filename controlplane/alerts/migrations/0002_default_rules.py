"""Install the rules Chunkpilot ships (controlplane/alerts/defaults.py)."""

from django.db import migrations


def install(apps, schema_editor):
    from controlplane.alerts import defaults

    defaults.install(apps.get_model("alerts", "AlertRule"))


def remove(apps, schema_editor):
    from controlplane.alerts import defaults

    keys = [rule["key"] for rule in defaults.DEFAULT_RULES]
    apps.get_model("alerts", "AlertRule").objects.filter(key__in=keys).delete()


class Migration(migrations.Migration):
    dependencies = [("alerts", "0001_initial")]
    operations = [migrations.RunPython(install, remove)]
