"""Leave room in alerts_alert's pages on PostgreSQL: every cycle rewrites the
value of each active alert, none of them indexed, and with free space in the
page PostgreSQL updates in place (HOT) without touching the five indexes."""

from django.db import migrations


def set_fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE alerts_alert SET (fillfactor = 70)")


def reset_fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE alerts_alert RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [("alerts", "0004_deleted_rules_alerts_resolve")]
    operations = [migrations.RunPython(set_fillfactor, reset_fillfactor)]
